"""Where an offloaded model's bytes live and how they move: the I/O engine, the swap space on
NVMe, the mover and the scheduler of the parameters' units, the gradient pager and the
activation pager. Set up at ``offload``, taken down at ``close``."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch import nn

from ..aio.swap import SwapSpace, stable_tag
from ..core.homes import NvmeHome, RamHome
from ..core.mover import NBUF, STAGING_CHUNK, Mover
from ..core.scheduler import Scheduler
from ..core.stats import Stats
from ..core.units import State, Unit
from ..utils import memory
from ..utils.sizes import format_bytes
from .activations import ActivationPager
from .build import Layout
from .contract import PagedOptimizer, settle
from .grads import GradPager
from .policy import BasePolicy


class Tiers:
    """The engine, swap space, mover, scheduler and pagers of one model, and the residency
    of its units outside the passes (``resident``). Each is None until set up (and again once
    closed): a model kept resident has none of the parameters' ones."""

    def __init__(self, policy: BasePolicy, device: torch.device, stats: Stats,
                 optimizers: weakref.WeakSet[PagedOptimizer]) -> None:
        self.policy = policy
        self.device = device
        self.stats = stats
        self.optimizers = optimizers  # their deferred updates come first (``resident``)
        self.engine: Any = None
        self.swap: SwapSpace | None = None
        self.mover: Mover | None = None
        self.scheduler: Scheduler | None = None
        self.grads: GradPager | None = None
        self.activations: ActivationPager | None = None

    @contextlib.contextmanager
    def resident(self, units: list[Unit], writeback: bool = False) -> Iterator[None]:
        """Keeps ``units`` resident (over budget if need be) inside the block."""
        if self.mover is None:  # nothing is offloaded
            yield
            return
        settle(self.optimizers, units)
        self.scheduler.acquire(units, force=True, record=False)
        try:
            yield
        finally:
            if writeback:
                for u in units:
                    self.scheduler.flush(u)
            self.scheduler.release(units)
            self.scheduler.trim()

    def check_ram_homes(self, layout: Layout) -> None:
        """With CUDA compute, ``cpu_budget`` bounds the pinned RAM homes: all the parameters
        (params="cpu") and all the trainable ones' gradients (grads="cpu")."""
        policy = self.policy
        held, what, fix = 0, [], []
        if policy.params == "cpu":
            held += sum(u.nbytes for u in layout.units)
            what.append('params="cpu" keeps all parameters')
            fix.append('params="nvme"')
        if policy.pages_grads and policy.grads == "cpu":
            held += sum(p.numel() * p.element_size() for u in layout.units for p in u.params
                        if p.requires_grad)
            what.append('grads="cpu" keeps all gradients')
            fix.append('grads="gpu"')
        if held > policy.cpu_budget:
            raise MemoryError(
                f"{' and '.join(what)} in pinned RAM: {held} bytes ({format_bytes(held)}), over "
                f"cpu_budget={policy.cpu_budget}; use {' or '.join(fix)}, or raise cpu_budget")

    def setup(self, layout: Layout, io_delay: Callable[[], None] | None) -> None:
        """Engine, mover, swap space, scheduler and gradient pager for the parameters; each
        unit then goes to its home."""
        policy = self.policy
        largest = layout.largest
        self.engine = policy.io.engine()
        chunk = min(STAGING_CHUNK, -(-max(largest.nbytes, 1) // 4096) * 4096)
        self.mover = Mover(self.device, chunk, NBUF, self.stats, io_delay,
                           checksum=policy.checksum)
        if policy.params == "nvme":
            if self.device.type == "cpu":
                memory.return_freed_memory(memory.heap_reuse(layout.budget))
            names = [f"{n}:{tuple(s.param.shape)}:{s.param.dtype}"
                     for u in layout.units for n, s in zip(u.names, u.segments)]
            need = sum(-(-u.nbytes // 4096) * 4096 for u in layout.units)
            self.swap = SwapSpace(policy.nvme_dir, need, stable_tag(names), self.engine)
        prefetch_units, prefetch_bytes = policy.prefetch_window()
        self.scheduler = Scheduler(layout.units, self.mover, layout.budget, prefetch_units,
                                   prefetch_bytes, self.stats, policy.adapt)
        self.grads = None
        if policy.pages_grads:  # to NVMe, or to pinned RAM with CUDA compute
            swap = self.swap
            home = ((lambda n: NvmeHome(swap, n)) if policy.grads == "nvme" else
                    (lambda n: RamHome(n, True, self.stats)))
            self.grads = GradPager(layout.units, home, self.mover, self.stats)
        self._move_home(layout)

    def _move_home(self, layout: Layout) -> None:
        """Gives each unit its home and writes its current values there, one unit at a time."""
        pin = self.device.type == "cuda"
        for u in layout.units:
            meta = any(id(p) in layout.uninitialized for p in u.params)
            for s in u.segments:
                p = s.param
                if meta:
                    continue
                if p.device != self.device or p.untyped_storage().nbytes() != s.end - s.start \
                        or not p.is_contiguous():
                    # Each parameter needs a storage of its own to be freed and refilled alone.
                    p.data = p.data.to(self.device, copy=True).contiguous()
            u.home = (NvmeHome(self.swap, u.nbytes) if self.swap else
                      RamHome(u.nbytes, pin, self.stats))
            if self.swap is not None and self.device.type == "cpu":
                u.adopt_flat(self.swap.align)
            if u.on_rebind is not None:
                u.on_rebind()
            if meta:
                u.initialized = False
            else:
                self.scheduler.flush(u)
            u.free()
            u.move_to(State.AWAY)
        if self.device.type == "cpu":
            # Parameters built while glibc's mmap threshold had grown lie inside its heap;
            # freed there, their pages stay in RAM until the heap is trimmed.
            memory.trim_heap()

    def setup_activations(self, model: nn.Module, units: list[Unit],
                          io_delay: Callable[[], None] | None, handles: list[Any]) -> None:
        """Saved-tensor hooks around the model's forward page what it saves for backward."""
        policy = self.policy
        swap = self.swap
        if policy.activations == "nvme" and swap is None:
            if self.engine is None:
                self.engine = policy.io.engine()
            names = [n for u in units for n in u.names]
            swap = self.swap = SwapSpace(policy.nvme_dir, 0, "act-" + stable_tag(names),
                                         self.engine)
        if self.device.type == "cpu":
            memory.return_freed_memory()
        params = [p for u in units for p in u.params]
        self.activations = ActivationPager(
            policy.activations, self.device, policy.activation_threshold,
            policy.prefetch_window(), swap if policy.activations == "nvme" else None,
            lambda: params, io_delay, checksum=policy.checksum, ledger=self.stats)
        pager = self.activations
        handles.append(model.register_forward_pre_hook(
            lambda m, a: pager.begin(), prepend=True))
        handles.append(model.register_forward_hook(
            lambda m, a, o: pager.end(), always_call=True))

    def close(self, units: list[Unit], attempt: Callable[[Callable[[], Any]], None]) -> None:
        """Takes everything down, each part through ``attempt`` (which keeps its error and
        goes on), the units' homes released."""
        if self.grads is not None:
            attempt(self.grads.close)
        if self.scheduler is not None:
            attempt(self.scheduler.drain)
        if self.mover is not None:
            attempt(self.mover.close)
            self.mover = None
        if self.scheduler is not None:
            self.scheduler.pool.clear()
        if self.activations is not None:
            attempt(self.activations.close)
            self.activations = None
        for u in units:
            if u.home is not None:
                u.home.release()
                u.home = None
        if self.swap is not None:
            attempt(self.swap.close)
            self.swap = None
        if self.engine is not None:
            attempt(self.engine.close)
            self.engine = None

"""``offload(model, policy)``: parameters live in a lower tier and are brought to the compute
device just ahead of the module that needs them, by forward and backward hooks.

Per-model state lives in one ``OffloadState`` (``model._tieroffload``). The model is changed in
place and keeps its ``nn.Parameter`` objects, so optimizers built before or after see the same
parameters.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import weakref
from collections.abc import Iterator
from typing import Any, Callable

from torch import nn

from ..aio.swap import SwapSpace, stable_tag
from ..core.homes import NvmeHome, RamHome
from ..core.mover import NBUF, STAGING_CHUNK, Mover
from ..core.scheduler import Scheduler
from ..core.stats import Stats
from ..core.threads import CoreLender
from ..core.units import State, Unit
from ..integrations import accelerate, fsdp
from ..utils import memory
from ..utils.dist import world_size
from ..utils.sizes import format_bytes
from .activations import ActivationPager
from .build import UnitBuilder
from .grads import GradPager
from .guards import Guards, check_not_dispatched
from .passes import PassHooks
from .policy import BasePolicy
from .state_dict import StateDictHooks
from .steps import StepHooks, clip_paged, has_paged_grads, live
from .window import Window, gpu_memory, io_split

log = logging.getLogger("tieroffload")


class OffloadState(UnitBuilder, PassHooks, StepHooks, StateDictHooks, Guards):
    """Everything tieroffload keeps for one wrapped model."""

    def __init__(self, model: nn.Module, policy: BasePolicy,
                 io_delay: Callable[[], None] | None = None) -> None:
        self.policy = policy
        self.device = policy.compute_device()
        self.stats = Stats()
        self.window = Window()  # see stats(model, window=True)
        self.cores = CoreLender(policy.lend_core and policy.params == "nvme"
                                and self.device.type == "cpu")
        self._handles: list[Any] = []
        self._bwd_pins: dict[int, int] = {}
        self._fwd_pins: dict[int, int] = {}  # unit id -> forwards that acquired, not released
        self._touched: list[Unit] = []  # held for views taken outside the hooks (guards)
        self._quiet = 0  # inside state_dict(), whose hooks hand out the true values
        self._copies: dict[int, tuple[str, Any]] = {}  # id(p) -> its last state-dict copy
        self._bwd_callback_queued = False
        self._fresh_forward = False  # a forward ran since the last backward began
        self._counted = False  # the backward under way counted as a micro-batch
        self.materialized = 0  # depth of materialize() blocks open
        self._opt_pins: dict[int, tuple[list[Unit], bool]] = {}  # optimizer -> units, grads
        self._grads_seen: dict[int, int] = {}
        self._deferred: list[Unit] = []  # units whose gradients wait for the end of backward
        self._defer_grads = False
        self.swap: SwapSpace | None = None
        self.grads: GradPager | None = None
        self.optimizers: weakref.WeakSet[Any] = weakref.WeakSet()  # paged ones, closed with us
        self.pending_opts: set[Any] = set()  # paged ones with deferred updates: kept alive
        self.engine = None
        self.mover: Mover | None = None
        self.scheduler: Scheduler | None = None
        self.activations: ActivationPager | None = None
        self.autobatch: Any = None  # an AutoBatch over this model reports in stats()
        self._fsdp_ids: set[int] = set()
        self.shards: list[fsdp.Shard] = []  # FSDP's local shards, when the model is sharded
        self._undo: list[Callable[[], None]] = []  # FSDP methods wrapped by us

        if policy.params == "gpu" and self.device.type != "cuda":
            raise ValueError('params="gpu" needs a CUDA compute device; this one is '
                             f"{self.device}")
        self.offloaded = policy.pages_params
        fsdp_groups = self._fsdp_groups(model)
        self._uninitialized = self._materialize_meta(model)
        self.units, self.module_units = self._build_units(model)
        self.fsdp_units = self._build_fsdp_units(model, fsdp_groups)
        self.param_unit = {id(s.param): u for u in self.units for s in u.segments}
        self.param_unit.update({id(s.public): self.param_unit[id(s.local)] for s in self.shards})
        self._local = {id(s.public): s.local for s in self.shards}
        largest = max(self.units, key=lambda u: u.nbytes, default=None)
        self.budget = self._check_budget(largest)
        self._add_descendants(model)

        if not self.offloaded or largest is None:
            # Resident tier: the parameters stay where compute is; nothing moves.
            for p in model.parameters():
                if id(p) in self._uninitialized:
                    p.untyped_storage().resize_(p.numel() * p.element_size())
                elif p.device != self.device:
                    p.data = p.data.to(self.device)
        elif self.device.type == "cuda" and policy.cpu_budget is not None:
            self._check_ram_homes(policy)
        if policy.pages_grads:
            sparse = next((n for n, m in model.named_modules()
                           if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse), None)
            if sparse is not None:
                raise ValueError(
                    f"tieroffload.offload: module {sparse!r} has sparse=True, whose sparse "
                    f"gradients cannot be paged (grads={policy.grads!r}): keep them on the "
                    'compute device (grads="cpu" on the CPU, grads="gpu" with CUDA)')
        try:  # a failure here (no room on the disk, say) leaves no thread or file behind
            if self.offloaded and largest is not None:
                self._setup_tiers(largest, io_delay)
                self._install_hooks(model)
                self._install_guards(model)
                if self.grads is not None:  # what p.grad None hides from the user's tools
                    accelerate.route_clip(has_paged_grads, clip_paged)
                # paged gradients and a paged optimizer's step see each zero_grad()
                self._forget_grads_on_zero_grad(model)
            if policy.activations is not None:
                self._setup_activations(model, io_delay)
        except BaseException:
            self.close(restore=False)
            raise
        live.add(self)

    def _setup_tiers(self, largest: Unit, io_delay: Callable[[], None] | None) -> None:
        policy = self.policy
        self.engine = policy.io.engine()
        chunk = min(STAGING_CHUNK, -(-max(largest.nbytes, 1) // 4096) * 4096)
        self.mover = Mover(self.device, chunk, NBUF, self.stats, io_delay,
                           checksum=self.policy.checksum)
        if policy.params == "nvme":
            if self.device.type == "cpu":
                memory.return_freed_memory(memory.heap_reuse(self.budget))
            names = [f"{n}:{tuple(s.param.shape)}:{s.param.dtype}"
                     for u in self.units for n, s in zip(u.names, u.segments)]
            need = sum(-(-u.nbytes // 4096) * 4096 for u in self.units)
            self.swap = SwapSpace(policy.nvme_dir, need, stable_tag(names), self.engine)
        prefetch_units, prefetch_bytes = policy.prefetch_window()
        self.scheduler = Scheduler(self.units, self.mover, self.budget, prefetch_units,
                                   prefetch_bytes, self.stats, policy.adapt)
        self.grads = None
        if policy.pages_grads:  # to NVMe, or to pinned RAM with CUDA compute
            swap = self.swap
            home = ((lambda n: NvmeHome(swap, n)) if policy.grads == "nvme" else
                    (lambda n: RamHome(n, True, self.stats)))
            self.grads = GradPager(self.units, home, self.mover, self.stats)
        # With several ranks, DDP reduces the gradients in a callback at the end of backward:
        # they are paged once backward is over, after it (see _end_backward).
        self._defer_grads = self.grads is not None and world_size() > 1
        self._move_home()

    def _check_ram_homes(self, policy: BasePolicy) -> None:
        """With CUDA compute, ``cpu_budget`` bounds the pinned RAM homes: all the parameters
        (params="cpu") and all the trainable ones' gradients (grads="cpu")."""
        held, what, fix = 0, [], []
        if policy.params == "cpu":
            held += sum(u.nbytes for u in self.units)
            what.append('params="cpu" keeps all parameters')
            fix.append('params="nvme"')
        if policy.pages_grads and policy.grads == "cpu":
            held += sum(p.numel() * p.element_size() for u in self.units for p in u.params
                        if p.requires_grad)
            what.append('grads="cpu" keeps all gradients')
            fix.append('grads="gpu"')
        if held > policy.cpu_budget:
            raise MemoryError(
                f"{' and '.join(what)} in pinned RAM: {held} bytes ({format_bytes(held)}), over "
                f"cpu_budget={policy.cpu_budget}; use {' or '.join(fix)}, or raise cpu_budget")

    def _setup_activations(self, model: nn.Module, io_delay: Callable[[], None] | None) -> None:
        """Saved-tensor hooks around the model's forward page what it saves for backward."""
        policy = self.policy
        swap = self.swap
        if policy.activations == "nvme" and swap is None:
            if self.engine is None:
                self.engine = policy.io.engine()
            names = [n for u in self.units for n in u.names]
            swap = self.swap = SwapSpace(policy.nvme_dir, 0, "act-" + stable_tag(names),
                                         self.engine)
        if self.device.type == "cpu":
            memory.return_freed_memory()
        params = [p for u in self.units for p in u.params]
        self.activations = ActivationPager(
            policy.activations, self.device, policy.activation_threshold,
            policy.prefetch_window(), swap if policy.activations == "nvme" else None,
            lambda: params, io_delay, checksum=policy.checksum, ledger=self.stats)
        pager = self.activations
        self._handles.append(model.register_forward_pre_hook(
            lambda m, a: pager.begin(), prepend=True))
        self._handles.append(model.register_forward_hook(
            lambda m, a, o: pager.end(), always_call=True))

    def _move_home(self) -> None:
        """Gives each unit its home and writes its current values there, one unit at a time."""
        pin = self.device.type == "cuda"
        for u in self.units:
            meta = any(id(p) in self._uninitialized for p in u.params)
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

    @contextlib.contextmanager
    def resident(self, units: list[Unit], writeback: bool = False) -> Iterator[None]:
        """Keeps ``units`` resident (over budget if need be) inside the block."""
        if self.mover is None:  # nothing is offloaded
            yield
            return
        self.settle(units)
        self.scheduler.acquire(units, force=True, record=False)
        try:
            yield
        finally:
            if writeback:
                for u in units:
                    self.scheduler.flush(u)
            self.scheduler.release(units)
            self.scheduler.trim()

    @contextlib.contextmanager
    def loading(self, optimizer: Any = None) -> Iterator[None]:
        """Around a load that replaces every parameter (``load_checkpoint``) and, where one is
        given, every state of a paged ``optimizer``: what a failed step left undone is dropped
        (``abandon_step``), and units that are away come in without a read, as their bytes
        (maybe the ones a disk error spoiled) are all replaced. A load after a failed read,
        a failed step or a torn one then restores exactly."""
        if getattr(optimizer, "_tieroffload_paged", False):
            optimizer.abandon_step()
        away = [u for u in self.units if u.state is State.AWAY and u.initialized]
        for u in away:
            u.initialized = False  # no read: see Scheduler._start_fetch
        try:
            yield
        finally:
            for u in away:
                u.initialized = True

    def memory(self) -> dict[str, int]:
        """This process's resident memory, every byte of it given to one holder: ``params``,
        ``grads``, ``optimizer`` (state and masters), ``staging`` (the movers' and the host
        step's buffers), ``parked`` (pages kept for the next unit) and ``activations`` (saved
        tensors the activation pager holds on their way to its tier or back) are what
        tieroffload holds, in RAM now by the kernel's count; ``tensors`` the rest of malloc's
        memory in use (torch tensors such as the activations autograd keeps and temporaries,
        Python's larger objects); ``heap_free`` what malloc keeps freed for reuse; ``files``
        mapped code and files; ``other`` the remainder (thread stacks, Python's small-object
        arenas). Every part is >= 0 and they add up to ``rss`` exactly (one reading of
        /proc). malloc's figures count address space: pages it trimmed (malloc_trim hands
        back the pages of free blocks, which it still counts free) or that nobody touched
        are not in RAM. So the parts are filled in that order from the anonymous RSS, each
        capped by what is left: what tieroffload maps is the kernel's exact count, and
        ``tensors`` and ``heap_free`` are at most their malloc figures (a 3.2 B run's peak
        had 7.96 GiB "free" in a 3.34 GiB RSS, and ``other`` came out at -6.50 GiB)."""
        kinds = ("params", "grads", "optimizer", "staging", "parked", "activations")
        ranges: dict[str, list[tuple[int, int]]] = {k: [] for k in kinds}
        heap = dict.fromkeys(kinds, 0)

        def add(kind: str, held: tuple[list[tuple[int, int]], int]) -> None:
            ranges[kind] += held[0]
            heap[kind] += held[1]

        for u in self.units:
            add("params", u.held())
        if self.grads is not None:
            for g in self.grads.buffers.values():
                add("grads", g.held())
                if isinstance(g.home, RamHome):
                    add("grads", ([(g.home.buf.data_ptr(), g.home.buf.numel())], 0))
            add("parked", (list(self.grads.pool.ranges), 0))
        if self.scheduler is not None:
            add("parked", (list(self.scheduler.pool.ranges), 0))
        if self.mover is not None:
            add("staging", (self.mover.held(), 0))
        for opt in list(self.optimizers):
            for kind, held in opt.held().items():
                add(kind, held)
        if self.activations is not None:
            add("activations", self.activations.held())
        mapped = {k: memory.resident_bytes(ranges[k]) for k in kinds}
        in_use, free = memory.heap()
        os_view = memory.rss_parts()
        left = os_view["anon"]

        def take(n: int) -> int:
            nonlocal left
            n = min(max(n, 0), left)
            left -= n
            return n

        out = {"rss": os_view["rss"]}
        out.update({k: take(mapped[k]) for k in kinds})
        for k in kinds:
            out[k] += take(heap[k])
        out["tensors"] = take(in_use - sum(heap.values()))
        out["heap_free"] = take(free)
        out["files"] = os_view["files"]
        out["other"] = left
        return out

    def close(self, restore: bool = True) -> None:
        """Removes the hooks and the swap space. With ``restore`` the parameters are made
        resident first, so the model goes on as a plain model. Everything is released even
        where a part fails (a deferred update or a unit that cannot be read back, after a
        disk error): the first error is raised once, after; the model is then closed."""
        failed: list[Exception] = []

        def attempt(part: Callable[[], Any]) -> None:
            try:
                part()
            except Exception as e:
                failed.append(e)

        self.cores.give_back()
        if restore:
            attempt(self.settle)
        for opt in list(self.optimizers):
            attempt(lambda opt=opt: opt.close(apply=False))  # applied above if restoring
        self.pending_opts.clear()
        if restore and self.mover is not None:
            attempt(lambda: self.scheduler.acquire(self.units, force=True, record=False))
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for undo in self._undo:
            undo()
        self._undo.clear()
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
        for u in self.units:
            if u.home is not None:
                u.home.release()
                u.home = None
        if self.swap is not None:
            attempt(self.swap.close)
            self.swap = None
        if self.engine is not None:
            attempt(self.engine.close)
            self.engine = None
        live.discard(self)
        if failed:
            raise failed[0]



def offload(model: nn.Module, policy: BasePolicy | None = None, *,
            _io_delay: Callable[[], None] | None = None) -> nn.Module:
    """Pages ``model``'s parameters to ``policy.params`` and installs the hooks that bring them
    back ahead of use. Changes the model in place and returns it."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"tieroffload.offload: model must be a torch.nn.Module, not "
                        f"{type(model).__name__}")
    if policy is not None and not isinstance(policy, BasePolicy):
        hint = (f'Policy(params={policy!r}, nvme_dir="/mnt/nvme")' if policy == "nvme" else
                f"Policy(params={policy!r})" if policy in ("gpu", "cpu") else
                "Policy(params='nvme', nvme_dir=...) (params is one of 'gpu', 'cpu', 'nvme')")
        raise TypeError(f"tieroffload.offload: policy must be a tieroffload.Policy, not "
                        f"{policy!r}: use tieroffload.offload(model, {hint})")
    if getattr(model, "_tieroffload", None) is not None:
        raise ValueError("model is already offloaded; tieroffload.close(model) first")
    _check_not_offloaded_elsewhere(model)
    check_not_dispatched(model)
    state = OffloadState(model, policy or BasePolicy(), _io_delay)
    model._tieroffload = state
    return model


def _check_not_offloaded_elsewhere(model: nn.Module) -> None:
    """Refuses a model one of whose parameters an open ``offload`` of another module (one
    that contains it, or that it contains) already pages."""
    for name, p in model.named_parameters():
        if any(id(p) in s.param_unit for s in list(live)):
            raise ValueError(
                f"tieroffload.offload: parameter {name!r} is already offloaded with another "
                "module (one that contains this one, or one inside it): offload the whole "
                "model once, or tieroffload.close() that module first")


def _state(model: nn.Module) -> OffloadState:
    state = getattr(model, "_tieroffload", None)
    if state is None:
        raise ValueError("model is not offloaded (call tieroffload.offload(model, policy))")
    return state


def stats(model: nn.Module, window: bool = False, reset: bool = False) -> dict[str, Any]:
    """Bytes moved per tier and direction, seconds compute waited on I/O, prefetch hits, late
    prefetches and misses, acquires after which compute lent a core to I/O (``lent``),
    evictions, resident and peak resident bytes on the compute device, pinned bytes and
    their peak, the budget, the fixed staging overhead, ``io``: bytes per tier and kind
    (parameters, gradients, optimizer state, activations) and waits per kind, ``memory``:
    the process's RSS split by holder (see ``OffloadState.memory``), ``peak_rss``, and
    ``gpu`` (CUDA's allocated and reserved bytes) with CUDA compute.

    Counters are cumulative since ``offload``; with ``window=True`` they are those since the
    window began, and the peaks the window's (see ``hooks.window``). ``reset=True`` starts a
    new window once this one is read: a per-step monitor reads with both."""
    s = _state(model)
    d = s.stats.as_dict()
    if s.activations is not None:
        d["activations"] = dict(s.activations.stats.__dict__)
    if s.autobatch is not None:
        d["autobatch"] = s.autobatch.stats()
    d["io"] = io_split(d, s.activations.tier if s.activations is not None else None)
    mem = s.memory()
    d.update(memory=mem, peak_rss=max(memory.peak_rss(), mem["rss"]), gpu=gpu_memory(s.device),
             budget=s.budget, overhead=s.mover.overhead if s.mover else 0, device=str(s.device),
             tier=s.policy.params, swap=s.swap.path if s.swap else None)
    out = s.window.view(d, s.stats) if window else d
    if reset:
        s.window.reset(d, s.stats, s.device)
    return out


@contextlib.contextmanager
def materialize(model: nn.Module, writeback: bool = False) -> Iterator[nn.Module]:
    """Makes every parameter resident inside the block, so that its values can be read (or,
    with ``writeback=True``, changed) directly."""
    s = _state(model)
    s.check_loaded(s.units)
    with s.resident(s.units, writeback=writeback):
        s.materialized += 1
        try:
            yield model
        finally:
            s.materialized -= 1
            for u in s.units if writeback else ():
                s.wrote(u)


def close(model: nn.Module, restore: bool = True) -> None:
    """Undoes ``offload``: removes hooks, closes its paged optimizers and deletes the swap space
    (see OffloadState.close)."""
    state = _state(model)
    try:
        state.close(restore)
    finally:  # closed even where it raised (see OffloadState.close)
        model._tieroffload = None


@atexit.register
def _close_all() -> None:
    for s in list(live):
        s.close(restore=False)

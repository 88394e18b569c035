"""``offload(model, policy)``: parameters live in a lower tier and are brought to the compute
device just ahead of the module that needs them, by forward and backward hooks.

Per-model state lives in one ``OffloadState`` (``model._tieroffload``, see ``registry``), the
root that owns one collaborator per concern (docs/design.md, "who owns what"). The model is
changed in place and keeps its ``nn.Parameter`` objects, so optimizers built before or after
see the same parameters.
"""

from __future__ import annotations

import atexit
import contextlib
import weakref
from collections.abc import Iterator
from typing import Any, Callable

from torch import nn

from ..core.homes import RamHome
from ..core.stats import Stats
from ..core.threads import CoreLender
from ..core.units import State
from ..utils import memory
from . import registry
from .build import Layout
from .contract import PagedOptimizer, settle
from .guards import Guards, check_not_dispatched, mark_written, refuse_deepcopy, refuse_pickle
from .passes import Passes
from .policy import BasePolicy
from .state_dict import StateDicts
from .steps import PlainSteps, accelerate_clip
from .tiers import Tiers
from .window import Window, gpu_memory, io_split


class Owned:
    """An attribute of ``OffloadState`` that one of its collaborators owns: read (and set)
    there, so that code written against the state (the paged optimizer, checkpoints, tests)
    finds it under its old name while one object holds it."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.name = ""

    def __set_name__(self, cls: type, name: str) -> None:
        self.name = name

    def __get__(self, state: Any, cls: type | None = None) -> Any:
        if state is None:
            return self
        return getattr(getattr(state, self.owner), self.name)

    def __set__(self, state: Any, value: Any) -> None:
        setattr(getattr(state, self.owner), self.name, value)


class OffloadState:
    """Everything tieroffload keeps for one wrapped model: the root that owns the model's
    ``layout`` (units, budget), ``tiers`` (engine, swap, mover, scheduler, pagers, residency),
    ``guards`` (operations outside the hooks), ``passes`` (forward and backward hooks, the
    training phase), ``state_dicts`` (state-dict hooks), ``steps`` (plain optimizers' steps),
    and the paged ``optimizers`` over it. It closes them all (``close``)."""

    __deepcopy__ = refuse_deepcopy
    __reduce_ex__ = refuse_pickle

    units = Owned("layout")
    module_units = Owned("layout")
    fsdp_units = Owned("layout")
    shards = Owned("layout")
    param_unit = Owned("layout")
    budget = Owned("layout")
    local = Owned("layout")
    check_loaded = Owned("layout")
    mark_loaded = Owned("layout")
    engine = Owned("tiers")
    swap = Owned("tiers")
    mover = Owned("tiers")
    scheduler = Owned("tiers")
    grads = Owned("tiers")
    activations = Owned("tiers")
    resident = Owned("tiers")
    materialized = Owned("guards")
    viewed = Owned("guards")
    before_write = Owned("guards")
    settle_failed_backward = Owned("passes")
    backward_raised = Owned("passes")
    phase = Owned("passes")
    wrote = staticmethod(mark_written)

    def __init__(self, model: nn.Module, policy: BasePolicy,
                 io_delay: Callable[[], None] | None = None) -> None:
        self.policy = policy
        self.device = policy.compute_device()
        self.stats = Stats()
        self.window = Window()  # see stats(model, window=True)
        self.cores = CoreLender(policy.lend_core and policy.params == "nvme"
                                and self.device.type == "cpu")
        self.optimizers: weakref.WeakSet[PagedOptimizer] = weakref.WeakSet()  # closed with us
        self.pending_opts: set[PagedOptimizer] = set()  # with deferred updates: kept alive
        self.autobatch: Any = None  # an AutoBatch over this model reports in stats()
        self._handles: list[Any] = []  # hooks on the model, removed at close
        self._undo: list[Callable[[], None]] = []  # other changes to it, undone at close

        if policy.params == "gpu" and self.device.type != "cuda":
            raise ValueError('params="gpu" needs a CUDA compute device; this one is '
                             f"{self.device}")
        self.offloaded = policy.pages_params
        self.layout = Layout(model, policy, self.device)
        self.tiers = Tiers(policy, self.device, self.stats, self.optimizers)
        self.guards = Guards(self.layout, self.tiers, self.optimizers)
        self.passes = Passes(self.layout, self.tiers, self.guards, self.optimizers, policy,
                             self.cores, self.stats)
        self.state_dicts = StateDicts(self.layout, self.tiers, self.guards, self.optimizers)
        self.steps = PlainSteps(self.layout, self.tiers)
        largest = self.layout.largest

        if not self.offloaded or largest is None:
            # Resident tier: the parameters stay where compute is; nothing moves.
            for p in model.parameters():
                if id(p) in self.layout.uninitialized:
                    p.untyped_storage().resize_(p.numel() * p.element_size())
                elif p.device != self.device:
                    p.data = p.data.to(self.device)
        elif self.device.type == "cuda" and policy.cpu_budget is not None:
            self.tiers.check_ram_homes(self.layout)
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
                self.tiers.setup(self.layout, io_delay)
                self.passes.install(model, self._handles, self._undo)
                self.state_dicts.install(model, self._handles)
                self.guards.install(model, self._undo)
                if self.grads is not None:  # what p.grad None hides from the user's tools
                    accelerate_clip.hold()
                    self._undo.append(accelerate_clip.let_go)
            # paged gradients and a paged optimizer's step see each zero_grad() (a resident
            # model's too: its paged optimizer keeps zeros as p.grad would, or not)
            self.steps.install(model, self._undo)
            if policy.activations is not None:
                self.tiers.setup_activations(model, self.layout.units, io_delay, self._handles)
        except BaseException:
            self.close(restore=False)
            raise

    def settle(self, units: list[Any] | None = None) -> None:
        """Applies the paged optimizers' deferred updates of ``units`` (all: None)."""
        settle(self.optimizers, units)

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
        self.tiers.close(self.units, attempt)
        registry.forget(self)
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
    registry.check_free(model)
    check_not_dispatched(model)
    registry.attach(model, OffloadState(model, policy or BasePolicy(), _io_delay))
    return model


_state = registry.state_of  # the name the paged optimizer and tests import


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
        registry.detach(model)


@atexit.register
def _close_all() -> None:
    for s in registry.states():
        s.close(restore=False)

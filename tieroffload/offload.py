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
import os
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Callable

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._pytree import tree_flatten

from . import fsdp, memory
from .activations import ActivationPager
from .grads import GradPager
from .policy import Policy
from .scheduler import Scheduler
from .sizes import format_bytes
from .swap import SwapSpace, stable_tag
from .threads import CoreLender
from .tiers import Mover, NvmeHome, RamHome, State, Stats, Unit

log = logging.getLogger("tieroffload")

CHUNK = 16 << 20  # staging chunk: NVMe sees I/Os this large
NBUF = 4          # staging buffers: the fixed overhead is CHUNK * NBUF

_live: weakref.WeakSet[OffloadState] = weakref.WeakSet()
_warned_step = False


def _check_param(module_name: str, name: str, p: nn.Parameter) -> None:
    nbytes = p.numel() * p.element_size()
    where = f"{module_name + '.' if module_name else ''}{name}"
    if type(p) is not nn.Parameter:
        raise TypeError(f"tieroffload cannot offload parameter {where!r} ({nbytes} bytes): its "
                        f"type {type(p).__name__} is a tensor subclass, not nn.Parameter")
    if p.layout is not torch.strided or p.is_quantized:
        raise TypeError(f"tieroffload cannot offload parameter {where!r} ({nbytes} bytes): "
                        f"layout {p.layout}{', quantized' if p.is_quantized else ''} is not a "
                        "dense strided tensor")
    if p.device.type not in ("cpu", "cuda", "meta"):
        raise TypeError(f"tieroffload cannot offload parameter {where!r} ({nbytes} bytes) on "
                        f"device {p.device}")


class OffloadState:
    """Everything tieroffload keeps for one wrapped model."""

    def __init__(self, model: nn.Module, policy: Policy,
                 io_delay: Callable[[], None] | None = None) -> None:
        self.policy = policy
        self.device = policy.compute_device()
        self.stats = Stats()
        self.cores = CoreLender(policy.lend_core and policy.params == "nvme"
                                and self.device.type == "cpu")
        self._handles: list[Any] = []
        self._bwd_pins: dict[int, int] = {}
        self._bwd_callback_queued = False
        self._fresh_forward = False  # a forward ran since the last backward began
        self._opt_pins: dict[int, tuple[list[Unit], bool]] = {}  # optimizer -> units, grads
        self._grads_seen: dict[int, int] = {}
        self._deferred: list[Unit] = []  # units whose gradients wait for the end of backward
        self._defer_grads = False
        self.swap: SwapSpace | None = None
        self.grads: GradPager | None = None
        self.optimizers: weakref.WeakSet[Any] = weakref.WeakSet()  # paged ones, closed with us
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
        elif policy.params == "cpu" and policy.cpu_budget is not None:
            total = sum(u.nbytes for u in self.units)
            if total > policy.cpu_budget:
                raise MemoryError(
                    f'params="cpu" keeps all {total} bytes ({format_bytes(total)}) of parameters '
                    f"in RAM, over cpu_budget={policy.cpu_budget}; use params=\"nvme\"")
        try:  # a failure here (no room on the disk, say) leaves no thread or file behind
            if self.offloaded and largest is not None:
                self._setup_tiers(largest, io_delay)
                self._install_hooks(model)
            if policy.activations is not None:
                self._setup_activations(model, io_delay)
        except BaseException:
            self.close(restore=False)
            raise
        _live.add(self)

    # -- setup ---------------------------------------------------------------------------------

    def _setup_tiers(self, largest: Unit, io_delay: Callable[[], None] | None) -> None:
        policy = self.policy
        self.engine = policy.io.engine()
        chunk = min(CHUNK, -(-max(largest.nbytes, 1) // 4096) * 4096)
        self.mover = Mover(self.device, chunk, NBUF, self.stats, io_delay)
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
        self.grads = (GradPager(self.units, self.swap, self.mover, self.stats)
                      if policy.grads == "nvme" else None)
        # With several ranks, DDP reduces the gradients in a callback at the end of backward:
        # they are paged once backward is over, after it (see _end_backward).
        self._defer_grads = self.grads is not None and _world_size() > 1
        self._move_home()

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
            lambda: params, io_delay)
        pager = self.activations
        self._handles.append(model.register_forward_pre_hook(
            lambda m, a: pager.begin(), prepend=True))
        self._handles.append(model.register_forward_hook(
            lambda m, a, o: pager.end(), always_call=True))

    def _fsdp_groups(self, model: nn.Module) -> list[tuple[str, Any]]:
        """FSDP2's parameter groups, initialised as its first forward would; their DTensor
        parameters are paged as local shards, not as parameters of their modules."""
        groups = list(fsdp.groups(model))
        if not groups:
            return []
        policy = self.policy
        if policy.grads == "nvme" or policy.activations is not None:
            raise NotImplementedError(
                "with FSDP2 (fully_shard) tieroffload pages parameter shards and optimizer "
                f"state; grads={policy.grads!r} and activations={policy.activations!r} are not "
                'supported: keep gradients on the compute device and activations=None')
        fsdp.lazy_init(model)
        self._fsdp_ids = {id(fp.sharded_param) for _, g in groups for fp in g.fsdp_params}
        return groups

    def _build_fsdp_units(self, model: nn.Module,
                          groups: list[tuple[str, Any]]) -> list[tuple[Any, Unit]]:
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        out = []
        for mname, g in groups:
            shards = fsdp.shards(g, names)
            unit = Unit(len(self.units), f"{mname or '<root>'} (FSDP shards)",
                        [(s.name, s.local) for s in shards], sizes=[s.nbytes for s in shards],
                        on_rebind=lambda shards=shards: [s.rebind() for s in shards])
            self.units.append(unit)
            self.shards += shards
            out.append((g, unit))
        return out

    def _materialize_meta(self, model: nn.Module) -> set[int]:
        """Parameters built on the meta device get real ones on the compute device, with no
        memory yet (storage of size 0); ties are kept. Returns their ids: not loaded yet."""
        new: dict[int, nn.Parameter] = {}
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is None or p.device.type != "meta" or id(p) in self._fsdp_ids:
                    continue
                if id(p) not in new:
                    t = torch.empty(p.shape, dtype=p.dtype, device=self.device)
                    t.untyped_storage().resize_(0)
                    new[id(p)] = nn.Parameter(t, requires_grad=p.requires_grad)
                module._parameters[name] = new[id(p)]
        return {id(p) for p in new.values()}

    def _build_units(self, model: nn.Module) -> tuple[list[Unit], dict[nn.Module, list[Unit]]]:
        units: list[Unit] = []
        module_units: dict[nn.Module, list[Unit]] = {}
        owner: dict[int, Unit] = {}
        for mname, module in model.named_modules(remove_duplicate=False):
            own: list[tuple[str, nn.Parameter]] = []
            used: list[Unit] = []
            for pname, p in module._parameters.items():
                if p is None or id(p) in self._fsdp_ids:
                    continue
                if id(p) in owner:
                    if owner[id(p)] not in used:
                        used.append(owner[id(p)])
                    continue
                _check_param(mname, pname, p)
                own.append((f"{mname + '.' if mname else ''}{pname}", p))
            if own:
                unit = Unit(len(units), mname or "<root>", own)
                units.append(unit)
                for _, p in own:
                    owner[id(p)] = unit
                used.insert(0, unit)
            if used:
                module_units.setdefault(module, [])
                module_units[module] += [u for u in used if u not in module_units[module]]
        return units, module_units

    def _add_descendants(self, model: nn.Module) -> None:
        """A module that owns parameters may use its children's parameters without calling them
        (nn.MultiheadAttention reads out_proj.weight): it also acquires their units, where they
        fit the budget together."""
        for module, units in self.module_units.items():
            if not module._parameters:
                continue
            extra = [u for m in module.modules() if m is not module
                     for u in self.module_units.get(m, []) if u not in units]
            extra = list(dict.fromkeys(extra))
            if sum(u.nbytes for u in units + extra) <= self.budget:
                units += extra

    def _resident_sets(self) -> list[list[Unit]]:
        """The sets of units that must be resident at once: a module's, or an FSDP group's."""
        return list(self.module_units.values()) + [[u] for _, u in self.fsdp_units]

    def _check_budget(self, largest: Unit | None) -> int:
        p = self.policy
        budget = p.gpu_budget if self.device.type == "cuda" else p.cpu_budget
        if largest is None:
            return budget or 0
        if budget is None:
            units, nbytes = p.prefetch_window()
            window = nbytes if nbytes is not None else min(units, len(self.units)) * largest.nbytes
            needs = (sum(u.nbytes for u in us) for us in self._resident_sets())
            budget = window + 2 * max(needs)
        name = "gpu_budget" if self.device.type == "cuda" else "cpu_budget"
        for us in self._resident_sets():
            need = sum(u.nbytes for u in us)
            if need > budget:
                mname = ", ".join(u.name for u in us)
                raise ValueError(
                    f"{name}={budget} bytes ({format_bytes(budget)}) is smaller than module "
                    f"{mname!r}, which needs {need} bytes ({format_bytes(need)}) resident at once")
        return budget

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
            u.home = NvmeHome(self.swap, u.nbytes) if self.swap else RamHome(u.nbytes, pin)
            if self.swap is not None and self.device.type == "cpu":
                u.adopt_flat(self.swap.align)
            if u.on_rebind is not None:
                u.on_rebind()
            if meta:
                u.initialized = False
            else:
                self.scheduler.flush(u)
            u.free()
            u.state = State.AWAY

    def _install_hooks(self, model: nn.Module) -> None:
        h = self._handles
        h.append(model.register_forward_pre_hook(self._begin_iteration, prepend=True))
        h.append(model.register_forward_hook(self._end_forward))
        for module, units in self.module_units.items():
            h.append(module.register_forward_pre_hook(self._pre_forward(units)))
            h.append(module.register_forward_hook(self._post_forward(units)))
            h.append(module.register_state_dict_post_hook(self._state_dict_post()))
            h.append(module.register_load_state_dict_pre_hook(self._load_pre(units)))
            h.append(module.register_load_state_dict_post_hook(self._load_post(units)))
        fsdp_units = {u.id for _, u in self.fsdp_units}
        for u in self.units:
            for p in u.params:
                if p.requires_grad and u.id not in fsdp_units:
                    h.append(p.register_post_accumulate_grad_hook(self._grad_done(u)))
        for group, u in self.fsdp_units:
            self._undo.append(fsdp.hook(group, lambda u=u: self._acquire([u]),
                                        lambda u=u: self.scheduler.release([u])))
        owners = {fp._module_info.module for g, _ in self.fsdp_units for fp in g.fsdp_params}
        for module in owners:  # the modules that hold the DTensors: their state dicts
            units = list(dict.fromkeys(self.param_unit[id(p)] for p in module._parameters.values()
                                       if p is not None and id(p) in self.param_unit))
            h.append(module.register_state_dict_post_hook(self._state_dict_post()))
            h.append(module.register_load_state_dict_pre_hook(self._load_pre(units)))
            h.append(module.register_load_state_dict_post_hook(self._load_post(units)))

    # -- forward and backward ------------------------------------------------------------------

    def _begin_iteration(self, module: nn.Module, args: Any) -> None:
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside backward
            if self._bwd_callback_queued:  # the last backward raised: its end never ran
                self._bwd_callback_queued = False
                self._grads_seen.clear()
                self._deferred.clear()
                self._release_bwd_pins()
            if torch.is_grad_enabled():
                self._fresh_forward = True
                for opt in list(self.optimizers):
                    opt.forward_begins()
            self.cores.give_back()  # a forward that raised kept it
        self.scheduler.begin_iteration()

    def _end_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self.cores.give_back()  # the code between passes is the user's
        self.settle()  # units the forward did not use: their updates precede backward

    def _pre_forward(self, units: list[Unit]) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            self._acquire(units)
        return hook

    def _acquire(self, units: list[Unit]) -> None:
        """Brings ``units`` in for compute, after any deferred optimizer update of theirs."""
        self.settle(units)
        self.scheduler.acquire(units)
        self._lend_core()

    def _lend_core(self) -> None:
        """Compute on one thread fewer while it is behind its reads (see ``threads``)."""
        if not self.cores.enabled:
            return
        self.cores.lend(self.scheduler.waited, self.scheduler.behind())
        self.stats.lent += self.cores.lent

    def settle(self, units: list[Unit] | None = None) -> None:
        """Applies the paged optimizers' deferred updates of ``units`` (all: None)."""
        for opt in list(self.optimizers):
            opt.settle(units)

    def _post_forward(self, units: list[Unit]) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.scheduler.release(units)
            if not torch.is_grad_enabled():
                return
            outs, ins = _grad_tensors(output), _grad_tensors(args)
            if outs:
                # Grads reaching the outputs: this module's backward is about to run.
                torch.autograd.graph.register_multi_grad_hook(
                    outs, lambda grads: self._pre_backward(units), mode="any")
            if outs and ins:
                # Grads reaching the inputs: its backward is done, its units may go.
                torch.autograd.graph.register_multi_grad_hook(
                    ins, lambda grads: self._post_backward(units), mode="all")
        return hook

    def _pre_backward(self, units: list[Unit]) -> None:
        if not self._bwd_callback_queued:
            self._bwd_callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if self._fresh_forward:  # the backward of a forward, not one nested in it (reentrant
            self._fresh_forward = False  # checkpointing): a micro-batch for the optimizers
            for opt in list(self.optimizers):
                opt.backward_begins()
        self.scheduler.acquire(units)
        self._lend_core()
        for u in units:
            self._bwd_pins[u.id] = self._bwd_pins.get(u.id, 0) + 1

    def _post_backward(self, units: list[Unit]) -> None:
        for u in units:
            if self._bwd_pins.get(u.id, 0) > 0:
                self._bwd_pins[u.id] -= 1
                self.scheduler.release([u])

    def _grad_done(self, u: Unit) -> Callable:
        wanted = sum(p.requires_grad for p in u.params)

        def hook(p: torch.Tensor) -> None:
            seen = self._grads_seen.get(u.id, 0) + 1
            self._grads_seen[u.id] = seen
            if seen >= wanted:
                self._grads_seen[u.id] = 0
                self._grads_ready(u)
        return hook

    def _grads_ready(self, u: Unit) -> None:
        self.scheduler.release([u] * self._bwd_pins.pop(u.id, 0))
        taken = False
        for opt in list(self.optimizers):  # overlap="backward" steps here, before paging
            taken = opt.grads_ready(u) or taken
        if self.grads is not None and not taken:
            if self._defer_grads:
                self._deferred.append(u)
            else:
                self.grads.page_out(u)

    def _end_backward(self) -> None:
        self._bwd_callback_queued = False
        self.cores.give_back()
        for uid, seen in self._grads_seen.items():
            if seen:  # some parameters of the unit got no gradient this time
                self._grads_ready(self.units[uid])
        self._grads_seen.clear()
        self._release_bwd_pins()
        if self._deferred:
            # Queued from a callback, this runs after every callback queued during backward,
            # DDP's (which writes the reduced gradients) included.
            torch.autograd.Variable._execution_engine.queue_callback(self._page_deferred)

    def _release_bwd_pins(self) -> None:
        for uid, n in self._bwd_pins.items():
            self.scheduler.release([self.units[uid]] * n)
        self._bwd_pins.clear()

    def _page_deferred(self) -> None:
        units, self._deferred = self._deferred, []
        for u in units:
            self.grads.page_out(u)

    # -- optimizer step ------------------------------------------------------------------------

    def step_begin(self, optimizer: torch.optim.Optimizer) -> None:
        global _warned_step
        if self.mover is None:  # nothing is offloaded
            return
        units = {self.param_unit[id(p)].id: self.param_unit[id(p)]
                 for g in optimizer.param_groups for p in g["params"] if id(p) in self.param_unit}
        if not units:
            return
        units = list(units.values())
        total = sum(u.nbytes for u in units)
        if total > self.budget and not _warned_step and not getattr(
                optimizer, "_tieroffload_inner", False):
            _warned_step = True
            log.warning("%s.step() over offloaded parameters brings all %s of them in at once, "
                        "over the budget of %s; the paged optimizer (tieroffload.optimizer) "
                        "steps in chunks instead", type(optimizer).__name__, format_bytes(total),
                        format_bytes(self.budget))
        self.scheduler.acquire(units, force=True, record=False)
        # A plain optimizer sees gradients paged to NVMe only if they come in for its step (a
        # paged optimizer's chunks get theirs from it).
        grads = self.grads is not None and not getattr(optimizer, "_tieroffload_inner", False)
        if grads:
            self.grads.bring_in(units)
        self._opt_pins[id(optimizer)] = (units, grads)

    def step_end(self, optimizer: torch.optim.Optimizer) -> None:
        units, grads = self._opt_pins.pop(id(optimizer), ([], False))
        if not units:
            return
        for u in units:
            u.dirty = True
        if grads:  # used up, as the paged optimizer's step uses them up
            self.grads.consume(units)
        self.scheduler.release(units)
        self.scheduler.trim()

    def local(self, p: torch.Tensor) -> torch.Tensor:
        """What an optimizer steps for parameter ``p``: its local shard for an FSDP DTensor
        parameter, else ``p`` itself."""
        return self._local.get(id(p), p)

    # -- state dicts ---------------------------------------------------------------------------

    def _state_dict_post(self) -> Callable:
        def hook(module: nn.Module, sd: dict, prefix: str, meta: Any) -> None:
            # The entries share storage that eviction frees: hand out copies of the values,
            # bringing each unit in once for all of its parameters.
            todo: dict[Unit, list[tuple[str, nn.Parameter]]] = {}
            for name, p in module._parameters.items():
                key = prefix + name
                u = self.param_unit.get(id(p)) if p is not None else None
                if u is not None and key in sd and not isinstance(sd[key], nn.Parameter):
                    todo.setdefault(u, []).append((key, p))
            for u, entries in todo.items():
                with self.resident([u]):
                    for key, p in entries:
                        sd[key] = p.detach().clone()
        return hook

    def _load_pre(self, units: list[Unit]) -> Callable:
        def hook(module: nn.Module, *args: Any) -> None:
            self.settle(units)
            self.scheduler.acquire(units, force=True, record=False)
        return hook

    def _load_post(self, units: list[Unit]) -> Callable:
        def hook(module: nn.Module, incompatible: Any) -> None:
            for u in units:
                self.scheduler.flush(u)
            self.scheduler.release(units)
            self.scheduler.trim()
        return hook

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

    # -- the end -------------------------------------------------------------------------------

    def close(self, restore: bool = True) -> None:
        """Removes the hooks and the swap space. With ``restore`` the parameters are made
        resident first, so the model goes on as a plain model."""
        self.cores.give_back()
        if restore:
            self.settle()
        for opt in list(self.optimizers):
            opt.close()
        if restore and self.mover is not None:
            self.scheduler.acquire(self.units, force=True, record=False)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for undo in self._undo:
            undo()
        self._undo.clear()
        if self.grads is not None:
            self.grads.close()
        if self.scheduler is not None:
            self.scheduler.drain()
        if self.mover is not None:
            self.mover.close()
            self.mover = None
        if self.scheduler is not None:
            self.scheduler.pool.clear()
        if self.activations is not None:
            self.activations.close()
            self.activations = None
        for u in self.units:
            if u.home is not None:
                u.home.release()
                u.home = None
        if self.swap is not None:
            self.swap.close()
            self.swap = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        _live.discard(self)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _grad_tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


def offload(model: nn.Module, policy: Policy | None = None, *,
            _io_delay: Callable[[], None] | None = None) -> nn.Module:
    """Pages ``model``'s parameters to ``policy.params`` and installs the hooks that bring them
    back ahead of use. Changes the model in place and returns it."""
    if getattr(model, "_tieroffload", None) is not None:
        raise ValueError("model is already offloaded; tieroffload.close(model) first")
    state = OffloadState(model, policy or Policy(), _io_delay)
    model._tieroffload = state
    return model


def _state(model: nn.Module) -> OffloadState:
    state = getattr(model, "_tieroffload", None)
    if state is None:
        raise ValueError("model is not offloaded (call tieroffload.offload(model, policy))")
    return state


def stats(model: nn.Module) -> dict[str, Any]:
    """Bytes moved per tier and direction, seconds compute waited on I/O, prefetch hits, late
    prefetches and misses, acquires after which compute lent a core to I/O (``lent``),
    evictions, resident and peak resident bytes on the compute device, the budget and the
    fixed staging overhead."""
    s = _state(model)
    d = s.stats.as_dict()
    if s.activations is not None:
        d["activations"] = dict(s.activations.stats.__dict__)
    if s.autobatch is not None:
        d["autobatch"] = s.autobatch.stats()
    d.update(budget=s.budget, overhead=s.mover.overhead if s.mover else 0,
             device=str(s.device), tier=s.policy.params,
             swap=s.swap.path if s.swap else None)
    return d


@contextlib.contextmanager
def materialize(model: nn.Module, writeback: bool = False) -> Iterator[nn.Module]:
    """Makes every parameter resident inside the block, so that its values can be read (or,
    with ``writeback=True``, changed) directly."""
    s = _state(model)
    with s.resident(s.units, writeback=writeback):
        yield model


def load_weights(model: nn.Module, source: str | os.PathLike | dict[str, torch.Tensor],
                 strict: bool = True) -> None:
    """Loads weights from a safetensors file or a state dict, streamed one unit at a time into
    its tier, so a model larger than RAM can be filled."""
    s = _state(model)
    if isinstance(source, dict):
        keys = set(source)
        get = source.__getitem__
        ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
    else:
        from safetensors import safe_open

        ctx = safe_open(os.fspath(source), framework="pt", device="cpu")
    with ctx as f:
        if f is not None:
            keys, get = set(f.keys()), f.get_tensor
        missing = [n for u in s.units for n in u.names if n not in keys]
        if strict and missing:
            raise KeyError(f"weights are missing {len(missing)} parameters: {missing[:5]}...")
        for u in s.units:
            todo = [(n, seg.param) for n, seg in zip(u.names, u.segments) if n in keys]
            if not todo:
                continue
            with s.resident([u], writeback=s.mover is not None), torch.no_grad():
                for name, p in todo:
                    t = get(name)
                    if t.shape != p.shape:
                        raise ValueError(f"{name}: weights have shape {tuple(t.shape)}, the "
                                         f"model {tuple(p.shape)}")
                    p.copy_(t)


def close(model: nn.Module, restore: bool = True) -> None:
    """Undoes ``offload``: removes hooks, closes its paged optimizers and deletes the swap space
    (see OffloadState.close)."""
    _state(model).close(restore)
    model._tieroffload = None


def drop_stored_grads(params: Iterable[torch.Tensor]) -> None:
    """Forgets the gradients of ``params`` that wait on NVMe (``grads="nvme"``), which
    ``p.grad`` does not show: a plain optimizer's ``zero_grad`` cannot reach them (a paged
    optimizer's does)."""
    ids = {id(p) for p in params}
    for s in list(_live):
        if s.grads is not None:
            units = {s.param_unit[i].id: s.param_unit[i] for i in ids if i in s.param_unit}
            s.grads.clear(list(units.values()))


def _step_pre(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if getattr(optimizer, "_tieroffload_paged", False):
        return  # it pages its chunks itself
    for s in list(_live):
        s.step_begin(optimizer)


def _step_post(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if getattr(optimizer, "_tieroffload_paged", False):
        return
    for s in list(_live):
        s.step_end(optimizer)


register_optimizer_step_pre_hook(_step_pre)
register_optimizer_step_post_hook(_step_post)


@atexit.register
def _close_all() -> None:
    for s in list(_live):
        s.close(restore=False)

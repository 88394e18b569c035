"""What keeps an offloaded model from giving a silent wrong result.

A parameter whose unit is away has no values in memory (its pages are discarded). Any torch
operation on it outside tieroffload's own hooks (a weight read, ``nn.init``, ``p.data.normal_()``)
brings its unit in first and holds it, marked changed, until the next forward begins: reads see
the true values and writes reach its home. What cannot be made right is refused with an error
that says what to do: a dtype or device conversion (``model.half()``), a module or parameter
assigned into the model (``resize_token_embeddings``), ``copy.deepcopy``, compute on
parameters built on the meta device and never loaded, and offloading a model that accelerate
has dispatched."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from ..compat.tensors import NO_DATA_FUNCTIONS, plain_tensors
from ..core.units import Unit
from . import patches, registry
from .adapters import check_assignment
from .build import Layout
from .contract import PagedOptimizer, settle
from .devices import guarded_apply
from .views import ViewLedger

if TYPE_CHECKING:
    from .tiers import Tiers


def check_not_dispatched(model: nn.Module) -> None:
    """Refuses a model that accelerate dispatched: its hooks swap the parameters in and out
    behind tieroffload's back."""
    hooked = next((n for n, m in model.named_modules() if hasattr(m, "_hf_hook")), None)
    if hooked is not None or getattr(model, "hf_device_map", None):
        where = f"module {hooked or '<root>'!r} has an accelerate hook" if hooked is not None \
            else "it has an hf_device_map"
        raise ValueError(
            f"tieroffload.offload: model was dispatched by accelerate ({where}; cpu_offload, "
            "disk_offload or device_map); remove_hook_from_module(model, recurse=True) and load "
            "the weights, or offload the undispatched model")


_COPY_ERROR = ("copy.deepcopy of a model under tieroffload.offload, or of a module in it, is "
               "not supported (its pages, threads and swap file are not copied): deepcopy "
               "before offload, or tieroffload.close(model) first (PEFT's modules_to_save "
               "copies the modules it names: train them as part of the base instead)")


def _no_data(names: list[str], props: list[str]) -> set[Any]:
    methods = {getattr(torch.Tensor, n) for n in names}
    return methods | {getattr(getattr(torch.Tensor, n), a) for n in props
                      for a in ("__get__", "__set__")}


# Operations that read no values: they pass without bringing a unit in (the engine itself
# calls some of them while a unit is away).
_NO_DATA = _no_data(
    ["size", "dim", "numel", "nelement", "element_size", "stride", "storage_offset",
     "is_contiguous", "is_floating_point", "is_complex", "untyped_storage", "data_ptr",
     "register_hook", "register_post_accumulate_grad_hook", "requires_grad_", "__len__"],
    ["grad", "requires_grad", "shape", "dtype", "device", "is_leaf", "grad_fn", "layout",
     "ndim", "is_cuda", "is_meta", "_version"]) | {torch.Tensor.data.__set__} | NO_DATA_FUNCTIONS

_COMPILE_ERROR = ('torch.compile of a model offloaded with params="nvme" is not supported: its '
                  "parameters page in and out under hooks a compiled graph cannot follow; run "
                  'it eagerly, or keep params on "cpu" or "gpu"')
_SET_DATA = torch.Tensor.data.__set__
_GET_DATA = torch.Tensor.data.__get__


def _check_same_layout(p: torch.Tensor, new: torch.Tensor) -> None:
    """``p.data = new`` may change values, never the shape, dtype or device: the unit's pages
    and its home were laid out for the old one (``resize_token_embeddings`` does this)."""
    with plain_tensors():
        same = new.shape == p.shape and new.dtype == p.dtype and new.device == p.device
    if not same:
        raise ValueError(
            f"tieroffload: p.data = a tensor of {tuple(new.shape)} {new.dtype} on {new.device} "
            f"on an offloaded parameter of {tuple(p.shape)} {p.dtype} on {p.device} "
            "(resize_token_embeddings, a conversion): change shapes, dtypes and devices "
            "before tieroffload.offload, or close(model) first")


def refuse_deepcopy(self: object, memo: dict) -> None:
    """``__deepcopy__`` of every object the hooks of an offloaded model reach."""
    raise TypeError(_COPY_ERROR)


def refuse_pickle(self: object, protocol: Any) -> Any:
    """``__reduce_ex__`` of every object the hooks of an offloaded model reach (pickle meets
    them through the hooks, or through ``model._tieroffload``)."""
    raise TypeError("pickling a model under tieroffload.offload (torch.save(model)) is not "
                    "supported: save model.state_dict() or tieroffload.save_checkpoint")


def mark_written(u: Unit) -> None:
    """Code outside the hooks wrote ``u`` (or may yet, through a view it holds): it is
    written home when evicted, and a paged optimizer re-reads it into its fp32 masters."""
    u.dirty = True
    u.writes += 1


_owner_of: dict[int, tuple[Guards, Unit]] = {}  # id(parameter) -> its model's state, unit


class OffloadedParameter(nn.Parameter):
    """An offloaded model's parameter (``isinstance(p, nn.Parameter)`` holds). An operation on
    it while its unit is not held brings the unit in for the operation (``Guards.touch``);
    results are plain tensors, as a Parameter's are."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            raise RuntimeError(_COMPILE_ERROR)
        if func == _SET_DATA and id(args[0]) in _owner_of:
            # p.data = new: the unit keeps its pages and home, so the values are copied in
            # (brought in and marked written, as any write); no alias of ``new`` is made.
            p, new = args
            _check_same_layout(p, new)
            if new is not p:  # model.to() of a model already there: nothing to do
                with torch.no_grad():
                    p.copy_(new)
            return None
        if func in _NO_DATA:
            with plain_tensors():
                return func(*args, **kwargs)
        entries = _owners((*args, *kwargs.values()))
        for state in dict.fromkeys(s for s, _ in entries if s._touched):
            state.let_go_views([u for s, u in entries if s is state])
        name = getattr(func, "__name__", "")
        wrote = (name.endswith("_") and not name.endswith("__") or name == "__setitem__"
                 or "out" in kwargs)
        if wrote:  # the tensor written: self, or out=
            for state, u in _owners((args[0] if args else None, kwargs.get("out"))):
                state.before_write(u)
        away = [e for e in entries if e[1].wants_touch()]
        for state, u in away:
            state.touch(u)
        try:
            with plain_tensors():
                out = func(*args, **kwargs)
        except BaseException:
            for state, u in away:
                state.untouch(u, hold=False, wrote=False)
            raise
        for state, u in entries:
            if (state, u) in away:
                state.untouch(u, hold=bool(u.storage_ptrs() & _storages(out)), wrote=wrote)
            elif func == _GET_DATA or state.materialized:
                # Held by materialize or a forward: a write through p.data bumps no version
                # counter, and a view taken inside materialize outlives its hold.
                state.held_view(u, func == _GET_DATA or bool(u.storage_ptrs() & _storages(out)))
        return out

    def __deepcopy__(self, memo: dict) -> None:
        raise TypeError(_COPY_ERROR)

    def __repr__(self) -> str:  # as a plain Parameter's
        with torch.no_grad():
            return "Parameter containing:\n" + repr(self.detach().requires_grad_(
                self.requires_grad))

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("pickling a parameter of a model under tieroffload.offload: save "
                        "model.state_dict() or tieroffload.save_checkpoint instead")


def _owners(values: tuple) -> list[tuple[Guards, Unit]]:
    """The (state, unit) of each offloaded parameter among ``values`` (or in their lists)."""
    out: list[tuple[Guards, Unit]] = []
    for a in values:
        for b in (a if isinstance(a, (list, tuple)) else (a,)):
            if type(b) is OffloadedParameter:
                entry = _owner_of.get(id(b))
                if entry is not None and entry not in out:
                    out.append(entry)
    return out


def _storages(out: Any) -> set[int]:
    """The storage addresses of the tensors in ``out`` (a view of a parameter shares its)."""
    tensors = out if isinstance(out, (list, tuple)) else (out,)
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}


class Guards:
    """Keeps reads of an offloaded model's parameters right and refuses what would break it:
    an operation outside the hooks brings a unit in (``touch``) and holds it while a view of
    it lives; a conversion of the model (``model.half()``) is refused. Holds the units such
    views hold, the depth of open ``materialize`` blocks and of ``state_dict()`` calls."""

    __deepcopy__ = refuse_deepcopy
    __reduce_ex__ = refuse_pickle

    def __init__(self, layout: Layout, tiers: Tiers,
                 optimizers: weakref.WeakSet[PagedOptimizer]) -> None:
        self.layout = layout
        self.tiers = tiers
        self.optimizers = optimizers
        self.module_ids: set[int] = set()  # the model's modules: assigning one is refused
        self._touched: list[Unit] = []  # held for views taken outside the hooks
        self._quiet = 0  # inside state_dict(), whose hooks hand out the true values
        self.materialized = 0  # depth of materialize() blocks open
        self._views = ViewLedger()  # which of _touched only views hold (hooks.views)

    def install(self, model: nn.Module, undo: list[Callable[[], None]]) -> None:
        """Guards the model's parameters and its modules' ``_apply``; ``undo`` undoes it."""
        self.module_ids = {id(m) for m in model.modules()}
        for m in model.modules():
            m._apply = self._guard_apply(m, m._apply)
            undo.append(lambda m=m: m.__dict__.pop("_apply", None))
        for u in self.layout.units:
            for p in u.params:
                if type(p) is nn.Parameter:  # not FSDP's DTensors
                    p.__class__ = OffloadedParameter
                    _owner_of[id(p)] = (self, u)
                    undo.append(lambda p=p: _unguard(p))

    def touch(self, u: Unit) -> None:
        """Brings ``u`` in for an operation outside the hooks (see ``untouch``)."""
        if self._quiet:  # state_dict(): its hooks hand out the true values
            return
        self._views.before(u, self._touched)
        self.layout.check_loaded([u])
        settle(self.optimizers, [u])
        self.tiers.scheduler.acquire([u], force=True, record=False)

    def untouch(self, u: Unit, hold: bool, wrote: bool) -> None:
        """After the operation: a unit it wrote is changed (written home when evicted); one
        whose storage the result views (``p.detach()``, ``p.data``) stays held, changed (a
        write may come through the view), until the next forward begins."""
        if self._quiet:
            return
        if hold:
            self._touched.append(u)
        else:
            self.tiers.scheduler.release([u])
        if hold or wrote:
            mark_written(u)

    def held_view(self, u: Unit, view: bool) -> None:
        """An operation on a parameter of ``u`` while something else holds it: a result that
        views its storage (``p.data``, ``p.detach()``) holds it, changed, until the next
        forward begins when taken inside materialize (the view outlives the block); taking
        ``p.data`` marks it changed anyway (a write through it moves no version counter)."""
        if self._quiet or not view:
            return
        if self.materialized:
            self.tiers.scheduler.acquire([u], force=True, record=False)
            self._touched.append(u)
            self._views.forget(u)  # held until the next forward: views.py does not follow it
        mark_written(u)

    def before_write(self, u: Unit) -> None:
        """Refuses a write the paged optimizers cannot follow (see ``check_write``)."""
        for opt in list(self.optimizers):
            opt.check_write(u)

    def let_go_views(self, keep: list[Unit]) -> None:
        """Releases the units held for views that are all gone now (see ``hooks.views``)."""
        def release(units: list[Unit]) -> None:
            self.tiers.scheduler.release(units)
            self.tiers.scheduler.trim()
        self._touched = self._views.let_go(self._touched, keep, release)

    def viewed(self) -> list[Unit]:
        """The units that views taken outside the hooks hold (see ``untouch``)."""
        return list(self._touched)

    def release_touched(self) -> None:
        """Lets the units that views taken outside the hooks hold go (see ``untouch``)."""
        units, self._touched = self._touched, []
        self._views.clear()
        self._quiet = 0  # a state_dict() that raised
        self.tiers.scheduler.release(units)
        self.tiers.scheduler.trim()

    def quiet_begin(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        """A module's ``state_dict()`` begins (a state-dict pre hook)."""
        self._quiet += 1  # until the module's state-dict post hook (quiet_end)

    def quiet_end(self) -> None:
        """A module's ``state_dict()`` is done."""
        self._quiet = max(self._quiet - 1, 0)

    def _guard_apply(self, module: nn.Module, orig: Callable) -> Callable:
        return guarded_apply(module, orig, lambda t: id(t) in _owner_of)


def _unguard(p: torch.Tensor) -> None:
    p.__class__ = nn.Parameter
    _owner_of.pop(id(p), None)


def _module_registered(module: nn.Module, name: str, sub: nn.Module | None) -> None:
    s = registry.state_of_module(module)
    if s is not None and sub is not None:
        check_assignment(s.param_unit, s.guards.module_ids, module, name, sub)
        s.guards.let_go_views([])


def _param_registered(module: nn.Module, name: str, p: nn.Parameter | None) -> None:
    s = registry.state_of_module(module)
    if s is not None and p is not None and id(p) not in s.param_unit:
        raise ValueError(
            f"tieroffload: parameter {name!r} assigned into an offloaded model: change "
            "parameters before tieroffload.offload, or close(model) first")


def _install_registration_hooks() -> Callable[[], None]:
    """torch's process-wide hooks on modules and parameters assigned into a module: refuse
    those assigned into an offloaded model (``_module_registered``, ``_param_registered``)."""
    handles = [register_module_module_registration_hook(_module_registered),
               register_module_parameter_registration_hook(_param_registered)]

    def undo() -> None:
        for h in handles:
            h.remove()
    return undo


patches.register("module and parameter registration hooks", _install_registration_hooks)

"""State-dict hooks: ``state_dict()`` reads true values of offloaded parameters, and
``load_state_dict`` writes through to their homes."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..compat import fsdp2
from ..core.units import Unit
from .build import Layout
from .contract import PagedOptimizer, settle
from .guards import Guards, mark_written, refuse_deepcopy, refuse_pickle

if TYPE_CHECKING:
    from .tiers import Tiers


class StateDicts:
    """Serves ``state_dict`` (copies of the true values, a tie handed out once) and
    ``load_state_dict`` (units resident for the load, written home after) of an offloaded
    model's modules. Holds the last state-dict copy of each parameter."""

    __deepcopy__ = refuse_deepcopy
    __reduce_ex__ = refuse_pickle

    def __init__(self, layout: Layout, tiers: Tiers, guards: Guards,
                 optimizers: weakref.WeakSet[PagedOptimizer]) -> None:
        self.layout = layout
        self.tiers = tiers
        self.guards = guards
        self.optimizers = optimizers
        self._copies: dict[int, tuple[str, Any]] = {}  # id(p) -> its last state-dict copy
        self._loading: set[int] = set()  # id(units) of the modules whose own load is under way

    def install(self, model: nn.Module, handles: list[Any]) -> None:
        """Hooks on the state dicts of the modules that own units, and of those that hold
        FSDP's DTensors."""
        param_unit = self.layout.param_unit
        owners = {fsdp2.owner(fp) for g, _ in self.layout.fsdp_units for fp in g.fsdp_params}
        targets = list(self.layout.module_units.items()) + [
            (module, list(dict.fromkeys(param_unit[id(p)] for p in module._parameters.values()
                                        if p is not None and id(p) in param_unit)))
            for module in owners]
        for module, units in targets:
            handles.append(module.register_state_dict_pre_hook(self.guards.quiet_begin))
            handles.append(module.register_state_dict_post_hook(self._state_dict_post()))
            handles.append(module.register_load_state_dict_pre_hook(self._load_pre(units)))
            handles.append(module.register_load_state_dict_post_hook(self._load_post(units)))

    def _tied_copy(self, sd: dict, p: torch.Tensor) -> torch.Tensor | None:
        """The copy of ``p`` already in ``sd`` under another name (a tied parameter): handed
        out once, so that ``save_pretrained`` sees the tie as plain PyTorch shows it."""
        key, ref = self._copies.get(id(p), (None, None))
        t = ref() if ref is not None else None
        return t if t is not None and sd.get(key) is t else None

    def _state_dict_post(self) -> Callable:
        def hook(module: nn.Module, sd: dict, prefix: str, meta: Any) -> None:
            # The entries share storage that eviction frees: hand out copies of the values,
            # bringing each unit in once for all of its parameters.
            todo: dict[Unit, list[tuple[str, nn.Parameter]]] = {}
            for name, p in module._parameters.items():
                key = prefix + name
                u = self.layout.param_unit.get(id(p)) if p is not None else None
                if u is not None and key in sd and not isinstance(sd[key], nn.Parameter):
                    todo.setdefault(u, []).append((key, p))
            for u, entries in todo.items():
                with self.tiers.resident([u]):
                    for key, p in entries:
                        t = self._tied_copy(sd, p)
                        sd[key] = p.detach().clone() if t is None else t
                        self._copies[id(p)] = (key, weakref.ref(sd[key]))
            self.guards.quiet_end()
        return hook

    def _load_pre(self, units: list[Unit]) -> Callable:
        def hook(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
            if not loads_own(module, state_dict, prefix):
                self._loading.discard(id(units))  # left by a load that raised
                return  # nothing of its own is loaded: nothing comes in or goes home
            self._loading.add(id(units))
            for u in units:
                self.guards.before_write(u)
            settle(self.optimizers, units)
            self.tiers.scheduler.acquire(units, force=True, record=False)
        return hook

    def _load_post(self, units: list[Unit]) -> Callable:
        def hook(module: nn.Module, incompatible: Any) -> None:
            if id(units) not in self._loading:
                return
            self._loading.discard(id(units))
            missing = set(incompatible.missing_keys)
            for u in units:
                self.layout.mark_loaded([p for n, p in zip(u.names, u.params)
                                         if n not in missing])
                mark_written(u)
                self.tiers.scheduler.flush(u)
            self.tiers.scheduler.release(units)
            self.tiers.scheduler.trim()
        return hook


def loads_own(module: nn.Module, state_dict: dict, prefix: str) -> bool:
    """``state_dict`` has a value for one of ``module``'s own parameters (a PEFT adapter's
    load has none for the frozen base's layers, which are then not rewritten)."""
    return any(prefix + n in state_dict for n, p in module._parameters.items() if p is not None)

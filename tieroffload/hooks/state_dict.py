"""State-dict hooks: ``state_dict()`` reads true values of offloaded parameters, and
``load_state_dict`` writes through to their homes."""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch import nn

from ..core.units import Unit


class StateDictHooks:
    """The part of ``OffloadState`` that serves ``state_dict`` and ``load_state_dict``."""

    def local(self, p: torch.Tensor) -> torch.Tensor:
        """What an optimizer steps for parameter ``p``: its local shard for an FSDP DTensor
        parameter, else ``p`` itself."""
        return self._local.get(id(p), p)

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
                u = self.param_unit.get(id(p)) if p is not None else None
                if u is not None and key in sd and not isinstance(sd[key], nn.Parameter):
                    todo.setdefault(u, []).append((key, p))
            for u, entries in todo.items():
                with self.resident([u]):
                    for key, p in entries:
                        t = self._tied_copy(sd, p)
                        sd[key] = p.detach().clone() if t is None else t
                        self._copies[id(p)] = (key, weakref.ref(sd[key]))
            self._quiet = max(self._quiet - 1, 0)  # see Guards._quiet_begin
        return hook

    def _load_pre(self, units: list[Unit]) -> Callable:
        def hook(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
            if not loads_own(module, state_dict, prefix):
                _loading.discard(id(units))  # left by a load that raised
                return  # nothing of its own is loaded: nothing comes in or goes home
            _loading.add(id(units))
            for u in units:
                self.before_write(u)
            self.settle(units)
            self.scheduler.acquire(units, force=True, record=False)
        return hook

    def _load_post(self, units: list[Unit]) -> Callable:
        def hook(module: nn.Module, incompatible: Any) -> None:
            if id(units) not in _loading:
                return
            _loading.discard(id(units))
            missing = set(incompatible.missing_keys)
            for u in units:
                self.mark_loaded([p for n, p in zip(u.names, u.params) if n not in missing])
                self.wrote(u)
                self.scheduler.flush(u)
            self.scheduler.release(units)
            self.scheduler.trim()
        return hook


_loading: set[int] = set()  # id(units) of the modules whose own load is under way


def loads_own(module: nn.Module, state_dict: dict, prefix: str) -> bool:
    """``state_dict`` has a value for one of ``module``'s own parameters (a PEFT adapter's
    load has none for the frozen base's layers, which are then not rewritten)."""
    return any(prefix + n in state_dict for n, p in module._parameters.items() if p is not None)

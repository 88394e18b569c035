"""An offloaded model's layout: its units, one per module that owns parameters (or per FSDP
parameter group), parameters brought off the meta device, the resident budget checked."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ..core.units import Unit
from ..integrations import fsdp
from ..utils.sizes import format_bytes
from .policy import BasePolicy

log = logging.getLogger("tieroffload")


def check_param(module_name: str, name: str, p: nn.Parameter) -> None:
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


class BudgetTooSmall(ValueError):
    """The resident budget is below what a module needs at once. ``name`` is the budget's
    field (``cpu_budget`` or ``gpu_budget``), ``need`` the largest need of any module: the
    smallest budget the model runs under."""

    def __init__(self, message: str, name: str, need: int) -> None:
        super().__init__(message)
        self.name, self.need = name, need


class Layout:
    """Which parameters make which unit, and which units each module needs resident at once,
    built once at ``offload`` and fixed after: units, the modules' units, FSDP shards and
    their units, the unit of each parameter, the parameters still to load (built on the meta
    device), and the resident budget they fit."""

    def __init__(self, model: nn.Module, policy: BasePolicy, device: torch.device) -> None:
        self.policy = policy
        self.device = device
        self.fsdp_ids: set[int] = set()
        self.shards: list[fsdp.Shard] = []  # FSDP's local shards, when the model is sharded
        groups = self._fsdp_groups(model)
        self.uninitialized = self._materialize_meta(model)
        self.units, self.module_units = self._build_units(model)
        self.fsdp_units = self._build_fsdp_units(model, groups)
        self.param_unit = {id(s.param): u for u in self.units for s in u.segments}
        self.param_unit.update({id(s.public): self.param_unit[id(s.local)] for s in self.shards})
        self._local = {id(s.public): s.local for s in self.shards}
        self.largest = max(self.units, key=lambda u: u.nbytes, default=None)
        self.budget = self._check_budget(self.largest)
        self._add_descendants()

    def _fsdp_groups(self, model: nn.Module) -> list[tuple[str, Any]]:
        """FSDP2's parameter groups, initialised as its first forward would; their DTensor
        parameters are paged as local shards, not as parameters of their modules."""
        groups = list(fsdp.groups(model))
        if not groups:
            return []
        policy = self.policy
        if policy.pages_grads or policy.activations is not None:
            raise NotImplementedError(
                "with FSDP2 (fully_shard) tieroffload pages parameter shards and optimizer "
                f"state; grads={policy.grads!r} and activations={policy.activations!r} are not "
                'supported: keep gradients on the compute device and activations=None')
        fsdp.lazy_init(model)
        self.fsdp_ids = {id(fp.sharded_param) for _, g in groups for fp in g.fsdp_params}
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
                if p is None or p.device.type != "meta" or id(p) in self.fsdp_ids:
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
                if p is None or id(p) in self.fsdp_ids:
                    continue
                if id(p) in owner:
                    if owner[id(p)] not in used:
                        used.append(owner[id(p)])
                    continue
                check_param(mname, pname, p)
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

    def _add_descendants(self) -> None:
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

    def _tied_trainable(self) -> list[Unit]:
        """Units whose parameters several modules use (a tied embedding) and require grad. A
        module whose inputs need no gradient (an embedding of token ids) holds its units in
        backward until their gradients are whole: a tied one stays from its first use in
        backward to its last, beside every module whose backward runs between them."""
        users: dict[int, int] = {}
        for us in self.module_units.values():
            for u in us:
                users[u.id] = users.get(u.id, 0) + 1
        return [u for u in self.units
                if users.get(u.id, 0) > 1 and any(p.requires_grad for p in u.params)]

    def _check_budget(self, largest: Unit | None) -> int:
        p = self.policy
        budget = p.gpu_budget if self.device.type == "cuda" else p.cpu_budget
        if largest is None:
            return budget or 0
        tied = self._tied_trainable()
        sets = [(us, [u for u in tied if u not in us]) for us in self._resident_sets()]
        if budget is None:
            units, nbytes = p.prefetch_window()
            window = nbytes if nbytes is not None else min(units, len(self.units)) * largest.nbytes
            budget = window + 2 * max(sum(u.nbytes for u in us + held) for us, held in sets)
        name = "gpu_budget" if self.device.type == "cuda" else "cpu_budget"
        worst = max(sum(u.nbytes for u in us + held) for us, held in sets)
        for us, held in sets:
            need = sum(u.nbytes for u in us + held)
            if need > budget:
                mname = ", ".join(u.name for u in us)
                also = (f", with the tied {', '.join(u.name for u in held)!r} that backward "
                        "holds until its gradient is whole (model.requires_grad_(False) lifts "
                        "that for inference)") if held else ""
                raise BudgetTooSmall(
                    f"{name}={budget} bytes ({format_bytes(budget)}) is smaller than module "
                    f"{mname!r}, which needs {need} bytes ({format_bytes(need)}) resident at "
                    f"once{also}", name, worst)
        return budget


    def local(self, p: torch.Tensor) -> torch.Tensor:
        """What an optimizer steps for parameter ``p``: its local shard for an FSDP DTensor
        parameter, else ``p`` itself."""
        return self._local.get(id(p), p)

    def check_loaded(self, units: list[Unit]) -> None:
        """Raises for a parameter of ``units`` built on the meta device and never loaded."""
        if not self.uninitialized:
            return
        for u in units:
            for n, p in zip(u.names, u.params):
                if id(p) in self.uninitialized:
                    raise RuntimeError(
                        f"tieroffload: parameter {n!r} was built on the meta device and never "
                        "loaded (tieroffload.load_weights or load_state_dict)")

    def mark_loaded(self, params: list[torch.Tensor]) -> None:
        """``params`` hold their values now (loaded)."""
        for p in params:
            self.uninitialized.discard(id(p))

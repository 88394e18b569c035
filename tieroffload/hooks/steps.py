"""Plain (not paged) optimizers over an offloaded model: their ``step`` is intercepted so
that the units it updates are resident and written back, and gradients stored on NVMe can be
forgotten (``drop_stored_grads``)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ..compat.tensors import Norms, add_grad_norms, clip_coefficient, total_norm
from ..core.units import Unit
from ..integrations import accelerate
from ..utils.sizes import format_bytes
from . import patches
from .build import Layout
from .guards import mark_written
from .registry import states

if TYPE_CHECKING:
    from .tiers import Tiers

log = logging.getLogger("tieroffload")

_warned_step = False


class PlainSteps:
    """Pins the units a plain (not paged) optimizer updates around its ``step`` (brought in,
    with their paged gradients, and written home after), and makes ``zero_grad`` of the
    model's modules forget the paged gradients too."""

    def __init__(self, layout: Layout, tiers: Tiers) -> None:
        self.layout = layout
        self.tiers = tiers
        self._opt_pins: dict[int, tuple[list[Unit], bool]] = {}  # optimizer -> units, grads

    @staticmethod
    def install(model: nn.Module, undo: list[Callable[[], None]]) -> None:
        """``zero_grad`` of the model's modules forgets the stored gradients too, with
        gradients paged to NVMe (a skipped batch: backward, then zero_grad without a step), as
        it forgets ``p.grad`` of a plain model; and a paged optimizer learns of it
        (``PagedOptimizer.check_zeroed``). A plain optimizer's ``zero_grad`` does the same
        (``_zero_grad``, a patch in place while a model is offloaded)."""
        for m in model.modules():
            m.zero_grad = _module_zero_grad(m, m.zero_grad)
            undo.append(lambda m=m: m.__dict__.pop("zero_grad", None))

    def begin(self, optimizer: torch.optim.Optimizer) -> None:
        """Before a plain optimizer's step: its units (and paged gradients) come in."""
        global _warned_step
        tiers, param_unit = self.tiers, self.layout.param_unit
        if tiers.mover is None:  # nothing is offloaded
            return
        stale = self._opt_pins.pop(id(optimizer), None)
        if stale is not None:  # its last step raised (lr=None): torch ran no post hook
            tiers.scheduler.release(stale[0])
        units = {param_unit[id(p)].id: param_unit[id(p)]
                 for g in optimizer.param_groups for p in g["params"] if id(p) in param_unit}
        if not units:
            return
        units = list(units.values())
        total = sum(u.nbytes for u in units)
        budget = self.layout.budget
        if total > budget and not _warned_step and not getattr(
                optimizer, "_tieroffload_inner", False):
            _warned_step = True
            log.warning("%s.step() over offloaded parameters brings all %s of them in at once, "
                        "over the budget of %s; the paged optimizer (tieroffload.optimizer) "
                        "steps in chunks instead", type(optimizer).__name__, format_bytes(total),
                        format_bytes(budget))
        tiers.scheduler.acquire(units, force=True, record=False)
        # A plain optimizer sees gradients paged to NVMe only if they come in for its step (a
        # paged optimizer's chunks get theirs from it).
        grads = tiers.grads is not None and not getattr(optimizer, "_tieroffload_inner", False)
        if grads:
            tiers.grads.store_set_by_hand(units)
            tiers.grads.bring_in(units)
        self._opt_pins[id(optimizer)] = (units, grads)

    def end(self, optimizer: torch.optim.Optimizer) -> None:
        """After a plain optimizer's step: the units it stepped are written home."""
        units, grads = self._opt_pins.pop(id(optimizer), ([], False))
        if not units:
            return
        # torch's optimizers leave a parameter without a gradient as it is: a frozen unit is
        # not written home again (an in-place write would show in its version counters).
        stepped = {id(p) for g in optimizer.param_groups for p in g["params"]
                   if p.grad is not None}
        for u in units:
            if any(id(p) in stepped for p in u.params):
                mark_written(u)
        if grads:  # used up, as the paged optimizer's step uses them up
            self.tiers.grads.consume(units)
        self.tiers.scheduler.release(units)
        self.tiers.scheduler.trim()


def _install_zero_grad() -> Callable[[], None]:
    """``Optimizer.zero_grad`` (of every plain optimizer) forgets the paged gradients too."""
    torch_zero_grad = torch.optim.Optimizer.__dict__["zero_grad"]

    @functools.wraps(torch_zero_grad)
    def zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        torch_zero_grad(self, set_to_none)
        if not getattr(self, "_tieroffload_inner", False):  # a paged optimizer's chunk
            drop_stored_grads((p for g in self.param_groups for p in g["params"]),
                              set_to_none)

    torch.optim.Optimizer.zero_grad = zero_grad

    def undo() -> None:
        torch.optim.Optimizer.zero_grad = torch_zero_grad
    return undo


def _module_zero_grad(module: nn.Module, orig: Callable[..., None]) -> Callable[..., None]:
    def zero_grad(set_to_none: bool = True) -> None:
        orig(set_to_none)
        drop_stored_grads(module.parameters(), set_to_none)
    return zero_grad


def drop_stored_grads(params: Iterable[torch.Tensor], set_to_none: bool | None = None) -> None:
    """Forgets the paged gradients of ``params`` (``Policy.pages_grads``), which
    ``p.grad`` does not show: a plain optimizer's ``zero_grad`` cannot reach them (a paged
    optimizer's does). ``set_to_none``: that of the ``zero_grad`` that called it, which a
    paged optimizer follows (see ``PagedOptimizer.grads_zeroed``)."""
    ids = {id(p) for p in params}
    for s in states():
        for opt in list(s.optimizers):
            opt.grads_zeroed(ids, set_to_none)
        if s.grads is not None:
            units = {s.param_unit[i].id: s.param_unit[i] for i in ids if i in s.param_unit}
            # a paged optimizer's deferred updates have taken theirs (see its step)
            keep = [u for o in list(s.optimizers) for u in o.deferred_units()]
            s.grads.clear(list(units.values()), keep=keep)


def _paged(params: list[torch.Tensor]) -> list[torch.Tensor]:
    paging = [s for s in states() if s.grads is not None]
    return [p for p in params if any(id(p) in s.param_unit for s in paging)]


def grads_used_in_backward(params: list[torch.Tensor]) -> bool:
    """True when a paged optimizer with ``overlap="backward"`` has stepped some of ``params``
    in the backward just run: p.grad is None, and a clip would see no gradient."""
    return any(o.used_grads_of(params) for s in states() for o in list(s.optimizers))


def has_paged_grads(params: list[torch.Tensor]) -> bool:
    """True when some of ``params`` have their gradients paged (``Policy.pages_grads``)."""
    return bool(_paged(params))


def loss_scaled_owner(params: list[torch.Tensor]) -> Any:
    """The paged optimizer with loss scaling (fp16) that steps every one of ``params``, or
    None: their gradients are scaled, and its clip takes the norm over them unscaled."""
    if not params:
        return None
    return next((o for s in states() for o in list(s.optimizers)
                 if getattr(o, "scaler", None) is not None and o.owns(params)), None)


def clip_paged(params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0,
               error_if_nonfinite: bool = False) -> torch.Tensor:
    """``clip_grad_norm_`` over ``params``, some of whose gradients are paged to NVMe: through
    the paged optimizer that steps them, else (a plain optimizer) here. Each unit's stored
    gradients come in for their norms and go back; the coefficient waits in the pager and
    multiplies them when the step brings them in. The total is torch's, bit for bit."""
    paged = _paged(params)
    opt = next((o for s in states() if s.grads is not None for o in list(s.optimizers)
                if o.owns(paged)), None)
    if opt is not None:
        return opt.clip_params(params, max_norm, norm_type, error_if_nonfinite)
    wanted = {id(p) for p in params}
    stored = [(s.grads, [u], [p for p in u.params if id(p) in wanted])
              for s in states() if s.grads is not None for u in s.units]
    stored = [g for g in stored if g[2]]
    with torch.no_grad():
        total, coef, _ = clip_norm(params, max_norm, norm_type, error_if_nonfinite, stored)
        for pager, (u,), _ in stored:
            pager.clips.setdefault(u.id, []).append(coef)
    return total


# (gradient pager or None, units, their parameters among those clipped): None where the
# gradients are in p.grad, grouped only so that their norms are taken as before.
Stored = list[tuple[Any, list[Unit], list[torch.Tensor]]]


def clip_norm(params: list[torch.Tensor], max_norm: float, norm_type: float,
              error_if_nonfinite: bool, stored: Stored, earlier: list[torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The norm and clip of ``clip_grad_norm_`` over ``params`` (torch's total, bit for bit),
    shared by plain and paged optimizers: the gradients of each ``stored`` group with a pager
    come in for their norms (times ``earlier`` coefficients not applied yet) and go back; the
    rest are in ``p.grad`` and are clipped now. Returns the total, the coefficient and whether
    some stored gradient is left for the caller to clip later (by the coefficient)."""
    norm_type = float(norm_type)
    norms, later = _norms(params, norm_type, stored, earlier or [], None)
    total = total_norm(params, norms, norm_type)
    present = [p for p in params if id(p) in norms]
    coef = clip_coefficient(total, max_norm, norm_type, error_if_nonfinite)
    _clip_now([p for p in params if id(p) not in later], coef)
    return total, coef, any(id(p) in later for p in present)


def unscaled_norm(params: list[torch.Tensor], norm_type: float, stored: Stored, scale: float,
                  earlier: list[tuple[frozenset[int], torch.Tensor]]) -> torch.Tensor:
    """The total norm of the gradients of ``params`` (``stored`` as in ``clip_norm``), which
    are scaled by ``scale`` (fp16 loss scaling, a power of two), over the unscaled gradients
    and in fp32, as torch's over fp32 copies divided by ``scale`` would be (bit for bit: a
    power of two divides exactly); inf or nan where a scaled gradient overflowed. Clips
    nothing: ``earlier`` holds the coefficients (with the ids of the parameters they clip) not
    applied yet, which multiply those parameters' norms."""
    norm_type = float(norm_type)
    norms, _ = _norms(params, norm_type, stored, [], torch.float32)
    for ids, c in earlier:
        for i in ids & norms.keys():
            n, device, dtype = norms[i]
            norms[i] = (n * c.to(n.device), device, dtype)
    return total_norm(params, norms, norm_type) / scale


def clip_fp32(params: list[torch.Tensor], max_norm: float, norm_type: float,
              error_if_nonfinite: bool, stored: Stored, scale: float,
              earlier: list[tuple[frozenset[int], torch.Tensor]], skip_nonfinite: bool,
              now: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DeepSpeed's clip (under loss scaling, or asked for): the norm over the unscaled
    gradients in fp32 (``unscaled_norm``) and its coefficient, which the caller's step applies
    to the gradients' fp32 copies; the gradients of ``now`` (no copies of theirs are stepped)
    are clipped at once, as torch's clip does. With ``skip_nonfinite`` (loss scaling) a
    non-finite norm is an overflow the step skips: nothing is clipped and the coefficient is
    None (one of 0 would step on zero gradients); without, it clips (to NaN, as DeepSpeed)."""
    total = unscaled_norm(params, norm_type, stored, scale, earlier)
    coef = clip_coefficient(total, max_norm, norm_type, error_if_nonfinite)
    if skip_nonfinite and not bool(torch.isfinite(total)):
        return total, None
    _clip_now(now, coef)
    return total, coef


def _clip_now(params: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiplies the gradients in ``p.grad`` of ``params`` by ``coef``."""
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.device))


def _norms(params: list[torch.Tensor], norm_type: float, stored: Stored,
           earlier: list[torch.Tensor], dtype: torch.dtype | None) -> tuple[Norms, set[int]]:
    """The norms of the gradients of ``params`` (see ``clip_norm``; in ``dtype`` unless None),
    and the ids of those a pager holds."""
    norms: Norms = {}
    seen: set[int] = set()
    later: set[int] = set()
    for pager, units, ps in stored:
        if pager is not None:
            pager.bring_in(units)
        try:
            add_grad_norms(ps, norm_type, norms, earlier if pager is not None else [], dtype)
        finally:
            if pager is not None:
                pager.put_back(units)
        seen.update(id(p) for p in ps)
        if pager is not None:
            later.update(id(p) for p in ps)
    add_grad_norms([p for p in params if id(p) not in seen], norm_type, norms, [], dtype)
    return norms, later


def _step_pre(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if getattr(optimizer, "_tieroffload_paged", False):
        return  # it pages its chunks itself
    # torch hands the hook step()'s arguments with the optimizer itself first
    closure = args[1] if len(args) > 1 else kwargs.get("closure")
    if closure is not None and has_paged_grads(
            [p for g in optimizer.param_groups for p in g["params"]]):
        raise RuntimeError(
            f"tieroffload: {type(optimizer).__name__}.step(closure) over paged gradients "
            "(grads=\"nvme\", or grads=\"cpu\" with CUDA): the closure's backward pages them "
            "away before the step could use them; keep them on the compute device for a "
            "closure (grads=\"cpu\" on the CPU, grads=\"gpu\" with CUDA)")
    for s in states():
        s.steps.begin(optimizer)


def _step_post(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if getattr(optimizer, "_tieroffload_paged", False):
        return
    for s in states():
        s.steps.end(optimizer)


def _install_step_hooks() -> Callable[[], None]:
    """torch's process-wide hooks around every optimizer's step: a plain optimizer's units
    come in for it (``PlainSteps``)."""
    handles = [register_optimizer_step_pre_hook(_step_pre),
               register_optimizer_step_post_hook(_step_post)]

    def undo() -> None:
        for h in handles:
            h.remove()
    return undo


patches.register("Optimizer.zero_grad", _install_zero_grad)
patches.register("optimizer step hooks", _install_step_hooks)
# Accelerator.clip_grad_norm_ (the HF Trainer's clip) reaches paged gradients: held by the
# models whose gradients are paged.
accelerate_clip = patches.Patch("Accelerator.clip_grad_norm_",
                                lambda: accelerate.route_clip(has_paged_grads, clip_paged))

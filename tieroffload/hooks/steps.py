"""Plain (not paged) optimizers over an offloaded model: their ``step`` is intercepted so
that the units it updates are resident and written back, and gradients stored on NVMe can be
forgotten (``drop_stored_grads``)."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ..utils.sizes import format_bytes

if TYPE_CHECKING:
    from .state import OffloadState

log = logging.getLogger("tieroffload")

live: weakref.WeakSet[OffloadState] = weakref.WeakSet()  # every open OffloadState
_warned_step = False


class StepHooks:
    """The part of ``OffloadState`` that pins units around a plain optimizer's step."""

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


def drop_stored_grads(params: Iterable[torch.Tensor]) -> None:
    """Forgets the gradients of ``params`` that wait on NVMe (``grads="nvme"``), which
    ``p.grad`` does not show: a plain optimizer's ``zero_grad`` cannot reach them (a paged
    optimizer's does)."""
    ids = {id(p) for p in params}
    for s in list(live):
        if s.grads is not None:
            units = {s.param_unit[i].id: s.param_unit[i] for i in ids if i in s.param_unit}
            s.grads.clear(list(units.values()))


def _step_pre(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if getattr(optimizer, "_tieroffload_paged", False):
        return  # it pages its chunks itself
    for s in list(live):
        s.step_begin(optimizer)


def _step_post(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if getattr(optimizer, "_tieroffload_paged", False):
        return
    for s in list(live):
        s.step_end(optimizer)


register_optimizer_step_pre_hook(_step_pre)
register_optimizer_step_post_hook(_step_post)



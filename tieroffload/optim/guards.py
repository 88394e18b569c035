"""Misuse of a paged optimizer refused at the user's call, with the fix: a closed optimizer, a
parameter it cannot step, two over the same parameters, an unscaled loss under loss scaling, a
backward after ``step()`` with no ``zero_grad()``, options that cannot go together."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch

from ..core.units import Unit
from ..utils.dist import world_size
from .loss_scale import LossScale


class Misuse:
    """The flags the checks of a built optimizer read: ``closed``; ``scaled`` (``scale_loss``
    was called since the last step() or zero_grad()); ``unzeroed`` (a step() let gradients go,
    p.grad is None after it, and no zero_grad() came since: PyTorch would add the next
    backward's gradients to those)."""

    def __init__(self) -> None:
        self.closed = False
        self.scaled = False
        self.unzeroed = False

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError(
                "tieroffload: this paged optimizer is closed (opt.close(), or "
                "tieroffload.close(model)) and its state is gone: take opt.state_dict() before "
                "closing (a torch optimizer loads it), and make a new one with "
                "tieroffload.optimizer(model, ...) to train offloaded again")

    def check_scaled(self, scaler: LossScale | None, backwards: int) -> None:
        """With loss scaling, ``step()`` divides the gradients by the scale: a backward of an
        unscaled loss would step by 1/65536 of them, and nothing would learn."""
        if scaler is not None and backwards and not self.scaled:
            raise RuntimeError(
                f"tieroffload: loss scaling is on (scale {scaler.scale:g}; fp16 parameters "
                "default to it) but backward ran on a loss not passed through "
                "opt.scale_loss(loss): backward opt.scale_loss(loss), or build the optimizer "
                "with loss_scale=None")

    def check_zeroed(self) -> None:
        """See ``PagedOptimizer.check_zeroed``."""
        if self.unzeroed:
            raise RuntimeError(
                "tieroffload: a backward after step() with no zero_grad() since: PyTorch would "
                "add its gradients to those the step used (p.grad keeps them), but the paged "
                "optimizer lets them go at step() (p.grad is None after it); call "
                "opt.zero_grad() or model.zero_grad() after each step() (p.grad = None by hand "
                "goes unseen), or use overlap=False, which keeps them")


def check_alone(opt: Any, live: Iterable[Any]) -> None:
    """Two open paged optimizers stepping the same parameters would each use up what the
    other needs (the paged gradients, the deferred updates): refused at the next training
    forward or step. ``live``: the paged optimizers not closed."""
    ids = opt._ids
    others = [o for o in list(opt.offload.optimizers) if o is not opt and o in live]
    for other in others:
        shared = len(ids & other._ids)
        if shared:
            raise ValueError(
                f"tieroffload: {shared} of the parameters this paged optimizer steps are "
                "stepped by another open paged optimizer of the model too: give each its own "
                "parameters (params=...), or close the other first (one dropped after a "
                "step() whose update is still deferred stays open until it is applied: "
                "run `with tieroffload.materialize(model): pass` before building this one)")


def check_in_model(param_groups: list[dict[str, Any]], param_unit: dict[int, Unit]) -> None:
    """It steps the model's parameters chunk by chunk along its units: one from elsewhere
    (a loss temperature) would never be stepped, so it is refused."""
    seen: set[int] = set()
    for gi, g in enumerate(param_groups):
        for i, p in enumerate(g["params"]):
            where = (f"tieroffload.optimizer: parameter {i} of param group {gi} (shape "
                     f"{tuple(p.shape)}, {p.dtype})")
            if id(p) in seen:
                raise ValueError(f"{where} is listed twice; torch would step it twice (and "
                                 "deprecates it): list each parameter once")
            seen.add(id(p))
            if id(p) not in param_unit:
                raise ValueError(
                    f"{where} is not a parameter of the offloaded model, and the paged "
                    "optimizer steps only the model's; step it with a torch.optim "
                    "optimizer of its own")


def check_whole_units(units: list[Unit], ids: frozenset[int], grads: str) -> None:
    """Paged gradients are stored, read back and used up a unit (module) at a time: one
    paged optimizer steps all of a module's trainable parameters or none."""
    for u in units:
        if not any(id(p) in ids for p in u.params):
            continue
        other = [n for n, p in zip(u.names, u.params) if p.requires_grad and id(p) not in ids]
        if other:
            raise ValueError(
                f"tieroffload.optimizer: module {u.name!r} has parameters this optimizer "
                f"steps and {len(other)} trainable one(s) it does not ({other[0]!r}); with "
                f"gradients paged (grads={grads!r}) a module's "
                "gradients are stored and used up together, so one paged optimizer steps "
                "all of them: give different settings (lr, weight_decay) by param groups")


def check_options(overlap: Any, accumulation_steps: Any, scaler: LossScale | None,
                  shards: list[Any]) -> None:
    """Refuses ``overlap`` and ``accumulation_steps`` values, alone or together."""
    if overlap not in (True, False, "backward"):
        raise ValueError(f'overlap must be True, False or "backward", not {overlap!r}')
    if overlap == "backward" and (scaler is not None or shards or world_size() > 1):
        raise ValueError(
            'overlap="backward" steps each chunk as soon as its gradients are final, so it '
            "cannot wait for a check of every gradient (fp16 loss scaling) or for other "
            "ranks' gradients (DDP, FSDP): use overlap=True")
    if not (isinstance(accumulation_steps, int) and accumulation_steps >= 1):
        raise ValueError(f"accumulation_steps must be an int >= 1, not {accumulation_steps!r}")
    if accumulation_steps != 1 and overlap != "backward":
        raise ValueError(
            'accumulation_steps is for overlap="backward", which must know which backward '
            "is the last before step(); otherwise gradients accumulate until step() anyway")


def make_scaler(loss_scale: Any, fp16: bool) -> LossScale | None:
    """The loss scale of ``loss_scale`` ("auto": dynamic where any parameter is fp16; a
    ``LossScale``: itself)."""
    if isinstance(loss_scale, LossScale):
        return loss_scale
    if loss_scale == "auto":
        loss_scale = "dynamic" if fp16 else None
    if loss_scale not in (None, "dynamic"):
        if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) \
                or not 1.0 <= loss_scale <= 2.0**64:
            raise ValueError(f'loss_scale must be "auto", "dynamic", None or a number from 1 '
                             f"to 2**64 (a power of two keeps it exact), not {loss_scale!r}")
    return (None if loss_scale is None else LossScale() if loss_scale == "dynamic"
            else LossScale(float(loss_scale), dynamic=False))


def check_optimizer_class(opt_cls: Any) -> None:
    """Refuses what is no torch optimizer class, or one whose step needs a closure."""
    if not (isinstance(opt_cls, type) and issubclass(opt_cls, torch.optim.Optimizer)):
        raise TypeError(f"opt_cls must be a torch.optim.Optimizer class, not {opt_cls!r}")
    closure = inspect.signature(opt_cls.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(f"tieroffload.optimizer: {opt_cls.__name__}.step needs a closure (it "
                         "re-evaluates the loss), which a step taken chunk by chunk cannot "
                         "give; step it as a plain optimizer over the model, with the "
                         'gradients on the compute device (grads="cpu" on the CPU, grads="gpu" '
                         "with CUDA)")

"""Hyperparameters refused where torch refuses them: at ``step()``.

The paged optimizer defers its chunks' updates (to the next forward) or runs them in backward,
so a value its class's ``step`` refuses (``lr=None``, ``lr="3e-3"``, set on ``param_groups`` or
loaded from a checkpoint) would fail a later call, after gradients were taken, where fixing the
value could no longer help. ``HyperCheck`` steps a one-element probe with each group's values
first: the call the user made raises, and nothing of the model's has changed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class HyperCheck:
    """A probe parameter and an optimizer of the user's class and arguments over it alone."""

    def __init__(self, opt_cls: type[torch.optim.Optimizer], kwargs: dict[str, Any],
                 device: torch.device) -> None:
        self.p = nn.Parameter(torch.zeros(1, device=device))
        self.opt = opt_cls([self.p], **kwargs)
        self.name = opt_cls.__name__

    def check(self, groups: list[dict[str, Any]], in_backward: bool = False) -> None:
        """Raises, naming the group and the suspect value, where ``opt_cls.step`` refuses the
        hyperparameters of one of ``groups`` (``in_backward``: the check runs in a backward
        that steps chunks, which it stops part way). The probe starts from no state each
        time."""
        inner = self.opt.param_groups[0]
        for gi, g in enumerate(groups):
            inner.update({k: v for k, v in g.items() if k != "params"})
            self.p.grad = torch.zeros_like(self.p)
            try:
                with torch.no_grad():
                    self.opt.step()
            except Exception as e:
                kind = type(e) if isinstance(e, (TypeError, ValueError)) else RuntimeError
                raise kind(self._refusal(gi, g, e, in_backward)) from None
            finally:
                self.p.grad = None
                self.opt.state.clear()

    def _refusal(self, gi: int, group: dict[str, Any], error: Exception,
                 in_backward: bool) -> str:
        """One line: the group, the values unlike their defaults' type, torch's reason."""
        suspects = [f"{k}={v!r}" for k, v in group.items()
                    if k != "params" and k in self.opt.defaults
                    and not _same_kind(v, self.opt.defaults[k])]
        what = ", ".join(suspects) or "its hyperparameters"
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        redo = ("then opt.zero_grad() and run this batch's forward and backward again (this "
                "backward stopped part way; nothing was stepped)" if in_backward else
                "and call step() again (nothing was stepped)")
        return (f"tieroffload: param group {gi}: {self.name}.step() refuses {what} ({reason}); "
                f"set a valid value in opt.param_groups[{gi}] {redo}")


def _same_kind(value: Any, default: Any) -> bool:
    """``value`` has the kind of type ``default`` has (a number for a number, a tensor counting
    as one; a tuple for a tuple; a bool for a bool); None defaults accept anything."""
    if default is None:
        return True
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, (int, float, torch.Tensor)):
        return isinstance(value, (int, float, torch.Tensor)) and not isinstance(value, bool)
    if isinstance(default, (tuple, list)):
        return isinstance(value, (tuple, list)) and len(value) == len(default)
    return isinstance(value, type(default))

"""accelerate's ``Accelerator.clip_grad_norm_`` (which the HF Trainer calls) takes the norm of
``p.grad`` where it is not None: gradients paged to NVMe are routed to tieroffload first."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterable
from typing import Any, Callable

import torch

Clip = Callable[[list[torch.Tensor], float, float], torch.Tensor]


def route_clip(takes: Callable[[list[torch.Tensor]], bool],
               clip: Clip) -> Callable[[], None]:
    """Wraps ``Accelerator.clip_grad_norm_`` (nothing if accelerate is not installed):
    parameters that ``takes`` are clipped by ``clip(params, max_norm, norm_type)``. Returns
    what puts accelerate's own back."""
    if importlib.util.find_spec("accelerate") is None:
        return lambda: None
    from accelerate import Accelerator

    orig = Accelerator.__dict__["clip_grad_norm_"]

    @functools.wraps(orig)
    def clip_grad_norm_(self: Any, parameters: Iterable[torch.Tensor], max_norm: float,
                        norm_type: float = 2) -> Any:
        params = list(parameters)
        if not takes(params):
            return orig(self, params, max_norm, norm_type)
        self.unscale_gradients()
        return clip(params, max_norm, norm_type)

    Accelerator.clip_grad_norm_ = clip_grad_norm_

    def undo() -> None:
        Accelerator.clip_grad_norm_ = orig
    return undo

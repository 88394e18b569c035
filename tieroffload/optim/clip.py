"""``torch.nn.utils.clip_grad_norm_`` over offloaded parameters whose gradients wait on NVMe
(``grads="nvme"``, where ``p.grad`` is None): the paged optimizer that steps them clips them,
so code that calls torch's function (the HF Trainer, accelerate) gets the true norm."""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch

from ..hooks.steps import clip_paged, has_paged_grads, live

_torch_clip_grad_norm_ = torch.nn.utils.clip_grad_norm_


@functools.wraps(_torch_clip_grad_norm_)
def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    paging = [s for s in list(live) if s.grads is not None]
    if not paging:
        return _torch_clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite,
                                      foreach)
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if not has_paged_grads(params):
        return _torch_clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
    return clip_paged(params, max_norm, norm_type, error_if_nonfinite)


def install() -> None:
    """Puts ``clip_grad_norm_`` in place of torch's (by module attribute, as callers find it)."""
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_

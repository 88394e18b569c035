"""``torch.nn.utils.clip_grad_norm_`` over offloaded parameters whose gradients wait on NVMe
(``grads="nvme"``, where ``p.grad`` is None): the paged optimizer that steps them clips them,
so code that calls torch's function (the HF Trainer, accelerate) gets the true norm."""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch

from ..hooks.steps import live
from ..integrations import accelerate

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


def _paged(params: list[torch.Tensor]) -> list[torch.Tensor]:
    paging = [s for s in list(live) if s.grads is not None]
    return [p for p in params if any(id(p) in s.param_unit for s in paging)]


def has_paged_grads(params: list[torch.Tensor]) -> bool:
    """True when some of ``params`` have their gradients paged to NVMe (grads="nvme")."""
    return bool(_paged(params))


def clip_paged(params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0,
               error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clips ``params``, some of whose gradients are paged to NVMe, through the paged
    optimizer that steps them."""
    paged = _paged(params)
    opt = next((o for s in list(live) if s.grads is not None for o in list(s.optimizers)
                if o.owns(paged)), None)
    if opt is None:
        raise RuntimeError(
            "tieroffload: grads=\"nvme\" keeps gradients on NVMe (p.grad is None), where "
            "torch.nn.utils.clip_grad_norm_ cannot see them; step with tieroffload.optimizer "
            "and call opt.clip_grad_norm_(max_norm)")
    return opt.clip_params(params, max_norm, norm_type, error_if_nonfinite)


def install() -> None:
    """Puts ``clip_grad_norm_`` in place of torch's (by module attribute, as callers find it)."""
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_


def install_accelerate() -> None:
    """Routes accelerate's ``clip_grad_norm_`` (it skips parameters whose ``p.grad`` is None)
    through ``clip_paged``; called when a paged optimizer over NVMe gradients is built."""
    accelerate.route_clip(has_paged_grads, clip_paged)

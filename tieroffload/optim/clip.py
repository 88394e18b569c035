"""``torch.nn.utils.clip_grad_norm_`` over offloaded parameters whose gradients are paged
(``grads="nvme"``, or ``"cpu"`` with CUDA, where ``p.grad`` is None): they are clipped where
they are stored (see ``hooks.steps.clip_paged``), so code that calls torch's function gets the
true norm; so do parameters of a paged optimizer with loss scaling (fp16), whose gradients
are scaled: the norm is over them unscaled, in fp32 (see ``PagedOptimizer.clip_grad_norm_``).
``clip_grad_value_`` cannot reach them, nor can ``clip_grads_with_norm_`` after
``get_total_norm`` (which sees no gradient there): both say so. After a backward in which
``overlap="backward"`` stepped them, the gradients are used up: all three say so."""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch

from ..hooks import patches
from ..hooks.steps import clip_paged, grads_used_in_backward, has_paged_grads, loss_scaled_owner

_torch_clip_grad_norm_ = torch.nn.utils.clip_grad_norm_
_torch_clip_grad_value_ = torch.nn.utils.clip_grad_value_
_torch_clip_grads_with_norm_ = torch.nn.utils.clip_grads_with_norm_


def _listed(parameters: torch.Tensor | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


@functools.wraps(_torch_clip_grad_norm_)
def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    params = _listed(parameters)
    _refuse_used(params, "clip_grad_norm_")
    if not has_paged_grads(params):
        if (opt := loss_scaled_owner(params)) is not None:  # torch's would take a norm
            return opt.clip_params(params, max_norm, norm_type,  # of fp16 scaled gradients
                                   error_if_nonfinite)
        return _torch_clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
    return clip_paged(params, max_norm, norm_type, error_if_nonfinite)


def _refuse_used(params: list[torch.Tensor], what: str) -> None:
    """Torch's clip would see p.grad None, clip nothing and return a norm of 0."""
    if grads_used_in_backward(params):
        raise RuntimeError(
            f'tieroffload: {what} after a backward in which overlap="backward" stepped the '
            "chunks: their gradients are used up (p.grad is None), so it would clip nothing "
            "and return 0; use overlap=True to clip")


def _refuse_paged(params: list[torch.Tensor], what: str) -> None:
    _refuse_used(params, what)
    if has_paged_grads(params):
        raise RuntimeError(
            'tieroffload: paged gradients (grads="nvme", or grads="cpu" with CUDA) are not in '
            f"p.grad, where {what} cannot reach them; keep them on the compute device "
            '(grads="cpu" on the CPU, grads="gpu" with CUDA) or clip by norm '
            "(torch.nn.utils.clip_grad_norm_, which reaches them)")


@functools.wraps(_torch_clip_grad_value_)
def clip_grad_value_(parameters: torch.Tensor | Iterable[torch.Tensor], clip_value: float,
                     foreach: bool | None = None) -> None:
    params = _listed(parameters)
    _refuse_paged(params, "clip_grad_value_")
    return _torch_clip_grad_value_(params, clip_value, foreach)


@functools.wraps(_torch_clip_grads_with_norm_)
def clip_grads_with_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                          total_norm: torch.Tensor, foreach: bool | None = None) -> None:
    params = _listed(parameters)
    _refuse_paged(params, "get_total_norm and clip_grads_with_norm_")
    return _torch_clip_grads_with_norm_(params, max_norm, total_norm, foreach)


_ABSENT = object()
_REPLACED = {"clip_grad_norm_": clip_grad_norm_, "clip_grad_value_": clip_grad_value_,
             "clip_grads_with_norm_": clip_grads_with_norm_}


def _put_in_place() -> patches.Undo:
    """Puts these in place of torch's (by module attribute, as callers find them); returns
    what puts torch's back, the very objects replaced."""
    modules = (torch.nn.utils, torch.nn.utils.clip_grad)
    before = [(m, name, m.__dict__.get(name, _ABSENT)) for m in modules for name in _REPLACED]
    for m, name, _ in before:
        setattr(m, name, _REPLACED[name])

    def undo() -> None:
        for m, name, orig in before:
            if orig is _ABSENT:  # torch defines it in one of the two modules only
                delattr(m, name)
            else:
                setattr(m, name, orig)
    return undo


def install() -> None:
    """Registers these with ``hooks.patches``: they replace torch's while a model is
    offloaded (from the first ``offload`` to the last ``close``), not on import."""
    patches.register("torch.nn.utils clip functions", _put_in_place)

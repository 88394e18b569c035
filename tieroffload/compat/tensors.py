"""Tensor and storage internals: a storage's identity, a tensor's version counter, the
per-tensor norms torch.nn.utils.clip_grad_norm_ takes, and switching a tensor subclass's
``__torch_function__`` off."""

from __future__ import annotations

import contextlib

import torch

TESTED = ("2.13",)


def storage_key(storage: torch.UntypedStorage) -> int:
    """The same for every Python object over one storage (``id()`` is not)."""
    return storage._cdata


def version(t: torch.Tensor) -> int:
    """The tensor's in-place version counter (autograd's check that saved tensors are unchanged)."""
    return t._version


def plain_tensors() -> contextlib.AbstractContextManager:
    """Inside, tensor subclasses dispatch as plain tensors (their ``__torch_function__`` is
    not called) and results are plain tensors."""
    return torch._C.DisableTorchFunctionSubclass()


def grad_norms(grads: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Each tensor's ``norm_type`` norm, computed as ``torch.nn.utils.get_total_norm`` does
    (``_foreach_norm`` where foreach is supported), so a total taken from them is bit-equal.
    The tensors must share one device and dtype."""
    if not grads:
        return []
    device = grads[0].device
    if device.type in ("cpu", "cuda") and all(type(g) is torch.Tensor for g in grads):
        return list(torch._foreach_norm(grads, norm_type))
    return [torch.linalg.vector_norm(g, norm_type) for g in grads]

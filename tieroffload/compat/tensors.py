"""Tensor and storage internals: a storage's identity and users, a tensor's version counter, the
per-tensor norms torch.nn.utils.clip_grad_norm_ takes, and switching a tensor subclass's
``__torch_function__`` off."""

from __future__ import annotations

import contextlib

import torch

TESTED = ("2.11", "2.13")


def storage_key(storage: torch.UntypedStorage) -> int:
    """The same for every Python object over one storage (``id()`` is not)."""
    return storage._cdata


def storage_users(storage: torch.UntypedStorage) -> int:
    """How many references the storage has (tensors viewing it, Python storage objects)."""
    return torch._C._storage_Use_Count(storage._cdata)


def version(t: torch.Tensor) -> int:
    """The tensor's in-place version counter (autograd's check that saved tensors are unchanged)."""
    return t._version


def plain_tensors() -> contextlib.AbstractContextManager:
    """Inside, tensor subclasses dispatch as plain tensors (their ``__torch_function__`` is
    not called) and results are plain tensors."""
    return torch._C.DisableTorchFunctionSubclass()


# Functions over tensors that read no values (``Module._apply`` asks this of every parameter).
NO_DATA_FUNCTIONS = frozenset({torch._has_compatible_shallow_copy_type})


def grad_norms(grads: list[torch.Tensor], norm_type: float,
               dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Each tensor's ``norm_type`` norm, computed as ``torch.nn.utils.get_total_norm`` does
    (``_foreach_norm`` where foreach is supported), so a total taken from them is bit-equal.
    The tensors must share one device and dtype; ``dtype``: computed in it (as the tensors
    cast to it would be), not theirs."""
    if not grads:
        return []
    device = grads[0].device
    if device.type in ("cpu", "cuda") and all(type(g) is torch.Tensor for g in grads):
        return list(torch._foreach_norm(grads, norm_type, dtype=dtype))
    return [torch.linalg.vector_norm(g, norm_type, dtype=dtype) for g in grads]


Norms = dict[int, tuple[torch.Tensor, torch.device, torch.dtype]]


def add_grad_norms(params: list[torch.Tensor], norm_type: float, out: Norms,
                   clips: list[torch.Tensor], dtype: torch.dtype | None = None) -> None:
    """Adds to ``out`` the norm of each parameter's gradient, times ``clips`` not yet
    applied (they are applied to ``p.grad``: a copy brought in, not written back);
    ``dtype``: the norms are computed in it (fp32 for fp16 gradients), not the gradients'."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        for c in clips:
            g.mul_(c.to(g.device))
        groups.setdefault((g.device, g.dtype), []).append(p)
    for (device, own), ps in groups.items():
        for p, n in zip(ps, grad_norms([p.grad for p in ps], norm_type, dtype)):
            out[id(p)] = (n, device, own if dtype is None else dtype)


def total_norm(params: list[torch.Tensor], norms: Norms, norm_type: float) -> torch.Tensor:
    """The norm of the per-parameter ``norms`` of ``params`` (those present), stacked in
    torch's order (by device and dtype of first appearance), so it is bit-equal to
    ``torch.nn.utils.clip_grad_norm_``'s; 0 where none is present."""
    present = [p for p in params if id(p) in norms]
    if not present:
        return torch.tensor(0.0)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in present:
        n, device, dtype = norms[id(p)]
        groups.setdefault((device, dtype), []).append(n)
    first = norms[id(present[0])][1]
    return torch.linalg.vector_norm(
        torch.stack([n.to(first) for ns in groups.values() for n in ns]), norm_type)


def clip_coefficient(total: torch.Tensor, max_norm: float, norm_type: float,
                     error_if_nonfinite: bool) -> torch.Tensor:
    """What ``clip_grad_norm_`` multiplies the gradients by, for a total norm ``total``."""
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from "
                           "`parameters` is non-finite, so it cannot be clipped")
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)

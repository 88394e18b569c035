"""Tensor and storage internals: a storage's identity and a tensor's version counter."""

from __future__ import annotations

import torch

TESTED = ("2.13",)


def storage_key(storage: torch.UntypedStorage) -> int:
    """The same for every Python object over one storage (``id()`` is not)."""
    return storage._cdata


def version(t: torch.Tensor) -> int:
    """The tensor's in-place version counter (autograd's check that saved tensors are unchanged)."""
    return t._version

"""Streaming weights into an offloaded model, one unit at a time."""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from .state import _state


def load_weights(model: nn.Module, source: str | os.PathLike | dict[str, torch.Tensor],
                 strict: bool = True) -> None:
    """Loads weights from a safetensors file or a state dict, streamed one unit at a time into
    its tier, so a model larger than RAM can be filled."""
    s = _state(model)
    if isinstance(source, dict):
        keys = set(source)
        get = source.__getitem__
        ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
    else:
        from safetensors import safe_open

        ctx = safe_open(os.fspath(source), framework="pt", device="cpu")
    with ctx as f:
        if f is not None:
            keys, get = set(f.keys()), f.get_tensor
        missing = [n for u in s.units for n in u.names if n not in keys]
        if strict and missing:
            raise KeyError(f"weights are missing {len(missing)} parameters: {missing[:5]}...")
        for u in s.units:
            todo = [(n, seg.param) for n, seg in zip(u.names, u.segments) if n in keys]
            if not todo:
                continue
            with s.resident([u], writeback=s.mover is not None), torch.no_grad():
                for name, p in todo:
                    t = get(name)
                    if t.shape != p.shape:
                        raise ValueError(f"{name}: weights have shape {tuple(t.shape)}, the "
                                         f"model {tuple(p.shape)}")
                    p.copy_(t)

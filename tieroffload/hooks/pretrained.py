"""Hugging Face models straight into the tiers: built on the meta device from a
``save_pretrained`` directory's config, offloaded, then filled shard by shard. transformers is
imported only when this is called."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from .policy import BasePolicy
from .state import offload
from .weights import load_weights


def from_pretrained(path: str | os.PathLike, policy: BasePolicy,
                    model_class: type | None = None,
                    dtype: torch.dtype | str = "auto") -> nn.Module:
    """``model_class.from_pretrained(path)`` for a model that does not fit in memory: the
    model is built on the meta device (no memory), offloaded under ``policy`` and its
    safetensors shards streamed into the tiers one at a time, so the peak memory is about the
    policy's budget plus one shard's largest tensor. ``model_class`` defaults to the
    config's first architecture; ``dtype="auto"`` takes the config's dtype (else float32).
    Ties are those the model makes; the model is returned in eval mode, as transformers
    returns it. Nothing is downloaded: ``path`` is a local directory."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(os.fspath(path), local_files_only=True)
    if model_class is None:
        arch = (getattr(config, "architectures", None) or [None])[0]
        model_class = getattr(transformers, arch, None) if arch else None
        if model_class is None:
            raise ValueError(f"from_pretrained: {path}/config.json names no architecture "
                             f"transformers has ({arch!r}); pass model_class=")
    dtype = _dtype(config, dtype)
    with torch.device("meta"):
        model = model_class._from_config(config, dtype=dtype)
    model.eval()
    offload(model, policy)
    load_weights(model, path)
    return model


def _dtype(config: Any, dtype: torch.dtype | str) -> torch.dtype:
    if dtype != "auto":
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"from_pretrained: dtype={dtype!r}; pass a torch.dtype or 'auto'")
        return dtype
    found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(found, str):
        found = getattr(torch, found, None)
    return found if isinstance(found, torch.dtype) else torch.float32

"""``model.to(...)``, ``.cpu()``, ``.cuda()``, ``.half()`` on an offloaded model (torch's
``Module._apply``): to the device and dtype it already has, nothing moves (the Hugging Face
Trainer and ``accelerator.prepare`` call ``model.to(device)``, which would otherwise bring
every unit in at once and write it home again); any real conversion is refused with the fix."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


def guarded_apply(module: nn.Module, orig: Callable,
                  offloaded: Callable[[torch.Tensor], bool]) -> Callable:
    """``module._apply`` for an offloaded model: ``fn`` is tried on an empty tensor of each
    (dtype, device) the module's parameters have; a change is refused, and where nothing
    changes the offloaded parameters are left out of ``fn`` (their units stay where they
    are), while gradients and buffers still go through it."""
    probes = {(p.dtype, p.device) for p in module.parameters()}

    def _apply(fn: Callable[[torch.Tensor], torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        for dtype, device in probes:
            t = fn(torch.empty(0, dtype=dtype, device=device))
            if t.device != device:
                raise ValueError(
                    f"tieroffload: moving an offloaded model from {device} to {t.device} "
                    "(model.to/cuda/cpu) would leave its pages behind; it computes on "
                    f"{device}: pick that with Policy(device=...) before tieroffload.offload, "
                    "or close(model) first")
            if t.dtype != dtype:
                raise ValueError(
                    f"tieroffload: converting an offloaded model ({dtype} on {device} -> "
                    f"{t.dtype} on {t.device}, model.to/half/float) would leave its pages "
                    "behind; convert before tieroffload.offload, or close(model) first")

        def same(t: torch.Tensor) -> torch.Tensor:
            return t if offloaded(t) else fn(t)
        return orig(same, *args, **kwargs)
    return _apply

"""Whether a ``torch.profiler`` (or ``torch.autograd.profiler``) session is recording."""

from __future__ import annotations

import torch

TESTED = ("2.13",)


def profiling() -> bool:
    """True while a profiler records on this process: only then are ranges worth opening."""
    return torch._C._autograd._profiler_enabled()

"""Where this process stands under torch.distributed: rank, world size, the module when several
ranks run. Works before ``init_process_group`` (from ``RANK``, as torchrun sets it)."""

from __future__ import annotations

import os
from typing import Any


def _initialized() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank() -> int:
    """This process's rank (0 when not distributed; ``RANK`` before the group exists)."""
    dist = _initialized()
    return dist.get_rank() if dist else int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """The number of ranks in the default group (1 when not distributed)."""
    dist = _initialized()
    return dist.get_world_size() if dist else 1


def distributed() -> Any:
    """torch.distributed when several ranks run, else None."""
    dist = _initialized()
    return dist if dist and dist.get_world_size() > 1 else None

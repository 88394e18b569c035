"""tieroffload: tiered memory offload (GPU, CPU RAM, NVMe) for PyTorch."""

from . import aio, hf
from ._version import __version__
from .aio.config import IOConfig
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .dropin import initialize
from .hooks import (
    close,
    drop_stored_grads,
    from_pretrained,
    load_weights,
    materialize,
    offload,
    stats,
)
from .monitor import Monitor
from .optim import optimizer
from .planner import AutoBatch
from .policy import Policy

__all__ = ["AutoBatch", "CheckpointError", "IOConfig", "Monitor", "Policy", "__version__", "aio",
           "hf",
           "close",
           "drop_stored_grads", "from_pretrained", "initialize", "load_checkpoint", "load_weights",
           "materialize", "offload", "optimizer", "save_checkpoint", "stats"]

"""tieroffload: tiered memory offload (GPU, CPU RAM, NVMe) for PyTorch."""

from . import aio
from .autobatch import AutoBatch
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .offload import close, load_weights, materialize, offload, stats
from .optimizer import optimizer
from .policy import IOConfig, Policy

__all__ = ["AutoBatch", "CheckpointError", "IOConfig", "Policy", "aio", "close", "load_checkpoint",
           "load_weights", "materialize", "offload", "optimizer", "save_checkpoint", "stats"]
__version__ = "0.1.0"

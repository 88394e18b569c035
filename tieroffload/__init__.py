"""tieroffload: tiered memory offload (GPU, CPU RAM, NVMe) for PyTorch."""

from . import aio
from .offload import close, load_weights, materialize, offload, stats
from .policy import IOConfig, Policy

__all__ = ["IOConfig", "Policy", "aio", "close", "load_weights", "materialize", "offload",
           "stats"]
__version__ = "0.1.0"

"""tieroffload: tiered memory offload (GPU, CPU RAM, NVMe) for PyTorch."""

from . import aio

__all__ = ["aio"]
__version__ = "0.1.0"

"""``tieroffload-bench nvme``: how fast is the disk, how fast is tieroffload on it, what to set.

``run_nvme`` returns the dict that ``--json`` writes; its ``recommended`` block is what
``IOConfig.from_dict`` / ``IOConfig.from_json`` load. Needs the ``bench`` extra
(``pip install tieroffload[bench]``: tqdm, aiofiles, matplotlib for ``--plot``).
"""

from typing import Any

from .common import BenchError
from .main import main
from .report import format_table, plot

__all__ = ["BenchError", "format_table", "main", "plot", "run_nvme"]


def __getattr__(name: str) -> Any:
    """``run_nvme`` on first use: importing it needs the ``bench`` extra, ``--help`` not."""
    if name == "run_nvme":
        from .nvme import run_nvme
        return run_nvme
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

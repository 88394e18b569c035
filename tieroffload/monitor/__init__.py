"""Watching a run: ``Monitor`` makes one record per training step (times, bytes per tier and
kind, memory per tier, prefetches, the loss), ``writers`` send records to CSV, JSON lines,
TensorBoard or Weights & Biases, and ``trace_steps`` writes a step's Chrome trace."""

from .monitor import Monitor
from .record import keys
from .writers import CSVWriter, JSONLinesWriter, TensorBoardWriter, WandbWriter

__all__ = ["CSVWriter", "JSONLinesWriter", "Monitor", "TensorBoardWriter", "WandbWriter",
           "keys"]

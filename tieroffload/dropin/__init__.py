"""A drop-in for ``deepspeed.initialize``: a whole DeepSpeed config (offload, precision, optimizer,
schedule, batch sizes, clipping, activation checkpointing, logging, monitor) run on one process
by tieroffload. ``initialize`` returns ``(engine, optimizer, dataloader, lr_scheduler)``."""

from .config import Plan, read_config
from .engine import Engine, initialize
from .schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["Engine", "LRRangeTest", "OneCycle", "Plan", "WarmupCosineLR", "WarmupDecayLR",
           "WarmupLR", "initialize", "read_config"]

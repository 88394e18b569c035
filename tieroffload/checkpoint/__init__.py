"""Checkpoints of offloaded models and paged optimizers, streamed tier to disk."""

from .store import CheckpointError, load_checkpoint, save_checkpoint

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]

"""The paged optimizer: optimizer state in its tier, streamed through the step chunk by chunk."""

from .loss_scale import LossScale
from .paged import PagedOptimizer, optimizer

__all__ = ["LossScale", "PagedOptimizer", "optimizer"]

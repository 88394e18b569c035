"""The paged optimizer: optimizer state in its tier, streamed through the step chunk by chunk."""

from . import clip
from .loss_scale import LossScale
from .paged import PagedOptimizer, optimizer

clip.install()

__all__ = ["LossScale", "PagedOptimizer", "optimizer"]

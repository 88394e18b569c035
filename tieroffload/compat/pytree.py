"""torch's pytree utilities (``torch.utils._pytree``)."""

from torch.utils._pytree import tree_flatten, tree_map

TESTED = ("2.11", "2.13")

__all__ = ["tree_flatten", "tree_map"]

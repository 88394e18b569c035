"""``offload(model, policy)``: the per-model state and the hooks that page its tensors."""

from .policy import BasePolicy
from .pretrained import from_pretrained
from .state import OffloadState, close, materialize, offload, stats
from .steps import drop_stored_grads
from .weights import load_weights

__all__ = ["BasePolicy", "OffloadState", "close", "drop_stored_grads", "from_pretrained",
           "load_weights", "materialize", "offload", "stats"]

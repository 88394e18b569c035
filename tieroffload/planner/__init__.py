"""``Policy.auto``: measured figures of the machine and the model, a cost model of a step, and
the search over placements. ``AutoBatch`` finds the largest batch that fits."""

from .autobatch import AutoBatch
from .cost import Prediction, predict
from .machine import Machine, io_cost
from .profile import Profile
from .search import Measured, Plan, auto, candidates, measure

__all__ = ["AutoBatch", "Machine", "Measured", "Plan", "Prediction", "Profile", "auto",
           "candidates", "io_cost", "measure", "predict"]

"""The user's ``Policy``: the offload settings, with ``Policy.auto`` to choose them."""

from __future__ import annotations

from typing import Any

from .hooks.policy import BasePolicy
from .planner.search import auto as _auto


class Policy(BasePolicy):
    __doc__ = BasePolicy.__doc__

    @classmethod
    def auto(cls, model: Any, *, sample: Any, gpu_budget: int | str | None = None,
             cpu_budget: int | str | None = None, nvme_dir: str | None = None,
             bench: Any = None, device: str | None = None,
             activation_threshold: int | str = "1MiB", machine: Any = None,
             profile: Any = None, build: Any = None, trials: int = 3) -> Policy:
        """The placement (parameters, gradients, optimizer state, activations), prefetch depth,
        resident budget and I/O settings with the least predicted step time that fits the
        budgets. ``sample(model)`` runs a forward on a sample batch and returns the loss: it is
        timed (with its backward) to feed the cost model. ``bench``: a ``tieroffload-bench
        nvme --json`` result (its file or dict) for the disk's figures, else they are measured
        in ``nvme_dir``. Budgets cover everything the step holds. ``explain()`` says why; a
        MemoryError with the numbers when nothing fits. ``machine`` (``planner.Machine``) and
        ``profile`` (``planner.Profile``) reuse figures measured before (``bench`` is then
        unused). With ``build`` (returns a fresh copy of the model) the ``trials`` placements
        predicted fastest are measured for a step each and the fastest that fits wins. See
        ``tieroffload.planner``."""
        return _auto(model, sample=sample, gpu_budget=gpu_budget, cpu_budget=cpu_budget,
                     nvme_dir=nvme_dir, bench=bench, device=device,
                     activation_threshold=activation_threshold, machine=machine,
                     profile=profile, build=build, trials=trials, policy_cls=cls)


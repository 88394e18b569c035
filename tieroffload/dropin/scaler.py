"""DeepSpeed's dynamic fp16 loss scale, for the paged optimizer: the fp16 section's
``initial_scale_power``, ``loss_scale_window``, ``hysteresis``, ``consecutive_hysteresis`` and
``min_loss_scale``."""

from __future__ import annotations

from typing import Any

from ..optim import LossScale


class DeepSpeedLossScale(LossScale):
    """An overflow skips the step; the scale halves (not below ``min_scale``) once
    ``hysteresis`` overflows have used up the allowance, which comes back when the scale
    doubles (or after any good step, with ``consecutive``). The scale doubles after ``window``
    good steps since the last overflow. An overflow at ``min_scale`` raises, as in DeepSpeed.
    Its state dict holds its settings and counters (``iteration``, ``last_overflow``,
    ``left``), so a checkpoint resumes it exactly."""

    # What a plain LossScale's state dict lacks: checkpoints saved before initialize's
    # optimizer saved this scale hold one (see load_state_dict).
    optional = frozenset({"min_scale", "hysteresis", "consecutive", "left", "iteration",
                          "last_overflow"})

    def __init__(self, scale: float, window: int, min_scale: float, hysteresis: int,
                 consecutive: bool) -> None:
        super().__init__(scale, window, dynamic=True)
        self.min_scale = float(min_scale)
        self.hysteresis = hysteresis
        self.left = hysteresis  # overflows still allowed before the scale halves
        self.consecutive = consecutive
        self.iteration = 0
        self.last_overflow = -1

    def update(self, overflow: bool) -> None:
        if overflow:
            halve = self.hysteresis == 1 or self.left == 1
            if halve and self.scale == self.min_scale:
                raise FloatingPointError(
                    f"fp16 gradients overflow at the minimum loss scale {self.min_scale:g} "
                    "(fp16.min_loss_scale): lower it, or train in bf16")
            self.skipped += 1
            if halve:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.left -= 1
            self.last_overflow = self.iteration
        else:
            if self.consecutive:
                self.left = self.hysteresis
            stable = self.iteration - self.last_overflow - 1
            if stable > 0 and stable % self.interval == 0:
                if not self.consecutive:
                    self.left = self.hysteresis
                self.scale *= 2
        self.iteration += 1

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """A state dict without this scale's fields (a plain LossScale's, from an older
        checkpoint) keeps this one's settings and starts its counters afresh, as built."""
        if not self.optional <= d.keys():
            d = {"left": self.hysteresis, "iteration": 0, "last_overflow": -1,
                 **{k: v for k, v in d.items() if k not in ("interval", "dynamic")}}
        super().load_state_dict(d)

"""Dynamic loss scaling for fp16 training."""

from __future__ import annotations

from typing import Any


class LossScale:
    """Dynamic loss scaling for fp16: halves the scale and skips the step when a gradient
    overflows, doubles it after ``interval`` good steps. ``state_dict`` holds all of its
    fields; ``optional``: those a state dict saved before they existed may lack."""

    optional: frozenset[str] = frozenset()

    def __init__(self, scale: float = 2.0**16, interval: int = 2000, dynamic: bool = True):
        self.scale, self.interval, self.dynamic = scale, interval, dynamic
        self.good = 0
        self.skipped = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.skipped += 1
            self.good = 0
            if self.dynamic:
                self.scale /= 2
        else:
            self.good += 1
            if self.dynamic and self.good % self.interval == 0:
                self.scale *= 2

    def state_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)

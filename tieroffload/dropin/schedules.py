"""DeepSpeed's learning-rate schedules (the ``scheduler`` section of its config), with its
formulas: ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle`` and ``LRRangeTest``.

As in DeepSpeed, a schedule is stepped once per optimizer step (after it, skipped steps not
counted), sets every param group's ``lr`` itself (the optimizer's own lr is only
``WarmupLR``'s default maximum and ``WarmupCosineLR``'s base) and is built at iteration -1: the
first step runs at the lr of iteration -1 (``warmup_min_lr`` for the warm-ups). Its state is
``{"last_batch_iteration": n}``, DeepSpeed's.
"""

from __future__ import annotations

import inspect
import logging
import math
from typing import Any

import torch

LOG, LINEAR = "log", "linear"
log = logging.getLogger("tieroffload")


def _per_group(opt: torch.optim.Optimizer, value: Any, name: str) -> list[Any]:
    """A value for every param group: one broadcast, or a list of one per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(opt.param_groups):
            raise ValueError(f"DeepSpeed scheduler.params.{name} has {len(value)} values for "
                             f"{len(opt.param_groups)} param groups: give one, or one per group")
        return list(value)
    return [value] * len(opt.param_groups)


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"DeepSpeed scheduler.params.{name} must be a whole number > 0, "
                         f"not {value!r}")
    return value


def _warmup_type(value: Any) -> str:
    if value not in (LOG, LINEAR):
        raise ValueError(f"DeepSpeed scheduler.params.warmup_type must be 'log' or 'linear', "
                         f"not {value!r}")
    return value


class Schedule:
    """A DeepSpeed schedule over ``optimizer``: ``step()`` after each optimizer step sets the
    groups' lr for the next one; ``get_lr()`` is the lr of ``last_batch_iteration``."""

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1) -> None:
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] | None = None

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def _apply(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = (self.last_batch_iteration + 1 if last_batch_iteration is None
                                     else last_batch_iteration)
        self._apply()

    def get_last_lr(self) -> list[float]:
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__}.get_last_lr before its first step()")
        return self._last_lr

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """The iteration only: the groups' lr (and betas) come back with the optimizer's."""
        self.last_batch_iteration = sd["last_batch_iteration"]
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]


class WarmupLR(Schedule):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` (default: the optimizer's lr) over
    ``warmup_num_steps`` (at least 2): ``min + (max - min) * g`` with ``g = log(i + 1) /
    log(n)`` (``log``) or ``i / n`` (``linear``), then ``max``."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: Any = 0.0,
                 warmup_max_lr: Any = None, warmup_num_steps: int = 1000,
                 warmup_type: str = LOG, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [g["lr"] for g in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, _positive_int(warmup_num_steps, "warmup_num_steps"))
        self.warmup_type = _warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        if last_batch_iteration == -1:
            self._apply()

    def _warmup(self) -> float:
        i = self.last_batch_iteration
        if self.warmup_type == LOG:
            return self.inverse_log_warm_up * math.log(i + 1)
        return i / self.warmup_num_steps

    def _gamma(self) -> float:
        return self._warmup() if self.last_batch_iteration < self.warmup_num_steps else 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """``WarmupLR``, then down in a straight line to 0 at ``total_num_steps``:
    ``g = max(0, (total - i) / max(1, total - warmup))``."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int,
                 warmup_min_lr: Any = 0.0, warmup_max_lr: Any = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = LOG,
                 last_batch_iteration: int = -1) -> None:
        self.total_num_steps = _positive_int(total_num_steps, "total_num_steps")
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _gamma(self) -> float:
        i = self.last_batch_iteration
        if i < self.warmup_num_steps:
            return self._warmup()
        return max(0.0, float(self.total_num_steps - i)
                   / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(WarmupLR):
    """The optimizer's lr times a ratio: from ``warmup_min_ratio`` to 1 over the warm-up, then a
    half cosine down to ``cos_min_ratio`` at ``total_num_steps``."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int,
                 warmup_min_ratio: float = 0.0, warmup_num_steps: int = 1000,
                 cos_min_ratio: float = 0.0001, warmup_type: str = LOG,
                 last_batch_iteration: int = -1) -> None:
        self.total_num_steps = _positive_int(total_num_steps, "total_num_steps")
        self.warmup_min_ratio, self.cos_min_ratio = warmup_min_ratio, cos_min_ratio
        self.org_lrs = [g["lr"] for g in optimizer.param_groups]
        super().__init__(optimizer, 0.0, self.org_lrs, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _ratio(self) -> float:
        i = self.last_batch_iteration
        if i < self.warmup_num_steps:
            return self.warmup_min_ratio + self._warmup() * (1.0 - self.warmup_min_ratio)
        done = i - self.warmup_num_steps + 1
        progress = min(1.0, done / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self._ratio()
        return [lr * ratio for lr in self.org_lrs]


class LRRangeTest(Schedule):
    """``lr_range_test_min_lr * (1 + step_rate * x)``, ``x = (i + 1) / step_size`` (floored
    with ``lr_range_test_staircase``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_range_test_min_lr: Any = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = _positive_int(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_rate, self.staircase = lr_range_test_step_rate, lr_range_test_staircase
        if last_batch_iteration == -1:
            self._apply()

    def get_lr(self) -> list[float]:
        x = float(self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            x = math.floor(x)
        return [lr * (1 + self.step_rate * x) for lr in self.min_lr]


class OneCycle(Schedule):
    """One cycle from ``cycle_min_lr`` up to ``cycle_max_lr`` over ``cycle_first_step_size``
    iterations and back over ``cycle_second_step_size`` (optionally in stairs), then
    ``cycle_min_lr / (1 + decay_lr_rate * k / decay_step_size)``. With ``cycle_momentum`` (and
    an optimizer with ``betas``) beta1 moves the other way between ``cycle_min_mom`` and
    ``cycle_max_mom``, beta2 set to 0.99, as DeepSpeed does."""

    def __init__(self, optimizer: torch.optim.Optimizer, cycle_min_lr: Any, cycle_max_lr: Any,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: int | None = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: int | None = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: Any = 0.8,
                 cycle_max_mom: Any = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_batch_iteration)
        first = float(_positive_int(cycle_first_step_size, "cycle_first_step_size"))
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if second < 0:
            raise ValueError(f"DeepSpeed scheduler.params.cycle_second_step_size must be >= 0, "
                             f"not {cycle_second_step_size!r}")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (cycle_first_stair_count if cycle_second_stair_count is None
                                   else cycle_second_stair_count)
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate, self.decay_mom_rate = decay_lr_rate, decay_mom_rate
        no_decay = math.isclose(decay_step_size, 0)
        self.skip_lr_decay = no_decay or math.isclose(decay_lr_rate, 0)
        self.skip_mom_decay = no_decay or math.isclose(decay_mom_rate, 0)
        self.cycle_momentum = bool(cycle_momentum) and "betas" in optimizer.defaults
        if cycle_momentum and not self.cycle_momentum:
            log.warning("DeepSpeed scheduler OneCycle: cycle_momentum is off, as %s has no "
                        "betas", type(optimizer).__name__)
        self.min_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_min_mom, "cycle_min_mom")]
        self.max_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_max_mom, "cycle_max_mom")]
        if last_batch_iteration == -1:
            for group, lr, mom in zip(optimizer.param_groups, self.min_lrs, self.min_moms):
                group["lr"] = lr
                if self.cycle_momentum:
                    group["betas"] = mom
            self._last_lr = list(self.min_lrs)

    def _scale(self) -> float:
        i = self.last_batch_iteration + 1
        cycle = math.floor(1 + i / self.total_size)
        x = 1.0 + i / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            at = i % self.total_size
            pos = (at * stairs / self.first_step_size if at <= self.first_step_size
                   else (self.total_size - at) * stairs / self.second_step_size)
            scale = math.floor(pos) / stairs
        return scale

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            s = self._scale()
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        k = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [lo / (1 + self.decay_lr_rate * k) for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]]:
        if self.last_batch_iteration < self.total_size:
            s = self._scale()
            return [(hi[0] - (hi[0] - lo[0]) * s, lo[1])
                    for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        k = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [(b0 * (1 + self.decay_mom_rate * k), b1) for b0, b1 in self.max_moms]

    def _apply(self) -> None:
        super()._apply()
        if self.cycle_momentum:
            for group, mom in zip(self.optimizer.param_groups, self.get_mom()):
                group["betas"] = mom


SCHEDULES: dict[str, type[Schedule]] = {
    c.__name__: c for c in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)}


def check_schedule(kind: Any, params: dict[str, Any]) -> type[Schedule]:
    """The schedule class of DeepSpeed's ``{"type": kind, "params": params}``, its parameter
    names checked (before anything is built)."""
    cls = SCHEDULES.get(kind)
    if cls is None:
        raise ValueError(f"DeepSpeed scheduler.type {kind!r} is not one of "
                         f"{', '.join(SCHEDULES)}: use one of those, or step a torch scheduler "
                         "of your own over the returned optimizer")
    try:
        inspect.signature(cls).bind(None, **params)
    except TypeError as e:  # a parameter the schedule has not, or a required one missing
        raise ValueError(f"DeepSpeed scheduler {kind}: {e}; it takes "
                         f"{', '.join(list(inspect.signature(cls).parameters)[1:])}") from None
    return cls


def make_schedule(optimizer: torch.optim.Optimizer, kind: Any, params: dict[str, Any]) -> Schedule:
    """DeepSpeed's ``{"type": kind, "params": params}`` over ``optimizer``."""
    return check_schedule(kind, params)(optimizer, **params)

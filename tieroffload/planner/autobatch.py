"""A micro-batch size that finds itself: ``AutoBatch`` runs each effective batch as micro-batches
with gradient accumulation, measures the peak memory of each step and grows the micro-batch
while the budget allows, shrinks it under pressure, and redoes a step that ran out of memory.
The effective batch never changes, so the loss curve does not either.
"""

from __future__ import annotations

import gc
import logging
import math
from typing import Any, Callable

import torch
from torch import nn

from ..compat.pytree import tree_flatten, tree_map
from ..hooks import registry
from ..hooks.steps import drop_stored_grads
from ..utils import memory
from ..utils.sizes import format_bytes, parse_bytes

log = logging.getLogger("tieroffload")

OOM_ERRORS = (torch.OutOfMemoryError, MemoryError)


def _is_oom(e: BaseException) -> bool:
    if isinstance(e, OOM_ERRORS):
        return True
    return isinstance(e, RuntimeError) and ("can't allocate memory" in str(e)
                                            or "out of memory" in str(e))


def default_budget(device: torch.device) -> int:
    """90% of the device's memory: the GPU's, or RAM (the cgroup's limit where lower)."""
    if device.type == "cuda":
        return int(0.9 * torch.cuda.get_device_properties(device).total_memory)
    return int(0.9 * memory.ram_limit())


class AutoBatch:
    """Runs ``fn`` over micro-batches of each batch of ``batch_size`` samples, with the largest
    micro-batch whose measured peak memory stays under ``budget``.

    ``fn(micro_batch)`` returns the mean loss of its micro-batch; ``backward`` weights each by
    its share of the batch, so the gradients and the returned loss are those of the whole batch.
    Memory is what budgets are checked against: on CUDA the peak allocated on the device, on the
    CPU the process's peak resident set. ``zero_grad`` (an optimizer's, by default the model's
    parameters' grads set to None) clears the gradients of a step that ran out of memory before
    it is redone.
    """

    def __init__(self, batch_size: int, budget: int | str | None = None, *, start: int = 1,
                 device: str | torch.device | None = None, model: nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, growth: float = 2.0) -> None:
        if batch_size < 1 or not 1 <= start:
            raise ValueError(f"batch_size and start must be >= 1, not {batch_size} and {start}")
        if growth <= 1:
            raise ValueError(f"growth must be > 1, not {growth}")
        self.batch_size = batch_size
        self.device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        self.budget = parse_bytes(budget) if budget is not None else default_budget(self.device)
        self.micro = min(start, batch_size)
        self.growth = growth
        self.model = model
        self.optimizer = optimizer
        self.ceiling = batch_size  # the smallest micro-batch that ran out of memory, less one
        self.steps = 0
        self.ooms = 0
        self.changes: list[dict[str, Any]] = []
        self._samples: dict[int, int] = {}  # micro-batch -> peak bytes above the step's start
        if self.device.type == "cpu":
            memory.return_freed_memory()  # else RSS, and the budget's view of it, only grows
        state = registry.find(model) if model is not None else None
        if state is not None:
            state.autobatch = self

    @property
    def accumulation(self) -> int:
        """Micro-batches per batch at the current size."""
        return math.ceil(self.batch_size / self.micro)

    # -- a step --------------------------------------------------------------------------------

    def backward(self, fn: Callable[[Any], torch.Tensor], batch: Any) -> torch.Tensor:
        """Forward and backward over ``batch`` (tensors with the batch first: one, or a tuple,
        list or dict of them) in micro-batches; returns the batch's loss (detached)."""
        n = self._batch_len(batch)
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        while True:
            base = memory.start_peak(self.device)
            if base is None:
                raise RuntimeError("AutoBatch needs /proc/self/clear_refs to measure peak memory")
            try:
                loss = self._run(fn, batch, n)
            except Exception as e:
                if not _is_oom(e):
                    raise
                self._out_of_memory(e)
                torch.set_rng_state(rng)
                if cuda_rng is not None:
                    torch.cuda.set_rng_state_all(cuda_rng)
                continue
            self._measured(memory.peak(self.device), base)
            self.steps += 1
            return loss

    def _batch_len(self, batch: Any) -> int:
        sizes = {t.shape[0] for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)}
        if len(sizes) != 1:
            raise ValueError(f"the batch's tensors must share their first dimension; got {sizes}")
        n = sizes.pop()
        if n != self.batch_size:
            raise ValueError(f"batch has {n} samples, AutoBatch was made for {self.batch_size}")
        return n

    def _run(self, fn: Callable[[Any], torch.Tensor], batch: Any, n: int) -> torch.Tensor:
        total = None
        m = self.micro
        if getattr(self.optimizer, "overlap", None) == "backward":  # steps in the last backward
            self.optimizer.accumulation_steps = math.ceil(n / m)
        for a in range(0, n, m):
            part = tree_map(lambda t, a=a: t[a:a + m] if isinstance(t, torch.Tensor) else t,
                            batch)
            share = (min(a + m, n) - a) / n
            loss = fn(part)
            (loss * share).backward()
            loss = loss.detach() * share
            total = loss if total is None else total + loss
        return total

    def _out_of_memory(self, e: BaseException) -> None:
        self.ooms += 1
        if self.micro == 1:
            raise MemoryError(f"a micro-batch of 1 sample runs out of memory under budget "
                              f"{self.budget} bytes ({format_bytes(self.budget)})") from e
        if getattr(self.optimizer, "stepped_in_backward", False):
            raise MemoryError(
                f"out of memory at a micro-batch of {self.micro} samples, after the optimizer "
                'had stepped part of the model during backward (overlap="backward"): a step '
                "half taken cannot be redone; give AutoBatch a smaller start or budget, or use "
                "overlap=True") from e
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
            params = [] if getattr(self.optimizer, "_tieroffload_paged", False) else [
                p for g in self.optimizer.param_groups for p in g["params"]]
        elif self.model is not None:
            params = list(self.model.parameters())
            for p in params:
                p.grad = None
        else:
            raise RuntimeError("AutoBatch met out-of-memory mid-step and cannot clear the "
                               "gradients: pass model= or optimizer=") from e
        drop_stored_grads(params)  # what the failed step left on NVMe (grads="nvme")
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.ceiling = self.micro - 1
        self._change(max(1, self.micro // 2), f"out of memory ({type(e).__name__}); step redone")

    def _measured(self, peak: int, base: int) -> None:
        m = self.micro
        self._samples[m] = max(peak - base, 1)
        fit = self._largest_fitting(base)
        if peak > self.budget and m == 1:  # nothing smaller to try: it would run over for ever
            raise MemoryError(
                f"AutoBatch: a micro-batch of 1 sample peaked at {peak} bytes "
                f"({format_bytes(peak)}), over the budget of {self.budget} bytes "
                f"({format_bytes(self.budget)}); raise the budget")
        if peak > self.budget:
            self.ceiling = min(self.ceiling, m - 1)
            self._change(max(1, min(fit, m - 1)),
                         f"peak {format_bytes(peak)} over budget {format_bytes(self.budget)}")
        elif fit > m and m < self.ceiling:
            self._change(min(fit, int(m * self.growth), self.ceiling),
                         f"peak {format_bytes(peak)} of budget {format_bytes(self.budget)}")

    def _largest_fitting(self, base: int) -> int:
        """The micro-batch whose predicted peak (linear in the micro-batch, fitted to the last
        two sizes measured) is the largest under the budget."""
        ms = sorted(self._samples)[-2:]
        if len(ms) == 2 and self._samples[ms[1]] > self._samples[ms[0]]:
            per = (self._samples[ms[1]] - self._samples[ms[0]]) / (ms[1] - ms[0])
            fixed = self._samples[ms[1]] - per * ms[1]
        else:
            per, fixed = self._samples[ms[-1]] / ms[-1], 0.0
        room = self.budget - base - max(fixed, 0.0)
        return max(1, min(self.batch_size, int(room // per)))

    def _change(self, new: int, why: str) -> None:
        if new == self.micro:
            return
        change = {"step": self.steps, "from": self.micro, "to": new, "why": why}
        log.info("autobatch: micro-batch %d -> %d at step %d: %s", self.micro, new,
                 self.steps, why)
        self.changes.append(change)
        self.micro = new

    def stats(self) -> dict[str, Any]:
        return {"micro_batch": self.micro, "accumulation": self.accumulation,
                "batch_size": self.batch_size, "budget": self.budget, "steps": self.steps,
                "ooms": self.ooms, "changes": list(self.changes)}

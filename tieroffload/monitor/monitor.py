"""``Monitor``: one record per training step, from windowed ``stats()`` and phase timings."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..compat.autograd import at_backward_end, graph_task, in_backward
from ..compat.pytree import tree_flatten
from ..core import timeline
from ..hooks import registry
from ..hooks.state import stats
from .record import PHASES, disk_figures, make_record
from .trace import StepTracer
from .writers import Writer


class Monitor:
    """Watches an offloaded ``model`` (and, optionally, its ``optimizer``) step by step.

    Call ``step(loss=..., lr=...)`` once per training step, after the optimizer's step: it
    reads ``stats(model, window=True, reset=True)``, makes the step's record (see
    ``monitor.record``), hands it to each writer and returns it. Forward and backward are
    timed by hooks on the root module and on its outputs' gradients, the optimizer's step by
    its step hooks; no torch function is patched. ``trace_steps``: steps (counted from
    ``start_step + 1``) whose Chrome trace is written to ``trace_dir/trace_step<k>.json``.
    ``disk``: the disk's measured GB/s, as ``(read, write)``, a ``planner.Machine`` or the
    JSON of ``tieroffload-bench nvme --json`` (default: the policy's ``machine`` if any).

    A window reset also resets the process's peak RSS (and CUDA's peak statistics), so each
    record's peaks are its step's; ``peak_rss`` keeps the run's."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 writers: Iterable[Writer] = (), trace_steps: Iterable[int] = (),
                 trace_dir: str | os.PathLike = ".", disk: Any = None,
                 start_step: int = 0) -> None:
        self.model = model
        state = registry.find(model)
        if state is None:
            raise ValueError("Monitor: the model is not offloaded; call "
                             "tieroffload.offload(model, policy) before Monitor(model)")
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise TypeError(f"Monitor: start_step must be a step count (an int >= 0), not "
                            f"{start_step!r:.40}")
        if not isinstance(writers, Iterable) or hasattr(writers, "write"):
            raise TypeError(f"Monitor: writers must be a list of writers, such as "
                            f"[CSVWriter('run.csv')], not {type(writers).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"Monitor: optimizer must be the torch.optim.Optimizer that steps "
                            f"the model, not {type(optimizer).__name__}")
        if disk is None:
            disk = getattr(state.policy, "machine", None)
        self.disk = disk_figures(disk)
        self.writers = list(writers)
        self.trace_steps = checked_steps(trace_steps, start_step)
        self.trace_dir = os.fspath(trace_dir)
        self.step_count = start_step
        self.last: dict[str, Any] | None = None
        self.peak_rss = 0  # the highest of the steps' peak RSS: the run's, since Monitor()
        self._phases = dict.fromkeys(PHASES, 0.0)
        self._fwd_t0: float | None = None
        self._fwd_depth = 0
        self._bwd: tuple[int, float] | None = None  # (graph task, start) of the backward
        self._opt_t0: float | None = None
        self._handles = [model.register_forward_pre_hook(self._forward_begins, prepend=True),
                         model.register_forward_hook(self._forward_ends, always_call=True)]
        self.optimizer = None
        if optimizer is not None:
            self.watch_optimizer(optimizer)
        self._tracer: StepTracer | None = None
        self.closed = False
        stats(model, window=True, reset=True)
        self._t0 = time.perf_counter()
        self._maybe_trace()

    @classmethod
    def from_deepspeed(cls, config: dict[str, Any] | str | os.PathLike, model: nn.Module,
                       optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> Monitor:
        """A monitor writing where a DeepSpeed config's ``tensorboard``, ``csv_monitor`` and
        ``wandb`` sections say (see ``monitor.config``)."""
        from .config import writers_from_deepspeed

        writers = writers_from_deepspeed(config) + list(kwargs.pop("writers", ()))
        return cls(model, optimizer, writers=writers, **kwargs)

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Times ``optimizer.step()`` from now on (its step pre- and post-hooks; those of the
        optimizer inside a wrapper such as accelerate's ``AcceleratedOptimizer``)."""
        while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
            optimizer = optimizer.optimizer
        own = {id(p) for p in self.model.parameters()}
        if not any(id(p) in own for g in optimizer.param_groups for p in g["params"]):
            raise ValueError("Monitor: the optimizer steps none of the monitored model's "
                             "parameters; pass the optimizer built over this model")
        self.optimizer = optimizer
        self._handles.append(optimizer.register_step_pre_hook(self._opt_begins))
        self._handles.append(optimizer.register_step_post_hook(self._opt_ends))

    # -- phase timing --------------------------------------------------------------------------

    def _span(self, name: str, start: float, end: float) -> None:
        tl = timeline.ACTIVE
        if tl is not None:
            tl.add(name, "phase", "step", start, end)

    def _forward_begins(self, module: nn.Module, args: Any) -> None:
        if self._fwd_depth == 0 and not in_backward():  # not a recomputation in backward
            self._fwd_t0 = time.perf_counter()
        self._fwd_depth += 1

    def _forward_ends(self, module: nn.Module, args: Any, output: Any) -> None:
        self._fwd_depth = max(0, self._fwd_depth - 1)
        if self._fwd_depth or self._fwd_t0 is None:
            return
        t0, self._fwd_t0 = self._fwd_t0, None
        t1 = time.perf_counter()
        self._phases["forward"] += t1 - t0
        self._span("forward", t0, t1)
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._backward_reaches_output)

    def _backward_reaches_output(self, grad: torch.Tensor) -> None:
        task = graph_task()
        if self._bwd is None or self._bwd[0] != task:
            self._bwd = (task, time.perf_counter())
            at_backward_end(self._backward_ends)

    def _backward_ends(self) -> None:
        if self._bwd is not None:
            t0, t1 = self._bwd[1], time.perf_counter()
            self._phases["backward"] += t1 - t0
            self._span("backward", t0, t1)
        self._bwd = None

    def _opt_begins(self, opt: Any, args: Any, kwargs: Any) -> None:
        self._opt_t0 = time.perf_counter()

    def _opt_ends(self, opt: Any, args: Any, kwargs: Any) -> None:
        if self._opt_t0 is not None:
            t0, t1 = self._opt_t0, time.perf_counter()
            self._phases["optimizer"] += t1 - t0
            self._span("optimizer step", t0, t1)
        self._opt_t0 = None

    # -- records -------------------------------------------------------------------------------

    def step(self, loss: Any = None, lr: float | None = None, grad_norm: Any = None,
             loss_scale: float | None = None, write: bool = True) -> dict[str, Any]:
        """Ends the step: makes its record, writes it (unless ``write`` is False: then
        ``write(record)`` later, once the caller has filled in what it learnt since) and
        returns it. ``loss`` and ``grad_norm`` may be tensors (read with ``float``); ``lr``
        defaults to the watched optimizer's first group's, ``loss_scale`` to a paged
        optimizer's dynamic scale."""
        now = time.perf_counter()
        if self.closed:
            raise RuntimeError("Monitor.step: the monitor is closed (monitor.close()); "
                               "make a new Monitor to go on recording")
        if registry.find(self.model) is None:
            raise RuntimeError("Monitor.step: the model was closed (tieroffload.close); "
                               "monitor.close() too, or offload it again with a new Monitor")
        opt = self.optimizer
        if lr is None and opt is not None and opt.param_groups:
            lr = opt.param_groups[0].get("lr")
        if loss_scale is None and getattr(opt, "scaler", None) is not None:
            loss_scale = opt.scaler.scale
        scalars = {k: _number(k, v) for k, v in (("loss", loss), ("lr", lr),
                                                  ("grad_norm", grad_norm),
                                                  ("loss_scale", loss_scale))}
        self.step_count += 1
        st = stats(self.model, window=True, reset=True)
        rec = make_record(self.step_count, st, self._phases, now - self._t0, self.disk, scalars)
        self._phases = dict.fromkeys(PHASES, 0.0)
        self.peak_rss = max(self.peak_rss, rec["peak_rss"])
        if self._tracer is not None:
            tracer, self._tracer = self._tracer, None
            tracer.finish(self.trace_path(self.step_count), self.step_count)
        if write:
            self.write(rec)
        self._maybe_trace()
        self._t0 = time.perf_counter()  # the writers' time is the monitor's, not the step's
        return rec

    def write(self, record: dict[str, Any]) -> None:
        """Hands ``record`` to every writer."""
        for w in self.writers:
            w.write(record)
        self.last = record

    def trace_path(self, step: int) -> str:
        return os.path.join(self.trace_dir, f"trace_step{step}.json")

    def _maybe_trace(self) -> None:
        if self.step_count + 1 in self.trace_steps:
            os.makedirs(self.trace_dir, exist_ok=True)
            self._tracer = StepTracer(self.model)

    def close(self) -> None:
        """Removes the hooks, stops a trace under way and closes the writers."""
        self.closed = True
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._tracer is not None:
            self._tracer.finish(self.trace_path(self.step_count + 1), self.step_count + 1)
            self._tracer = None
        for w in self.writers:
            w.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _number(name: str, value: Any) -> float | None:
    """``value`` (None, a number or a one-element tensor) as a float, or a one-line TypeError
    naming ``name``: raised before the step is counted."""
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"Monitor.step: {name} must be a number or a one-element tensor, not "
                        f"{value!r:.60}") from None


def checked_steps(steps: Iterable[int], start_step: int) -> set[int]:
    """``trace_steps`` checked: whole step numbers after ``start_step`` (each is recorded)."""
    if isinstance(steps, (str, bytes)) or not isinstance(steps, Iterable):
        raise TypeError(f"Monitor: trace_steps={steps!r} must be a list of step numbers, "
                        "such as trace_steps=[3]")
    out = set()
    for k in steps:
        if isinstance(k, bool) or not isinstance(k, int) or k <= start_step:
            raise ValueError(f"Monitor: trace_steps holds {k!r}; steps are counted from "
                             f"start_step + 1 = {start_step + 1}, so each must be an int from "
                             "there on")
        out.add(k)
    return out

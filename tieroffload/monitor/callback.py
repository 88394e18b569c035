"""``MonitorCallback``: a ``transformers.TrainerCallback`` that runs a ``Monitor`` over the
Trainer's model and optimizer, one record per optimizer step."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from transformers import TrainerCallback

from .monitor import Monitor, checked_steps
from .writers import Writer

_FROM_LOGS = {"loss": "loss", "learning_rate": "lr", "grad_norm": "grad_norm"}


class MonitorCallback(TrainerCallback):
    """``Trainer(..., callbacks=[MonitorCallback(writers=[CSVWriter("run.csv")])])``.

    The monitor starts at ``on_train_begin`` (its steps are the Trainer's ``global_step``)
    and makes each step's record at ``on_step_end``. The Trainer logs after that, every
    ``logging_steps``: a step's record waits for its logs (``loss``, averaged over the
    steps since the last log, ``learning_rate`` and ``grad_norm``) and is written at the next
    step's end, or at the end of training. ``lr`` otherwise is the optimizer's."""

    def __init__(self, writers: Iterable[Writer] = (), trace_steps: Iterable[int] = (),
                 trace_dir: str | os.PathLike = ".", disk: Any = None) -> None:
        self.kwargs = dict(writers=list(writers), trace_steps=sorted(checked_steps(trace_steps, 0)),
                           trace_dir=trace_dir, disk=disk)
        self.monitor: Monitor | None = None
        self.records: list[dict[str, Any]] = []  # every record written, in order
        self._pending: dict[str, Any] | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        self.monitor = Monitor(model, optimizer, start_step=state.global_step, **self.kwargs)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is None:
            return
        self._flush()
        self._pending = self.monitor.step(write=False)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None,
               **kwargs: Any) -> None:
        rec = self._pending
        if rec is None or not logs or rec["step"] != state.global_step:
            return
        for src, key in _FROM_LOGS.items():
            if logs.get(src) is not None:
                rec[key] = float(logs[src])
        self._flush()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._flush()
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None

    def _flush(self) -> None:
        if self._pending is not None:
            rec, self._pending = self._pending, None
            self.monitor.write(rec)
            self.records.append(rec)

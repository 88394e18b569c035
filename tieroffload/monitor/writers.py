"""Where records go: a CSV file, JSON lines, TensorBoard, Weights & Biases. A writer has
``write(record)`` and ``close()``; each writes every record as it comes (flushed, so that a
run killed mid-way keeps its steps)."""

from __future__ import annotations

import csv
import json
import math
import os
from typing import Any, Protocol

from .record import keys


class Writer(Protocol):
    """What the monitor asks of a writer: one record per step, then close."""

    def write(self, record: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class CSVWriter:
    """One row per step, the columns of ``record.keys()``; an unknown figure is an empty cell.
    Numbers are written as Python prints them, so that integers (bytes) read back exact."""

    def __init__(self, path: str | os.PathLike) -> None:
        self._f = open(path, "w", newline="")
        self._w = csv.DictWriter(self._f, fieldnames=keys())
        self._w.writeheader()

    def write(self, record: dict[str, Any]) -> None:
        self._w.writerow({k: "" if v is None else v for k, v in record.items()})
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class JSONLinesWriter:
    """One JSON object per line and step (unknown figures are ``null``)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self._f = open(path, "w")

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """The figures worth a chart, as ``group/key`` tags (the step is the x axis)."""
    groups = (("time", ("_s", "wait_share")), ("io", ("read_", "written_", "write_", "disk_")),
              ("prefetch", ("hits", "late", "misses")))
    out = {}
    for k, v in record.items():
        if v is None or k in ("step", "time") or (isinstance(v, float) and math.isnan(v)):
            continue
        group = next((g for g, marks in groups if any(m in k for m in marks)), None)
        if k in ("loss", "lr", "grad_norm", "loss_scale"):
            group = "train"
        elif group is None:
            group = "memory"
        out[f"{group}/{k}"] = v
    return out


class TensorBoardWriter:
    """Scalars under ``train/``, ``time/``, ``io/``, ``memory/`` and ``prefetch/`` at each step,
    through ``torch.utils.tensorboard`` (``pip install tieroffload[monitor]``). They are
    stored as float64 tensors (TensorBoard's "new style"), so byte counts read back exact."""

    def __init__(self, logdir: str | os.PathLike, **kwargs: Any) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("TensorBoardWriter needs the tensorboard package: pip install "
                              f"'tieroffload[monitor]' ({e})") from None
        self._w = SummaryWriter(os.fspath(logdir), **kwargs)

    def write(self, record: dict[str, Any]) -> None:
        for tag, v in _scalars(record).items():
            self._w.add_scalar(tag, v, record["step"], walltime=record["time"],
                               new_style=True, double_precision=True)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class WandbWriter:
    """Logs each record to Weights & Biases (``wandb``, where it imports) at its step: to
    ``run``, or to a run started with ``wandb.init(**init)``."""

    def __init__(self, run: Any = None, **init: Any) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ImportError(f"WandbWriter needs wandb: pip install wandb ({e})") from None
        self._own = run is None
        self._run = run if run is not None else wandb.init(**init)

    def write(self, record: dict[str, Any]) -> None:
        self._run.log(_scalars(record), step=record["step"])

    def close(self) -> None:
        if self._own:
            self._run.finish()

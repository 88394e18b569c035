"""Writers from a DeepSpeed config's monitor sections (``tensorboard``, ``csv_monitor``,
``wandb``), so that a config moved over keeps its logging: ``Monitor.from_deepspeed``."""

from __future__ import annotations

import os
from typing import Any

from ..integrations.deepspeed import load_config, settings
from .writers import CSVWriter, TensorBoardWriter, WandbWriter, Writer


def _section(config: dict[str, Any], key: str) -> dict[str, Any] | None:
    value = settings(config, key)
    return value if value.get("enabled", False) else None


def writers_from_deepspeed(config: dict[str, Any] | str | os.PathLike) -> list[Writer]:
    """One writer per enabled section: ``tensorboard`` (events in ``output_path/job_name``),
    ``csv_monitor`` (``output_path/job_name/run.csv``: one CSV of every figure, where
    DeepSpeed writes one per figure) and ``wandb`` (``project``, ``group``, ``team`` as
    the entity). DeepSpeed's defaults: ``output_path`` "", ``job_name`` "DeepSpeedJobName"."""
    config = load_config(config)
    writers: list[Writer] = []

    def folder(section: dict[str, Any]) -> str:
        path = os.path.join(section.get("output_path") or ".",
                            section.get("job_name") or "DeepSpeedJobName")
        os.makedirs(path, exist_ok=True)
        return path

    tb = _section(config, "tensorboard")
    if tb is not None:
        writers.append(TensorBoardWriter(folder(tb)))
    csv_monitor = _section(config, "csv_monitor")
    if csv_monitor is not None:
        writers.append(CSVWriter(os.path.join(folder(csv_monitor), "run.csv")))
    wandb = _section(config, "wandb")
    if wandb is not None:
        init = {k: wandb[v] for k, v in (("project", "project"), ("group", "group"),
                                         ("entity", "team")) if wandb.get(v)}
        writers.append(WandbWriter(**init))
    return writers

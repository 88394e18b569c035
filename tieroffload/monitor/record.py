"""One record per training step: a flat dict of numbers (None where a figure is unknown), the
same keys at every step, so that a CSV has one header and TensorBoard one tag per key.

Bytes are bytes, times seconds, rates GB/s (1e9 bytes per second). Keys:

- ``step``, ``time`` (Unix seconds at the step's end), ``wall_s`` (since the last record);
  ``forward_s``, ``backward_s``, ``optimizer_s`` (inside the model's forward, its backward and
  the optimizer's ``step``), ``other_s`` (the rest: data, loss, the user's code);
- ``wait_s`` and ``wait_<kind>_s``: time waited on I/O of each kind (parameters, gradients,
  optimizer state, activations), inside the phases above; ``wait_share``: ``wait_s / wall_s``;
- ``read_<tier>_<kind>`` and ``written_<tier>_<kind>`` bytes, ``read_<tier>`` and
  ``written_<tier>`` their sums; ``read_nvme_gbps`` and ``write_nvme_gbps`` over the step's
  wall time, ``disk_read_gbps`` and ``disk_write_gbps`` the disk's measured figures (if known);
- ``resident`` / ``peak_resident`` (parameter bytes on the compute device), ``pinned`` /
  ``peak_pinned``, ``rss`` / ``peak_rss``, ``mem_<part>`` (the RSS split of ``stats()``:
  each >= 0, summing to ``rss``), and with CUDA ``gpu_allocated``, ``gpu_reserved`` and
  their peaks; peaks are the step's;
- ``hits``, ``late``, ``misses`` (prefetches), and ``loss``, ``lr``, ``grad_norm``,
  ``loss_scale`` where given.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from ..core.stats import KINDS, TIERS

MEMORY_PARTS = ("params", "grads", "optimizer", "staging", "parked", "activations", "tensors",
                "heap_free", "files", "other")
GPU_KEYS = ("allocated", "reserved", "peak_allocated", "peak_reserved")
SCALARS = ("loss", "lr", "grad_norm", "loss_scale")
PHASES = ("forward", "backward", "optimizer")


def keys() -> list[str]:
    """Every key of a record, in the order a CSV has them."""
    out = ["step", "time", "wall_s", *(f"{p}_s" for p in PHASES), "other_s", "wait_s",
           *(f"wait_{k}_s" for k in KINDS), "wait_share"]
    for d in ("read", "written"):
        for t in TIERS:
            out += [f"{d}_{t}_{k}" for k in KINDS] + [f"{d}_{t}"]
    out += ["read_nvme_gbps", "write_nvme_gbps", "disk_read_gbps", "disk_write_gbps",
            "resident", "peak_resident", "pinned", "peak_pinned", "rss", "peak_rss",
            *(f"mem_{p}" for p in MEMORY_PARTS), *(f"gpu_{k}" for k in GPU_KEYS),
            "hits", "late", "misses", *SCALARS]
    return out


def disk_figures(disk: Any) -> tuple[float | None, float | None]:
    """(read, write) GB/s of the disk: from a ``(read, write)`` pair, a ``planner.Machine``,
    or the JSON (a path or its dict) that ``tieroffload-bench nvme --json`` writes."""
    if disk is None:
        return None, None
    if hasattr(disk, "read_gbps"):
        return float(disk.read_gbps), float(disk.write_gbps)
    if isinstance(disk, (str, os.PathLike)):
        with open(disk) as f:
            disk = json.load(f)
    if isinstance(disk, dict):
        try:
            fig = disk["recommended_figures"]
            return float(fig["read_gbps"]), float(fig["write_gbps"])
        except (KeyError, TypeError, ValueError):
            raise ValueError("Monitor(disk=...): a dict must be the JSON of tieroffload-bench "
                             "nvme --json, with recommended_figures.read_gbps and "
                             "write_gbps") from None
    read, write = disk
    return float(read), float(write)


def make_record(step: int, st: dict[str, Any], phases: dict[str, float], wall: float,
                disk: tuple[float | None, float | None],
                scalars: dict[str, float | None]) -> dict[str, Any]:
    """The record of one step from its window of ``stats(model, window=True)``."""
    rec: dict[str, Any] = dict.fromkeys(keys())
    rec.update(step=step, time=time.time(), wall_s=wall)
    for p in PHASES:
        rec[f"{p}_s"] = phases.get(p, 0.0)
    rec["other_s"] = max(0.0, wall - sum(phases.get(p, 0.0) for p in PHASES))
    io = st["io"]
    for k in KINDS:
        rec[f"wait_{k}_s"] = io["wait_s"][k]
    rec["wait_s"] = sum(io["wait_s"].values())
    rec["wait_share"] = rec["wait_s"] / wall if wall > 0 else 0.0
    for d in ("read", "written"):
        for t in TIERS:
            for k in KINDS:
                rec[f"{d}_{t}_{k}"] = io[d][t][k]
            rec[f"{d}_{t}"] = sum(io[d][t].values())
    if wall > 0:
        rec["read_nvme_gbps"] = rec["read_nvme"] / wall / 1e9
        rec["write_nvme_gbps"] = rec["written_nvme"] / wall / 1e9
    rec["disk_read_gbps"], rec["disk_write_gbps"] = disk
    for k in ("resident", "peak_resident", "pinned", "peak_pinned", "peak_rss", "hits",
              "late", "misses"):
        rec[k] = st[k]
    mem = st["memory"]
    rec["rss"] = mem["rss"]
    for p in MEMORY_PARTS:
        rec[f"mem_{p}"] = mem[p]
    for k in GPU_KEYS:
        rec[f"gpu_{k}"] = st["gpu"][k] if st.get("gpu") else None
    for k in SCALARS:
        v = scalars.get(k)
        rec[k] = None if v is None else float(v)
    return rec

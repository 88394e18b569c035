"""``stats(model, window=True)``: counters since the window began, and the peaks within it.

A window starts at ``offload`` and again at each ``stats(model, reset=True)``. Its counters are
the cumulative ones less those at its start; its peaks (``peak_resident``, ``peak_pinned``,
``peak_rss`` and CUDA's) are the highest figures since it began. Resetting the
window resets the process's peak RSS (Linux's clear_refs) and CUDA's peak statistics."""

from __future__ import annotations

import time
from typing import Any

import torch

from ..core.stats import KINDS, TIERS
from ..utils import memory

# The figures of stats() that only grow, and so have a value per window.
COUNTERS = ("bytes_read", "bytes_written", "read_by_kind", "written_by_kind", "wait_s",
            "wait_by_kind", "hits", "late", "misses", "evictions", "reorders", "wasted", "lent",
            "io")
ACTIVATION_COUNTERS = ("offloaded", "kept", "bytes_written", "bytes_read", "hits", "misses",
                       "wait_s")


def io_split(d: dict[str, Any], activation_tier: str | None) -> dict[str, Any]:
    """Bytes read and written per tier and kind, and seconds waited per kind, activations
    (counted by their own pager) included: ``sum(io["read"][tier].values())`` is
    ``bytes_read[tier]`` plus the activations' bytes read from that tier."""
    io = {"read": {t: dict(d["read_by_kind"][t]) for t in TIERS},
          "written": {t: dict(d["written_by_kind"][t]) for t in TIERS},
          "wait_s": {k: d["wait_by_kind"][k] for k in KINDS}}
    act = d.get("activations")
    if act is not None and activation_tier in TIERS:
        io["read"][activation_tier]["activations"] += act["bytes_read"]
        io["written"][activation_tier]["activations"] += act["bytes_written"]
        io["wait_s"]["activations"] += act["wait_s"]
    return io


def gpu_memory(device: torch.device) -> dict[str, int] | None:
    """CUDA's allocated and reserved bytes now and at their peaks (since the last reset)."""
    if device.type != "cuda":
        return None
    return {"allocated": torch.cuda.memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device),
            "peak_allocated": torch.cuda.max_memory_allocated(device),
            "peak_reserved": torch.cuda.max_memory_reserved(device)}


def _minus(now: Any, then: Any) -> Any:
    if isinstance(now, dict):
        return {k: _minus(v, then.get(k, 0) if isinstance(then, dict) else 0)
                for k, v in now.items()}
    return now - then


def _counters(d: dict[str, Any]) -> dict[str, Any]:
    out = {k: d[k] for k in COUNTERS}
    if "activations" in d:
        out["activations"] = {k: d["activations"][k] for k in ACTIVATION_COUNTERS}
    out["adaptations"] = len(d["adaptations"])
    return out


class Window:
    """The start of the current window: the counters then, and when."""

    def __init__(self) -> None:
        self.mark: dict[str, Any] = {}
        self.began = time.perf_counter()

    def view(self, d: dict[str, Any], stats: Any) -> dict[str, Any]:
        """``d`` (a full stats() dict) with its counters and peaks made the window's."""
        out = dict(d)
        now = _counters(d)
        for k in COUNTERS:
            out[k] = _minus(now[k], self.mark.get(k, 0))
        if "activations" in d:
            out["activations"] = dict(d["activations"])
            out["activations"].update(_minus(now["activations"],
                                             self.mark.get("activations", {})))
        out["adaptations"] = d["adaptations"][self.mark.get("adaptations", 0):]
        out["peak_resident"] = stats.window_peak_resident
        out["peak_pinned"] = stats.window_peak_pinned
        out["window_s"] = time.perf_counter() - self.began
        return out

    def reset(self, d: dict[str, Any], stats: Any, device: torch.device) -> None:
        """Starts a new window after ``d``, the full stats() dict read last."""
        self.mark = _counters(d)
        self.began = time.perf_counter()
        stats.start_window()
        memory.reset_peak_rss()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

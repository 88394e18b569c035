"""Streaming throughput of the engine over one directory or several striped, as the swap space
stripes them: what the planner measures a disk with, and the bench's aggregate rows."""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any

import torch

from ..utils.memory import drop_page_cache
from ..utils.paths import directories as _directories
from . import swap
from .buffers import aligned_empty
from .config import IOConfig
from .files import StripedFile
from .private import ScratchFile

MiB = 1 << 20
# Requests of this size, from buffers reused in turn, enough in flight that the engine's own
# queue depth, not the feeding, limits concurrency.
CHUNK = 64 * MiB
AGG_INFLIGHT = 4  # buffers in flight per process, each its own (as the swap space's staging)


def bench_paths(directories: list[str], tag: str, rank: int) -> list[str]:
    return [os.path.join(d, f".tieroffload-bench-{tag}-rank{rank}.tmp") for d in directories]


def stream(f: Any, bufs: list[torch.Tensor], size: int, write: bool) -> tuple[float, float, int]:
    """``size`` bytes through ``f`` in requests of one buffer each, ``len(bufs)`` in flight:
    (start, end, bytes), on the monotonic clock that every process of the machine shares.
    Writes end once synced."""
    op = f.pwrite if write else f.pread
    inflight: collections.deque[Any] = collections.deque()
    offset = moved = k = 0
    start = time.monotonic()
    while offset < size or inflight:
        while offset < size and len(inflight) < len(bufs):
            n = min(bufs[0].numel(), size - offset)
            inflight.append(op(bufs[k % len(bufs)], offset, n))
            offset, k = offset + n, k + 1
        moved += inflight.popleft().result()
    if write:
        f.sync()
    return start, time.monotonic(), moved


def run_files(rank: int, barrier: Any, task: dict[str, Any]) -> dict[str, Any]:
    """One process's part of an aggregate measurement: its own engine and files (striped when
    there are several directories, as ``SwapSpace`` does), filled once unmeasured (first writes
    convert extents), then a timed write and, after the page cache is dropped, a timed read, both
    started together with the other processes. The files are made through each directory's
    checked descriptor, as swap files are, and removed whatever happens."""
    directories, size = task["dirs"], task["size"]
    paths = bench_paths(directories, task["tag"], rank)
    files: list = []
    eng = IOConfig.from_dict(task["io"]).engine()
    try:
        for d, path, direct in zip(directories, paths, task["direct"]):
            files.append(ScratchFile.create(d, os.path.basename(path), eng, direct))
        f = files[0] if len(files) == 1 else StripedFile(files, swap.STRIPE)
        f.allocate(size)
        # Not pinned: pinning does not change disk I/O and would start CUDA in every process.
        bufs = [aligned_empty(min(CHUNK, size), pin=False) for _ in range(AGG_INFLIGHT)]
        bufs[0].copy_(torch.randint(0, 256, (bufs[0].numel(),), dtype=torch.uint8))
        for b in bufs[1:]:
            b.copy_(bufs[0])
        stream(f, bufs, size, write=True)
        barrier.wait()
        write = stream(f, bufs, size, write=True)
        barrier.wait()
        cold = drop_page_cache() if rank == 0 else None
        barrier.wait()
        read = stream(f, bufs, size, write=False)
        return {"write": write, "read": read, "cold": cold}
    finally:
        for fi in files:
            fi.close()  # removes it
        eng.close()


def disk_gbps(directories: str | list[str], size: int = 256 * MiB,
              io: IOConfig | None = None) -> tuple[float, float]:
    """(read, write) GB/s of one process through ``directories`` (striped as the swap space
    stripes them), measured as the aggregate rows are: writes on a second pass up to the fsync,
    reads cold where the page cache can be dropped."""
    dirs = _directories(directories)
    task = {"dirs": dirs, "direct": [True] * len(dirs), "size": size,
            "io": (io or IOConfig()).to_dict(), "tag": str(os.getpid())}
    out = run_files(0, threading.Barrier(1), task)
    (rs, re_, rb), (ws, we, wb) = out["read"], out["write"]
    return rb / (re_ - rs) / 1e9, wb / (we - ws) / 1e9

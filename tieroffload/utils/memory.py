"""This process's resident memory (what budgets are checked against) and the page cache."""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Iterable
from typing import Any

import psutil
import torch


def _status() -> dict[str, int]:
    try:
        with open("/proc/self/status") as f:
            pairs = (line.split(":", 1) for line in f)
            return {k: int(v.split()[0]) * 1024 for k, v in pairs if k in ("VmRSS", "VmHWM")}
    except OSError:  # not Linux: no peak, the current figure stands in
        rss = psutil.Process().memory_info().rss
        return {"VmRSS": rss, "VmHWM": rss}


def rss() -> int:
    """Resident set size now, in bytes."""
    return _status()["VmRSS"]


def peak_rss() -> int:
    """The highest resident set size since start or since ``reset_peak_rss()``."""
    return _status()["VmHWM"]


def _proc_write(path: str, value: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(value)
        return True
    except OSError:
        return False


def reset_peak_rss() -> bool:
    """Starts a new peak from now (Linux's clear_refs); False where that is not allowed."""
    return _proc_write("/proc/self/clear_refs", "5")


def drop_page_cache() -> bool:
    """Syncs and drops the page cache so that reads are cold; False where not permitted."""
    os.sync()
    return _proc_write("/proc/sys/vm/drop_caches", "3\n")


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
_MMAP_CEILING = 32 << 20  # glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)
_MMAP_MAX = 65536  # glibc's default number of mmapped blocks
_reuse: int | None = None  # the heap block size set so far; the smallest asked for stands


def return_freed_memory(reuse: int = 0) -> None:
    """glibc keeps freed large blocks in its heap once its mmap threshold has grown, so that
    RSS only grows; fixing the threshold makes every block of ``reuse`` bytes or more an mmap,
    which freeing really returns. Smaller blocks come from the heap, which keeps at most
    ``2 * reuse`` free at its top: temporaries of that size are reused without page faults
    (with every torch temporary a fresh mapping, a training step of a GPT on 2 cores spent a
    fifth of its time faulting in and zeroing pages). glibc's threshold goes no higher than
    32 MiB: above it no block is mapped and the heap is never trimmed, so that it keeps what
    it has held (the most temporaries the process had alive at once, such as a step's
    gradients) for the next allocations. Any lower trim threshold hands the freed gradients
    back when they happen to lie at the heap's top, and the next step faults them all in
    again (3 GiB of them took longer than the backward that made them). The setting is the
    process's: the smallest ``reuse`` asked for stands, 256 KiB at least (glibc's default);
    lowering it to 32 MiB or less hands back what the heap holds."""
    global _reuse
    asked = max(reuse, 256 << 10)
    was, _reuse = _reuse, asked if _reuse is None else min(_reuse, asked)
    if _reuse > _MMAP_CEILING:
        _libc("mallopt", _M_MMAP_MAX, 0)
        _libc("mallopt", _M_TRIM_THRESHOLD, -1)  # never
    else:
        _libc("mallopt", _M_MMAP_MAX, _MMAP_MAX)
        _libc("mallopt", _M_MMAP_THRESHOLD, _reuse)
        _libc("mallopt", _M_TRIM_THRESHOLD, 2 * _reuse)
    if was is not None and was > _MMAP_CEILING >= _reuse:
        trim_heap()


def heap_reuse(budget: int) -> int:
    """The heap block size for a CPU budget: an eighth of it, so that the free top the heap
    keeps is at most a quarter of the budget (above 256 MiB, all it has held)."""
    return budget // 8


def ram_limit() -> int:
    """Bytes of RAM this process may use: the machine's, or its cgroup's limit where lower."""
    total = psutil.virtual_memory().total
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            v = f.read().strip()
        return total if v == "max" else min(total, int(v))
    except (OSError, ValueError):
        return total


def start_peak(device: torch.device) -> int | None:
    """Starts a new peak of the memory budgets are checked against on ``device`` (allocated on
    CUDA, the process's RSS on the CPU) and returns what is in use now; None where the peak
    cannot be reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    trim_heap()  # else memory freed earlier but kept by glibc hides new use from RSS
    return rss() if reset_peak_rss() else None


def trim_heap() -> None:
    """Hands the free memory glibc keeps in its heaps back to the OS (malloc_trim)."""
    _libc("malloc_trim", 0)


@functools.cache
def _libc_fn(name: str) -> Any:
    """glibc's function ``name``, looked up once (each ``CDLL`` made anew builds ctypes classes:
    a per-step monitor did so several times a step), or None where there is none."""
    try:
        return getattr(ctypes.CDLL("libc.so.6", use_errno=True), name)
    except (OSError, AttributeError):
        return None


def _libc(name: str, *args: int) -> None:
    """Calls a glibc function where there is one (elsewhere, nothing)."""
    f = _libc_fn(name)
    if f is not None:
        f(*args)


PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes(ranges: Iterable[tuple[int, int]]) -> int:
    """Bytes of the page-aligned mapped ranges ``(address, nbytes)`` that are in RAM now
    (mincore); 0 for a range that is not mapped (or where mincore is missing)."""
    mincore = _libc_fn("mincore")
    if mincore is None:
        return 0
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    total = 0
    for addr, nbytes in ranges:
        pages = -(-nbytes // PAGE)
        if addr % PAGE or pages == 0:
            continue
        vec = ctypes.create_string_buffer(pages)
        if mincore(addr, nbytes, vec) == 0:
            total += (pages - vec.raw.count(0)) * PAGE
    return total


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2``."""

    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def heap() -> tuple[int, int]:
    """(bytes malloc has handed out and not had back, bytes freed that it keeps for reuse):
    glibc's mallinfo2; (0, 0) without it."""
    f = _libc_fn("mallinfo2")
    if f is None:
        return 0, 0
    f.restype = _MallInfo2
    m = f()
    return m.uordblks + m.hblkhd, m.fordblks


def rss_parts() -> dict[str, int]:
    """The resident set split as Linux counts it, from one reading: ``rss`` = ``anon``
    (anonymous memory) + ``files`` (mapped files: code, shared memory included), exactly;
    where /proc is missing, ``rss`` is psutil's and all of it ``anon``."""
    keys = ("RssAnon", "RssFile", "RssShmem")
    try:
        with open("/proc/self/status") as f:
            pairs = (line.split(":", 1) for line in f)
            got = {k: int(v.split()[0]) * 1024 for k, v in pairs if k in keys}
    except OSError:
        got = {}
    if len(got) < len(keys):
        total = psutil.Process().memory_info().rss
        return {"rss": total, "anon": total, "files": 0}
    anon, files = got["RssAnon"], got["RssFile"] + got["RssShmem"]
    return {"rss": anon + files, "anon": anon, "files": files}


def peak(device: torch.device) -> int:
    """The peak since ``start_peak(device)``."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return peak_rss()

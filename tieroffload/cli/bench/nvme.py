"""``tieroffload-bench nvme``: how fast is the disk, how fast is tieroffload on it, what to set.

One run measures, side by side and interleaved (so that a noisy disk drifts under every engine
alike), fio with io_uring as the device's reference, tieroffload's engine with each of its
backends, a plain Python ``readinto``/``write`` loop, ``aiofiles`` and, where it loads, DeepSpeed's
``aio_handle``: sequential O_DIRECT reads and writes of one preallocated scratch file, over block
sizes and queue depths. Reads are cold: the page cache is dropped before each one where that is
allowed. Figures are medians of the repeats, in GB/s (1e9 bytes per second).

Given several directories (``--dir`` repeated, one per drive) or ``--procs N``, an aggregate
measurement follows at the recommended setting: each process streams its own file, striped over
the directories as the swap space stripes (``aio.StripedFile``, ``swap.STRIPE``), in 64 MiB
requests, and the table gives per-process and total GB/s for one directory and all of them, with
one process and with N.

``run_nvme`` returns the same dict that ``--json`` writes; its ``recommended`` block is what
``IOConfig.from_dict`` / ``IOConfig.from_json`` load.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

import torch
from tqdm import tqdm

from ... import __version__, aio
from ...aio.throughput import CHUNK
from ...utils.memory import drop_page_cache
from ...utils.paths import directories
from ...utils.sizes import parse_bytes
from . import common
from .aggregate import aggregate_rows
from .common import (
    BLOCK_SIZES,
    DEFAULT_SIZE,
    MIN_SIZE,
    QUEUE_DEPTHS,
    QUICK_BLOCK_SIZES,
    QUICK_QUEUE_DEPTHS,
    QUICK_SIZE,
    QUICK_TIME_CAP,
    TIME_CAP,
    BenchError,
    FioFailed,
    MiB,
    check_dir,
    check_space,
    device_notes,
    format_size,
    stopping,
)
from .contenders import Point, Scratch, contenders_for, fill
from .report import recommend, summarise


def run_nvme(directory: str | os.PathLike | list[str | os.PathLike] | tuple[str | os.PathLike, ...],
             size: int | str | None = None, *, quick: bool = False, repeats: int | None = None,
             progress: bool = True, procs: int = 1) -> dict[str, Any]:
    """Runs the sweep in ``directory`` and returns every measurement, a summary of medians, the
    ``recommended`` I/O settings and notes. ``size``: bytes or a string like "1G" (default 1G,
    256M with ``quick``), rounded down to a whole MiB. ``quick``: 1M blocks at queue depth 8 and
    32, one repeat, half-second caps. Raises ``BenchError`` on bad input, before writing.

    ``directory`` may be a list, one directory per drive: the sweep runs in the first. Then, when
    there are several directories or ``procs`` > 1, the ``aggregate`` rows measure the
    recommended setting over the first directory alone and over all of them striped, with one
    process and with ``procs`` processes at once (``size`` bytes each, so the first directory
    needs room for ``procs`` x ``size``): ``{"dirs", "procs", "direction", "per_proc_gbps",
    "total_gbps"}``, the total being all bytes over the time from the common start to the last
    finish. Writes are timed on a second pass over the files (as the sweep's, past the extent
    conversion of first writes) up to their fsync; reads are cold where allowed. With one
    directory and one process ``aggregate`` is an empty list: it would repeat the sweep's
    recommended figures."""
    try:
        dirs = directories(directory or None, "--dir")
    except ValueError as e:
        raise BenchError(str(e)) from None
    if not dirs:
        raise BenchError("--dir is needed")
    if size is None:
        size = QUICK_SIZE if quick else DEFAULT_SIZE
    elif isinstance(size, str):
        try:
            size = parse_bytes(size)
        except ValueError as e:
            raise BenchError(f"--size {e}") from None
    if size < MIN_SIZE:
        raise BenchError(f"--size must be at least {format_size(MIN_SIZE)}, not {size} bytes")
    size = size // MiB * MiB
    repeats = repeats if repeats is not None else 1 if quick else 3
    if repeats < 1:
        raise BenchError(f"--repeats must be at least 1, not {repeats}")
    if procs < 1:
        raise BenchError(f"--procs must be at least 1, not {procs}")
    block_sizes = QUICK_BLOCK_SIZES if quick else BLOCK_SIZES
    depths = QUICK_QUEUE_DEPTHS if quick else QUEUE_DEPTHS
    cap_s = QUICK_TIME_CAP if quick else TIME_CAP
    seen: dict[tuple[int, int], str] = {}
    for d in dirs:
        check_dir(d)
        st = os.stat(d)
        if (st.st_dev, st.st_ino) in seen:  # another path to it (a bind mount)
            raise BenchError(f"--dir {d}: the same directory as --dir "
                             f"{seen[st.st_dev, st.st_ino]}")
        seen[st.st_dev, st.st_ino] = d
    aggregate = len(dirs) > 1 or procs > 1
    directory = dirs[0]

    notes: list[str] = []
    scratch = Scratch(directory, size)
    bar = None
    try:
        direct = [scratch.direct]
        for d in dirs[1:]:  # writable, and takes O_DIRECT? Before anything is written.
            probe = Scratch(d, 0)
            probe.remove()
            direct.append(probe.direct)
        check_space(dirs, size, procs, aggregate)
        if not scratch.direct:
            notes.append(f"{directory} refuses O_DIRECT: every engine ran buffered, so the "
                         "figures include the page cache")
        buf = aio.aligned_empty(min(CHUNK, size))
        buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8))
        contenders = contenders_for(scratch, buf, block_sizes, cap_s, notes)
        engines = [c.name for c in contenders]

        points = sorted({Point(d, bs, qd) for d in ("read", "write") for bs in block_sizes
                         for qd in (*depths, 1)},
                        key=lambda p: (p.direction, p.block_size, p.queue_depth))
        plan = [(p, [c for c in contenders if (c.sweeps and (p.queue_depth in depths
                                                             or c.name == common.FIO))
                     or (not c.sweeps and p.queue_depth == 1)])
                for p in points]
        cold = True
        dropped: set[str] = set()
        runs: list[dict[str, Any]] = []
        bar = tqdm(total=1 + repeats * sum(len(cs) for _, cs in plan), unit="run",
                   disable=not progress, file=sys.stderr, desc="nvme bench")
        bar.set_postfix_str(f"writing the {format_size(size)} scratch file")
        fill(scratch, buf)
        bar.update()
        for rep in range(repeats):
            for p, cs in plan:
                # Rotating the order keeps any engine from always running first after a drop.
                k = rep % len(cs)
                for c in cs[k:] + cs[:k]:
                    if c.name not in dropped:
                        bar.set_postfix_str(f"{c.name} {p.direction} "
                                            f"{format_size(p.block_size)} qd{p.queue_depth}")
                        if p.direction == "read":
                            cold = drop_page_cache() and cold
                        if stopping.is_set():  # an interrupt whose exception was lost
                            raise KeyboardInterrupt
                        try:
                            moved, secs = c.measure(p)
                            runs.append({"engine": c.name, "direction": p.direction,
                                         "block_size": p.block_size,
                                         "queue_depth": p.queue_depth, "repeat": rep,
                                         "bytes": moved, "seconds": secs,
                                         "gbps": moved / secs / 1e9})
                        except FioFailed as e:
                            notes.append(f"{e}: fio left out of the comparison")
                            dropped.add(c.name)
                    bar.update()
    finally:
        if bar is not None:
            bar.close()
        scratch.remove()
    del buf, contenders  # the sweep's buffers (DeepSpeed's up to 1 GiB) are not needed now
    summary = summarise(runs)
    recommended, figures = recommend(summary)
    agg_rows: list[dict[str, Any]] = []
    if aggregate:
        agg_rows, agg_cold = aggregate_rows(dirs, direct, size, procs, recommended, progress)
        cold = cold and agg_cold
        notes.extend(f"{d} refuses O_DIRECT: the aggregate ran buffered there"
                     for d, ok in zip(dirs[1:], direct[1:]) if not ok)
        notes.extend(device_notes(dirs))
        if procs > 1:
            notes.append(f"the {procs} processes share the drives: processes sharing a drive "
                         "divide its bandwidth, so their per-process GB/s add up to at most the "
                         "drive's, and the total is what the drives give all of them")
    if not cold:
        notes.append("cannot drop the page cache (needs root): reads may be warm")
    return {
        "tool": "tieroffload-bench nvme",
        "version": __version__,
        "dir": os.path.abspath(directory),
        "dirs": [os.path.abspath(d) for d in dirs],
        "size": size,
        "quick": quick,
        "repeats": repeats,
        "procs": procs,
        "time_cap_s": cap_s,
        "direct": scratch.direct,
        "cold_reads": cold,
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release()},
        "units": "GB/s = 1e9 bytes per second",
        "notes": notes,
        "engines": engines,
        "runs": runs,
        "summary": summary,
        "recommended": recommended,
        "recommended_figures": figures,
        "aggregate": agg_rows,
    }

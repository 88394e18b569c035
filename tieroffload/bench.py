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

import argparse
import asyncio
import collections
import concurrent.futures
import errno
import importlib.util
import json
import multiprocessing
import os
import platform
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import aiofiles
import torch
from tqdm import tqdm

from . import __version__, aio, swap
from .memory import drop_page_cache
from .policy import IOConfig
from .sizes import parse_bytes

__all__ = ["BenchError", "format_table", "main", "plot", "run_nvme"]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
BLOCK_SIZES = (128 * KiB, MiB, 8 * MiB)
QUEUE_DEPTHS = (1, 8, 32, 128)
QUICK_BLOCK_SIZES = (MiB,)
QUICK_QUEUE_DEPTHS = (8, 32)
DEFAULT_SIZE = GiB
QUICK_SIZE = 256 * MiB
MIN_SIZE = 8 * MiB
# Seconds one measurement may take before it stops submitting: bounds the slow points
# (queue depth 1, small blocks) so that a full sweep stays within minutes.
TIME_CAP = 1.0
QUICK_TIME_CAP = 0.5
# The engine is fed requests of this size from one reused buffer, enough of them in flight that
# its own queue depth, not the feeding, limits concurrency.
CHUNK = 64 * MiB
# DeepSpeed's aio_handle reads or writes a whole tensor from file offset 0, so its figure covers
# at most this many bytes.
DEEPSPEED_MAX = GiB
# Configurations within this fraction of the best are taken as equal: the smaller one is advised.
WITHIN = 0.03
# The aggregate measurement: requests of CHUNK bytes, this many in flight per process, each from
# its own aligned buffer (as the swap space's staging is fed).
AGG_INFLIGHT = 4
FIO = "fio"
ENGINE_PREFIX = "tieroffload/"


class BenchError(ValueError):
    """Bad input, told in one line (the CLI prints it and exits with code 2)."""


class _FioFailed(RuntimeError):
    """fio ran but failed (e.g. a build without io_uring): the run goes on without it."""


def format_size(n: int) -> str:
    """128K, 1M, 8M, 1G: the short binary form fio and the table use."""
    for unit, scale in (("P", 1 << 50), ("T", 1 << 40), ("G", GiB), ("M", MiB), ("K", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n / MiB:.1f}M" if n >= MiB else str(n)


@dataclass(frozen=True)
class _Point:
    direction: str
    block_size: int
    queue_depth: int


@dataclass
class _Contender:
    """One engine in the comparison: ``measure(point)`` returns (bytes moved, seconds)."""

    name: str
    sweeps: bool  # over every queue depth; else at queue depth 1 only (a serial loop)
    measure: Callable[[_Point], tuple[int, float]]


class _Scratch:
    """The scratch file and what it allows: created here so that an unwritable directory fails
    before anything is measured, removed by ``remove`` whatever happened."""

    def __init__(self, directory: str, size: int) -> None:
        self.path = os.path.join(directory, f".tieroffload-bench-{os.getpid()}.tmp")
        try:
            os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except OSError as e:
            raise BenchError(f"--dir {directory}: not writable ({e.strerror})") from None
        self.direct = True
        try:
            os.close(os.open(self.path, os.O_RDONLY | os.O_DIRECT))
        except OSError as e:
            if e.errno != errno.EINVAL:
                self.remove()
                raise
            self.direct = False
        self.size = size

    def opener(self) -> Callable[[str, int], int]:
        """``open(..., opener=)`` that adds O_DIRECT when the file system takes it."""
        extra = os.O_DIRECT if self.direct else 0
        return lambda path, flags: os.open(path, flags | extra)

    def remove(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _measure_engine(scratch: _Scratch, backend: str, buf: torch.Tensor, cap_s: float,
                    p: _Point) -> tuple[int, float]:
    """tieroffload at (block size, queue depth): the file in CHUNK requests, enough in flight
    that the engine's queue depth is the limit; timed from the first submit to the last
    completion, as fio times its jobs."""
    write = p.direction == "write"
    window = -(-p.queue_depth * p.block_size // buf.numel()) + 1
    threads = p.queue_depth if backend == "threads" else None
    with aio.Engine(backend, p.queue_depth, p.block_size, threads) as eng, \
            aio.open(scratch.path, "r+" if write else "r", eng, direct=scratch.direct) as f:
        op = f.pwrite if write else f.pread
        inflight: collections.deque[aio.Future] = collections.deque()
        end, offset, moved = scratch.size, 0, 0
        start = time.perf_counter()
        while True:
            while offset < end and len(inflight) < window:
                n = min(buf.numel(), end - offset)
                inflight.append(op(buf, offset, n))
                offset += n
            if not inflight:
                break
            moved += inflight.popleft().result()
            if time.perf_counter() - start > cap_s:
                end = offset
        return moved, time.perf_counter() - start


def _measure_fio(scratch: _Scratch, cap_s: float, p: _Point) -> tuple[int, float]:
    """fio with io_uring on the same file, block size and queue depth; its own timing."""
    cmd = [FIO, "--name=tieroffload-bench", f"--filename={scratch.path}", f"--rw={p.direction}",
           f"--bs={p.block_size}", f"--iodepth={p.queue_depth}", "--ioengine=io_uring",
           f"--direct={int(scratch.direct)}", f"--size={scratch.size}", "--allow_file_create=0",
           f"--runtime={max(1, int(cap_s * 1000))}ms", "--output-format=json"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        why = (out.stderr.strip() or out.stdout.strip() or f"exit code {out.returncode}")
        raise _FioFailed(f"fio failed: {why.splitlines()[-1]}")
    job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0][p.direction]
    # fio reports whole milliseconds: a run shorter than one is floored to one.
    return job["io_bytes"], max(job["runtime"], 1) / 1000


def _measure_python(scratch: _Scratch, buf: torch.Tensor, cap_s: float,
                    p: _Point) -> tuple[int, float]:
    """A plain loop of ``readinto``/``write`` calls, one block at a time."""
    write = p.direction == "write"
    view = memoryview(buf.numpy())
    moved = 0
    with open(scratch.path, "r+b" if write else "rb", buffering=0,
              opener=scratch.opener()) as f:
        start = time.perf_counter()
        while moved < scratch.size and time.perf_counter() - start <= cap_s:
            chunk = view[:min(p.block_size, scratch.size - moved)]
            moved += f.write(chunk) if write else f.readinto(chunk)
        return moved, time.perf_counter() - start


def _measure_aiofiles(scratch: _Scratch, buf: torch.Tensor, cap_s: float,
                      p: _Point) -> tuple[int, float]:
    """The same loop through ``aiofiles``, as asyncio code would write it."""
    write = p.direction == "write"
    view = memoryview(buf.numpy())

    async def loop() -> tuple[int, float]:
        moved = 0
        async with aiofiles.open(scratch.path, "r+b" if write else "rb", buffering=0,
                                 opener=scratch.opener()) as f:
            start = time.perf_counter()
            while moved < scratch.size and time.perf_counter() - start <= cap_s:
                chunk = view[:min(p.block_size, scratch.size - moved)]
                moved += await (f.write(chunk) if write else f.readinto(chunk))
            return moved, time.perf_counter() - start

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(loop())
    # Called from code that runs an event loop already (a notebook): a loop of its own, in a
    # thread of its own.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, loop()).result()


def _deepspeed_aio() -> tuple[Any, str]:
    """DeepSpeed's loaded async_io op, or None and why not."""
    if importlib.util.find_spec("deepspeed") is None:
        return None, "deepspeed is not installed: no DeepSpeed row"
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            return None, ("DeepSpeed's async_io op is not compatible here (libaio missing?): "
                          "no DeepSpeed row")
        return builder.load(verbose=False), ""
    except Exception as e:  # a JIT build fails in many ways; the row is optional
        first = (str(e).strip().splitlines() or [""])[0]
        return None, f"DeepSpeed's async_io op does not load ({type(e).__name__}: {first})"


def _measure_deepspeed(ds: Any, scratch: _Scratch, buf: torch.Tensor,
                       p: _Point) -> tuple[int, float]:
    """``aio_handle`` at (block size, queue depth), DeepSpeed's defaults otherwise; one
    synchronous call over the whole buffer, from file offset 0."""
    handle = ds.aio_handle(p.block_size, p.queue_depth, False, True, 1)
    call = handle.sync_pwrite if p.direction == "write" else handle.sync_pread
    start = time.perf_counter()
    call(buf, scratch.path)
    return buf.numel(), time.perf_counter() - start


def _fill(scratch: _Scratch, buf: torch.Tensor) -> None:
    """Writes the whole file once, unmeasured: reads of fallocated but never written extents
    return zeros without touching the device, and first writes pay for extent conversion."""
    with aio.Engine("auto", 32, MiB) as eng, \
            aio.open(scratch.path, "r+", eng, direct=scratch.direct) as f:
        f.allocate(scratch.size)
        futures = [f.pwrite(buf, off, min(buf.numel(), scratch.size - off))
                   for off in range(0, scratch.size, buf.numel())]
        for fut in futures:
            fut.result()


def _contenders(scratch: _Scratch, buf: torch.Tensor, block_sizes: tuple[int, ...],
                cap_s: float, notes: list[str]) -> list[_Contender]:
    """fio (the reference, when installed), each tieroffload backend, the serial loops and
    DeepSpeed (when it loads); what is missing goes into ``notes``."""
    block_buf = buf[:max(block_sizes)]
    contenders = []
    if shutil.which(FIO):
        contenders.append(_Contender(FIO, True, lambda p: _measure_fio(scratch, cap_s, p)))
    else:
        notes.append("fio is not installed: no reference column, no ratios (apt-get install fio)")
    for backend in aio.backends():
        contenders.append(_Contender(
            ENGINE_PREFIX + backend, True,
            lambda p, b=backend: _measure_engine(scratch, b, buf, cap_s, p)))
    ds, why = _deepspeed_aio()
    if ds is None:
        notes.append(why)
    else:
        ds_buf = aio.aligned_empty(min(scratch.size, DEEPSPEED_MAX))
        for off in range(0, ds_buf.numel(), buf.numel()):
            piece = ds_buf[off:off + buf.numel()]
            piece.copy_(buf[:piece.numel()])
        contenders.append(_Contender(
            "deepspeed", True, lambda p: _measure_deepspeed(ds, scratch, ds_buf, p)))
    contenders.append(_Contender(
        "python", False, lambda p: _measure_python(scratch, block_buf, cap_s, p)))
    contenders.append(_Contender(
        "aiofiles", False, lambda p: _measure_aiofiles(scratch, block_buf, cap_s, p)))
    return contenders


def _check_dir(directory: str) -> None:
    if not os.path.exists(directory):
        raise BenchError(f"--dir {directory}: no such directory")
    if not os.path.isdir(directory):
        raise BenchError(f"--dir {directory}: not a directory")


def _check_space(directories: list[str], size: int, procs: int, aggregate: bool) -> None:
    """Each device must hold the most that is on it at one time: the sweep's scratch file, then
    (aggregate) ``procs`` files of ``size`` in the first directory, then ``procs`` striped files
    over all the directories (directories on one device counted together)."""
    devices = [os.stat(d).st_dev for d in directories]
    phases = [{devices[0]: size}]
    if aggregate:
        phases.append({devices[0]: procs * size})
        striped: dict[int, int] = collections.Counter()
        for i, dev in enumerate(devices):
            striped[dev] += procs * aio.stripe_share(size, len(directories), i, swap.STRIPE)
        phases.append(striped)
    first: dict[int, str] = {}
    for dev, directory in zip(devices, directories):
        first.setdefault(dev, directory)
    for dev, directory in first.items():
        need = max(phase.get(dev, 0) for phase in phases)
        free = shutil.disk_usage(directory).free
        if free < need:
            per = f" per process x --procs {procs}" if procs > 1 else ""
            raise BenchError(f"--dir {directory}: not enough free space for --size "
                             f"{format_size(size)}{per} ({need / 1e9:.3g} GB needed, "
                             f"{free / 1e9:.3g} GB free)")


def _agg_paths(directories: list[str], tag: str, rank: int) -> list[str]:
    return [os.path.join(d, f".tieroffload-bench-{tag}-rank{rank}.tmp") for d in directories]


def _stream(f: Any, bufs: list[torch.Tensor], size: int, write: bool) -> tuple[float, float, int]:
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


def _agg_run(rank: int, barrier: Any, task: dict[str, Any]) -> dict[str, Any]:
    """One process's part of an aggregate measurement: its own engine and files (striped when
    there are several directories, as ``SwapSpace`` does), filled once unmeasured (first writes
    convert extents), then a timed write and, after the page cache is dropped, a timed read, both
    started together with the other processes. The files are removed whatever happens."""
    directories, size = task["dirs"], task["size"]
    paths = _agg_paths(directories, task["tag"], rank)
    files: list[aio.File] = []
    eng = IOConfig.from_dict(task["io"]).engine()
    try:
        for path, direct in zip(paths, task["direct"]):
            files.append(aio.open(path, "w+", engine=eng, direct=direct))
        f = files[0] if len(files) == 1 else aio.StripedFile(files, swap.STRIPE)
        f.allocate(size)
        # Not pinned: pinning does not change disk I/O and would start CUDA in every process.
        bufs = [aio.aligned_empty(min(CHUNK, size), pin=False) for _ in range(AGG_INFLIGHT)]
        bufs[0].copy_(torch.randint(0, 256, (bufs[0].numel(),), dtype=torch.uint8))
        for b in bufs[1:]:
            b.copy_(bufs[0])
        _stream(f, bufs, size, write=True)
        barrier.wait()
        write = _stream(f, bufs, size, write=True)
        barrier.wait()
        cold = drop_page_cache() if rank == 0 else None
        barrier.wait()
        read = _stream(f, bufs, size, write=False)
        return {"write": write, "read": read, "cold": cold}
    finally:
        for fi in files:
            fi.close()
        eng.close()
        for path in paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def disk_gbps(directories: str | list[str], size: int = 256 * MiB,
              io: IOConfig | None = None) -> tuple[float, float]:
    """(read, write) GB/s of one process through ``directories`` (striped as the swap space
    stripes them), measured as the aggregate rows are: writes on a second pass up to the fsync,
    reads cold where the page cache can be dropped."""
    dirs = [os.fspath(directories)] if isinstance(directories, (str, os.PathLike)) \
        else [os.fspath(d) for d in directories]
    task = {"dirs": dirs, "direct": [True] * len(dirs), "size": size,
            "io": (io or IOConfig()).to_dict(), "tag": str(os.getpid())}
    out = _agg_run(0, threading.Barrier(1), task)
    (rs, re_, rb), (ws, we, wb) = out["read"], out["write"]
    return rb / (re_ - rs) / 1e9, wb / (we - ws) / 1e9


def _agg_worker(rank: int, barrier: Any, tasks: Any, results: Any) -> None:
    """A spawned process: runs the tasks it is sent until None; a failure breaks the barrier
    so that the others stop too, and is sent back as text (aio's errors do not all pickle)."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        while (task := tasks.get()) is not None:
            try:
                results.put((rank, _agg_run(rank, barrier, task), None))
            except Exception as e:
                barrier.abort()
                broken = isinstance(e, threading.BrokenBarrierError)
                results.put((rank, None, (broken, f"{type(e).__name__}: {e}")))
    except KeyboardInterrupt:
        pass  # the parent is stopping: the files went in _agg_run's finally


class _Workers:
    """``procs`` spawned processes that start each task together (a shared barrier)."""

    def __init__(self, procs: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.results = ctx.Queue()
        self.tasks = [ctx.SimpleQueue() for _ in range(procs)]
        # Kept here: the children unpickle its semaphores after start() returns.
        self.barrier = ctx.Barrier(procs)
        self.procs = [ctx.Process(target=_agg_worker, args=(r, self.barrier, self.tasks[r],
                                                             self.results),
                                  name=f"tieroffload-bench-{r}", daemon=True)
                      for r in range(procs)]
        for p in self.procs:
            p.start()

    def run(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        for t in self.tasks:
            t.put(task)
        got: dict[int, Any] = {}
        errors: list[tuple[bool, str]] = []
        while len(got) + len(errors) < len(self.procs):
            try:
                rank, out, err = self.results.get(timeout=0.5)
            except queue.Empty:
                dead = [p for p in self.procs if p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"bench process {dead[0].name} died (exit code "
                                       f"{dead[0].exitcode})") from None
                continue
            if err is None:
                got[rank] = out
            else:
                errors.append((err[0], f"bench process {rank}: {err[1]}"))
        if errors:
            # The first cause, not the broken barrier it left the others with.
            raise RuntimeError(min(errors)[1])
        return [got[r] for r in range(len(self.procs))]

    def close(self) -> None:
        for t, p in zip(self.tasks, self.procs):
            if p.exitcode is None:
                try:
                    t.put(None)
                except OSError:
                    pass
        for p in self.procs:
            p.join(10)
            if p.exitcode is None:
                p.terminate()  # SIGTERM: the worker still removes its files
                p.join(10)
            if p.exitcode is None:
                p.kill()
                p.join()
        self.results.close()


def _aggregate(directories: list[str], direct: list[bool], size: int, procs: int,
               io: dict[str, Any], progress: bool) -> tuple[list[dict[str, Any]], bool]:
    """The aggregate rows for (1 directory, all of them) x (1 process, ``procs``), and whether
    the reads were cold. One process runs here; several are spawned, and start together."""
    tag = str(os.getpid())
    configs = sorted({(k, p) for k in (1, len(directories)) for p in (1, procs)},
                     key=lambda c: (c[1], c[0]))
    rows: list[dict[str, Any]] = []
    cold = True
    workers = None
    bar = tqdm(total=len(configs), unit="run", disable=not progress, file=sys.stderr,
               desc="aggregate")
    try:
        for k, p in configs:
            bar.set_postfix_str(f"{k} dir{'s' if k > 1 else ''}, {p} "
                                f"process{'es' if p > 1 else ''}")
            task = {"dirs": directories[:k], "direct": direct[:k], "size": size, "io": io,
                    "tag": tag}
            if p == 1:
                outs = [_agg_run(0, threading.Barrier(1), task)]
            else:
                if workers is None:
                    workers = _Workers(procs)
                outs = workers.run(task)
            cold = bool(outs[0]["cold"]) and cold
            for direction in ("read", "write"):
                spans = [o[direction] for o in outs]
                wall = max(e for _, e, _ in spans) - min(s for s, _, _ in spans)
                rows.append({"dirs": k, "procs": p, "direction": direction,
                             "per_proc_gbps": [b / (e - s) / 1e9 for s, e, b in spans],
                             "total_gbps": sum(b for _, _, b in spans) / wall / 1e9})
            bar.update()
    finally:
        bar.close()
        if workers is not None:
            workers.close()
        # Whatever a killed process could not remove.
        for r in range(procs):
            for path in _agg_paths(directories, tag, r):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
    return rows, cold


def _device_notes(directories: list[str]) -> list[str]:
    groups: dict[int, list[str]] = collections.defaultdict(list)
    for d in directories:
        groups[os.stat(d).st_dev].append(d)
    shared = [g for g in groups.values() if len(g) > 1]
    if len(shared) == 1 and len(shared[0]) == len(directories):
        return ["these directories share one device: their bandwidths do not add"]
    return [f"{' and '.join(g)} share one device: their bandwidths do not add" for g in shared]


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
    dirs = ([os.fspath(d) for d in directory] if isinstance(directory, (list, tuple))
            else [os.fspath(directory)])
    if not dirs:
        raise BenchError("--dir is needed")
    if size is None:
        size = QUICK_SIZE if quick else DEFAULT_SIZE
    elif isinstance(size, str):
        try:
            size = parse_bytes(size)
        except ValueError as e:
            raise BenchError(f"--size {e}") from None
    size = size // MiB * MiB
    if size < MIN_SIZE:
        raise BenchError(f"--size must be at least {format_size(MIN_SIZE)}, not {size} bytes")
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
        _check_dir(d)
        st = os.stat(d)
        if (st.st_dev, st.st_ino) in seen:
            raise BenchError(f"--dir {d}: the same directory as --dir "
                             f"{seen[st.st_dev, st.st_ino]}")
        seen[st.st_dev, st.st_ino] = d
    aggregate = len(dirs) > 1 or procs > 1
    directory = dirs[0]

    notes: list[str] = []
    scratch = _Scratch(directory, size)
    bar = None
    try:
        direct = [scratch.direct]
        for d in dirs[1:]:  # writable, and takes O_DIRECT? Before anything is written.
            probe = _Scratch(d, 0)
            probe.remove()
            direct.append(probe.direct)
        _check_space(dirs, size, procs, aggregate)
        if not scratch.direct:
            notes.append(f"{directory} refuses O_DIRECT: every engine ran buffered, so the "
                         "figures include the page cache")
        buf = aio.aligned_empty(min(CHUNK, size))
        buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8))
        contenders = _contenders(scratch, buf, block_sizes, cap_s, notes)
        engines = [c.name for c in contenders]

        points = sorted({_Point(d, bs, qd) for d in ("read", "write") for bs in block_sizes
                         for qd in (*depths, 1)},
                        key=lambda p: (p.direction, p.block_size, p.queue_depth))
        plan = [(p, [c for c in contenders if (c.sweeps and (p.queue_depth in depths
                                                             or c.name == FIO))
                     or (not c.sweeps and p.queue_depth == 1)])
                for p in points]
        cold = True
        dropped: set[str] = set()
        runs: list[dict[str, Any]] = []
        bar = tqdm(total=1 + repeats * sum(len(cs) for _, cs in plan), unit="run",
                   disable=not progress, file=sys.stderr, desc="nvme bench")
        bar.set_postfix_str(f"writing the {format_size(size)} scratch file")
        _fill(scratch, buf)
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
                        if _stopping.is_set():  # an interrupt whose exception was lost
                            raise KeyboardInterrupt
                        try:
                            moved, secs = c.measure(p)
                            runs.append({"engine": c.name, "direction": p.direction,
                                         "block_size": p.block_size,
                                         "queue_depth": p.queue_depth, "repeat": rep,
                                         "bytes": moved, "seconds": secs,
                                         "gbps": moved / secs / 1e9})
                        except _FioFailed as e:
                            notes.append(f"{e}: fio left out of the comparison")
                            dropped.add(c.name)
                    bar.update()
    finally:
        if bar is not None:
            bar.close()
        scratch.remove()
    del buf, contenders  # the sweep's buffers (DeepSpeed's up to 1 GiB) are not needed now
    summary = _summarise(runs)
    recommended, figures = _recommend(summary)
    agg_rows: list[dict[str, Any]] = []
    if aggregate:
        agg_rows, agg_cold = _aggregate(dirs, direct, size, procs, recommended, progress)
        cold = cold and agg_cold
        notes.extend(f"{d} refuses O_DIRECT: the aggregate ran buffered there"
                     for d, ok in zip(dirs[1:], direct[1:]) if not ok)
        notes.extend(_device_notes(dirs))
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


def _summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median GB/s per (engine, direction, block size, queue depth), and its ratio to fio's
    median at the same point (None without fio)."""
    groups: dict[tuple[str, str, int, int], list[float]] = collections.defaultdict(list)
    for r in runs:
        groups[(r["engine"], r["direction"], r["block_size"], r["queue_depth"])].append(r["gbps"])
    medians = {k: statistics.median(v) for k, v in groups.items()}
    summary = []
    for (engine, direction, bs, qd), med in medians.items():
        ref = medians.get((FIO, direction, bs, qd))
        summary.append({"engine": engine, "direction": direction, "block_size": bs,
                        "queue_depth": qd, "gbps": med, "runs": len(groups[engine, direction,
                                                                            bs, qd]),
                        "ratio_to_fio": med / ref if ref else None})
    return summary


def _recommend(summary: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tieroffload setting with the best harmonic mean of read and write GB/s; among those
    within WITHIN of it, the one with the least memory in flight (queue depth x block size)."""
    rows = {(r["engine"], r["direction"], r["block_size"], r["queue_depth"]): r for r in summary}
    scored = []
    for (engine, direction, bs, qd), read in rows.items():
        write = rows.get((engine, "write", bs, qd))
        if direction == "read" and engine.startswith(ENGINE_PREFIX) and write is not None:
            hmean = 2 / (1 / read["gbps"] + 1 / write["gbps"])
            scored.append((hmean, engine, bs, qd, read, write))
    best = max(s[0] for s in scored)
    _, engine, bs, qd, read, write = min(
        (s for s in scored if s[0] >= best * (1 - WITHIN)),
        key=lambda s: (s[2] * s[3], s[3], s[1] != ENGINE_PREFIX + "io_uring"))
    backend = engine[len(ENGINE_PREFIX):]
    recommended = IOConfig(backend=backend, block_size=bs, queue_depth=qd,
                           threads=qd if backend == "threads" else None).to_dict()
    fio_read = rows.get((FIO, "read", bs, qd))
    fio_write = rows.get((FIO, "write", bs, qd))
    figures = {"read_gbps": read["gbps"], "write_gbps": write["gbps"],
               "fio_read_gbps": fio_read["gbps"] if fio_read else None,
               "fio_write_gbps": fio_write["gbps"] if fio_write else None,
               "read_ratio_to_fio": read["ratio_to_fio"],
               "write_ratio_to_fio": write["ratio_to_fio"]}
    return recommended, figures


def format_table(result: dict[str, Any]) -> str:
    """The printed report: one line per (direction, block size, queue depth), each engine's
    median GB/s and, in brackets, its ratio to fio there; then the recommendation, the aggregate
    rows (when there are any) and notes."""
    rows = {(r["engine"], r["direction"], r["block_size"], r["queue_depth"]): r
            for r in result["summary"]}
    engines = [e for e in result["engines"] if any(r[0] == e for r in rows)]
    points = sorted({k[1:] for k in rows})
    labels = [e[len(ENGINE_PREFIX):] if e.startswith(ENGINE_PREFIX) else e for e in engines]
    width = 14
    out = [f"tieroffload-bench nvme: {format_size(result['size'])} in {result['dir']}, "
           f"median of {result['repeats']} runs in GB/s (1e9 B/s), (ratio to fio at the same "
           "block size and queue depth); io_uring and threads are tieroffload's backends",
           f"{'dir':<6}{'block':>6}{'qd':>5}  " + "".join(f"{x:>{width}}" for x in labels)]
    for direction, bs, qd in points:
        cells = []
        for e in engines:
            r = rows.get((e, direction, bs, qd))
            if r is None:
                cells.append("-")
            elif e == FIO or r["ratio_to_fio"] is None:
                cells.append(f"{r['gbps']:.2f}")
            else:
                cells.append(f"{r['gbps']:.2f} ({r['ratio_to_fio']:.2f})")
        out.append(f"{direction:<6}{format_size(bs):>6}{qd:>5}  "
                   + "".join(f"{c:>{width}}" for c in cells))
    rec, fig = result["recommended"], result["recommended_figures"]
    line = (f"recommended: backend={rec['backend']} block_size={format_size(rec['block_size'])} "
            f"queue_depth={rec['queue_depth']} threads={rec['threads']}: "
            f"read {fig['read_gbps']:.2f} GB/s, write {fig['write_gbps']:.2f} GB/s")
    if fig["read_ratio_to_fio"] is not None and fig["write_ratio_to_fio"] is not None:
        line += (f" ({fig['read_ratio_to_fio']:.2f} and {fig['write_ratio_to_fio']:.2f} of fio's "
                 f"{fig['fio_read_gbps']:.2f} and {fig['fio_write_gbps']:.2f})")
    out.append(line)
    out.extend(_aggregate_table(result))
    out.extend(f"note: {n}" for n in result["notes"])
    return "\n".join(out)


def _aggregate_table(result: dict[str, Any]) -> list[str]:
    rows = result.get("aggregate") or []
    if not rows:
        return []
    dirs = result["dirs"]
    over = (f"{dirs[0]} (1 dir) and striped in {format_size(swap.STRIPE)} over "
            f"{', '.join(dirs)} ({len(dirs)} dirs)" if len(dirs) > 1 else dirs[0])
    out = [f"aggregate at the recommended setting: {format_size(result['size'])} per process in "
           f"{format_size(min(CHUNK, result['size']))} requests, {AGG_INFLIGHT} in flight, over "
           f"{over}; GB/s (1e9 B/s)",
           f"{'dirs':>4}{'procs':>6}  {'dir':<6}{'total':>7}  per process"]
    for r in rows:
        per = " ".join(f"{g:.2f}" for g in r["per_proc_gbps"])
        out.append(f"{r['dirs']:>4}{r['procs']:>6}  {r['direction']:<6}{r['total_gbps']:>7.2f}  "
                   f"{per}")
    return out


def _figure(**kw: Any) -> Any:
    """A matplotlib Figure drawn by the Agg canvas, leaving pyplot's backend (a notebook's
    inline one, say) as it was."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise BenchError("--plot needs matplotlib, which is not installed "
                         "(pip install matplotlib)") from None
    fig = Figure(**kw)
    FigureCanvasAgg(fig)
    return fig


def plot(result: dict[str, Any], path: str | os.PathLike) -> Any:
    """Writes a PNG: GB/s against queue depth, one panel per direction and block size, one line
    per engine (the serial loops are single points at queue depth 1). Returns the Figure (a
    notebook shows it)."""
    summary = result["summary"]
    block_sizes = sorted({r["block_size"] for r in summary})
    depths = sorted({r["queue_depth"] for r in summary})
    engines = result["engines"]
    fig = _figure(figsize=(4.5 * len(block_sizes), 7.5))
    axes = fig.subplots(2, len(block_sizes), squeeze=False)
    for i, direction in enumerate(("read", "write")):
        top = 1.1 * max(r["gbps"] for r in summary if r["direction"] == direction)
        for j, bs in enumerate(block_sizes):
            ax = axes[i][j]
            for e in engines:
                pts = sorted((r["queue_depth"], r["gbps"]) for r in summary
                             if r["engine"] == e and r["direction"] == direction
                             and r["block_size"] == bs)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=e,
                            linestyle="--" if e == FIO else "-")
            ax.set_xscale("log", base=2)
            ax.set_xticks(depths, [str(d) for d in depths])
            ax.set_title(f"{direction}, {format_size(bs)} blocks")
            ax.set_xlabel("queue depth")
            ax.set_ylabel("GB/s (1e9 B/s)")
            ax.set_ylim(0, top)  # one scale per row, so block sizes compare at a glance
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.suptitle(f"tieroffload-bench nvme: {format_size(result['size'])} in {result['dir']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return fig


def _check_output(flag: str, path: str | None) -> None:
    """A missing output folder fails now, not after minutes of measuring."""
    if path is not None:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise BenchError(f"{flag} {path}: no such directory {parent}")


def main(argv: list[str] | None = None) -> int:
    """``tieroffload-bench nvme --dir DIR [--dir DIR2 ...] [--procs N] [--size 1G] [--quick]
    [--json F] [--plot F]``."""
    parser = argparse.ArgumentParser(
        prog="tieroffload-bench",
        description="Measures the disk (fio), tieroffload on it and the alternatives, side by "
                    "side, and says which I/O settings to use.")
    sub = parser.add_subparsers(dest="command", required=True)
    nvme = sub.add_parser(
        "nvme", help="sequential O_DIRECT read/write sweep of one scratch file",
        description="Sweeps read and write over block sizes and queue depths for fio (io_uring), "
                    "each tieroffload backend, a Python loop, aiofiles and DeepSpeed (when it "
                    "loads); prints a table and the recommended settings. With several --dir "
                    "or --procs N, then measures the recommended setting striped over all the "
                    "directories and with N processes at once.")
    nvme.add_argument("--dir", required=True, action="append",
                      help="directory on the disk to measure; give it once per drive to also "
                           "measure them striped together (the sweep runs in the first)")
    nvme.add_argument("--procs", type=int, default=1,
                      help="also measure with this many processes at once, each with its own "
                           "files (default 1)")
    nvme.add_argument("--size", help="scratch file size, e.g. 1G, 512M, 1GiB "
                                     f"(default {format_size(DEFAULT_SIZE)}, "
                                     f"{format_size(QUICK_SIZE)} with --quick)")
    nvme.add_argument("--quick", action="store_true",
                      help="1M blocks at queue depth 8 and 32, one repeat (well under 30 s)")
    nvme.add_argument("--repeats", type=int,
                      help="interleaved repeats per point, medians reported (default 3, 1 quick)")
    nvme.add_argument("--json", metavar="OUT.json",
                      help="write every measurement and the recommended block")
    nvme.add_argument("--plot", metavar="OUT.png", help="write GB/s against queue depth (PNG)")
    args = parser.parse_args(argv)

    # SIGTERM takes the same way out as Ctrl-C, so the scratch file is removed either way;
    # the caller's handlers come back at the end (main may run inside a notebook or a test).
    _stopping.clear()
    previous = {sig: signal.signal(sig, _on_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        _check_output("--json", args.json)
        _check_output("--plot", args.plot)
        if args.plot:
            _figure()  # matplotlib missing fails now, not after minutes of measuring
        result = run_nvme(args.dir, args.size, quick=args.quick, repeats=args.repeats,
                          procs=args.procs)
        if _stopping.is_set():
            raise KeyboardInterrupt
        print(format_table(result))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        if args.plot:
            plot(result, args.plot)
    except BenchError as e:
        print(f"tieroffload-bench nvme: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tieroffload-bench nvme: interrupted; scratch files removed", file=sys.stderr)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


_stopping = threading.Event()


def _on_interrupt(signum: int, frame: Any) -> None:
    """Ctrl-C's way out, for SIGINT and SIGTERM alike. Installed for SIGINT too because
    ``asyncio.run`` otherwise puts its own handler in, which only cancels the aiofiles task,
    and that cancel was seen to vanish about one run in ten; the flag, checked before each
    point and at the end, catches an exception lost anywhere else."""
    _stopping.set()
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())

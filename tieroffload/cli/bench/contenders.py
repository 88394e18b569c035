"""The contenders the bench times side by side: tieroffload's engine per backend, fio, a plain
Python loop, aiofiles and DeepSpeed's aio where it loads."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import errno
import importlib.util
import json
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Callable

import aiofiles
import torch

from ... import aio
from . import common
from .common import DEEPSPEED_MAX, ENGINE_PREFIX, BenchError, FioFailed, MiB


@dataclass(frozen=True)
class Point:
    """One measured setting: read or write, block size and queue depth."""

    direction: str
    block_size: int
    queue_depth: int


@dataclass
class Contender:
    """One engine in the comparison: ``measure(point)`` returns (bytes moved, seconds)."""

    name: str
    sweeps: bool  # over every queue depth; else at queue depth 1 only (a serial loop)
    measure: Callable[[Point], tuple[int, float]]


class Scratch:
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


def _measure_engine(scratch: Scratch, backend: str, buf: torch.Tensor, cap_s: float,
                    p: Point) -> tuple[int, float]:
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


def _measure_fio(scratch: Scratch, cap_s: float, p: Point) -> tuple[int, float]:
    """fio with io_uring on the same file, block size and queue depth; its own timing."""
    cmd = [common.FIO, "--name=tieroffload-bench", f"--filename={scratch.path}",
           f"--rw={p.direction}",
           f"--bs={p.block_size}", f"--iodepth={p.queue_depth}", "--ioengine=io_uring",
           f"--direct={int(scratch.direct)}", f"--size={scratch.size}", "--allow_file_create=0",
           f"--runtime={max(1, int(cap_s * 1000))}ms", "--output-format=json",
           "--thread"]  # its job a thread, not a process of its own: it dies with fio
    out = common.run_child(cmd)
    if out.returncode != 0:
        why = (out.stderr.strip() or out.stdout.strip() or f"exit code {out.returncode}")
        raise FioFailed(f"fio failed: {why.splitlines()[-1]}")
    job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0][p.direction]
    # fio reports whole milliseconds: a run shorter than one is floored to one.
    return job["io_bytes"], max(job["runtime"], 1) / 1000


def _measure_python(scratch: Scratch, buf: torch.Tensor, cap_s: float,
                    p: Point) -> tuple[int, float]:
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


def _measure_aiofiles(scratch: Scratch, buf: torch.Tensor, cap_s: float,
                      p: Point) -> tuple[int, float]:
    """The same loop through ``aiofiles``, as asyncio code would write it."""
    write = p.direction == "write"
    view = memoryview(buf.numpy())

    async def loop() -> tuple[int, float]:
        moved = 0
        async with aiofiles.open(scratch.path, "r+b" if write else "rb", buffering=0,
                                 opener=scratch.opener()) as f:
            start = time.perf_counter()
            while (moved < scratch.size and time.perf_counter() - start <= cap_s
                   and not common.stopping.is_set()):
                chunk = view[:min(p.block_size, scratch.size - moved)]
                moved += await (f.write(chunk) if write else f.readinto(chunk))
            return moved, time.perf_counter() - start

    # The loop runs in a thread of its own, never in the main one: Ctrl-C's handler raises in
    # the main thread, and raised inside a running event loop it was seen to hang asyncio.run's
    # shutdown for over 30 s. Here the main thread leaves at once, the loop sees ``stopping`` and
    # ends after its current block. The same thread also serves code that already runs a loop
    # (a notebook).
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


def _measure_deepspeed(ds: Any, scratch: Scratch, buf: torch.Tensor,
                       p: Point) -> tuple[int, float]:
    """``aio_handle`` at (block size, queue depth), DeepSpeed's defaults otherwise; one
    synchronous call over the whole buffer, from file offset 0."""
    handle = ds.aio_handle(p.block_size, p.queue_depth, False, True, 1)
    call = handle.sync_pwrite if p.direction == "write" else handle.sync_pread
    start = time.perf_counter()
    call(buf, scratch.path)
    return buf.numel(), time.perf_counter() - start


def fill(scratch: Scratch, buf: torch.Tensor) -> None:
    """Writes the whole file once, unmeasured: reads of fallocated but never written extents
    return zeros without touching the device, and first writes pay for extent conversion."""
    with aio.Engine("auto", 32, MiB) as eng, \
            aio.open(scratch.path, "r+", eng, direct=scratch.direct) as f:
        f.allocate(scratch.size)
        futures = [f.pwrite(buf, off, min(buf.numel(), scratch.size - off))
                   for off in range(0, scratch.size, buf.numel())]
        for fut in futures:
            fut.result()


def contenders_for(scratch: Scratch, buf: torch.Tensor, block_sizes: tuple[int, ...],
                cap_s: float, notes: list[str]) -> list[Contender]:
    """fio (the reference, when installed), each tieroffload backend, the serial loops and
    DeepSpeed (when it loads); what is missing goes into ``notes``."""
    block_buf = buf[:max(block_sizes)]
    contenders = []
    if shutil.which(common.FIO):
        contenders.append(Contender(common.FIO, True, lambda p: _measure_fio(scratch, cap_s, p)))
    else:
        notes.append("fio is not installed: no reference column, no ratios (apt-get install fio)")
    for backend in aio.backends():
        contenders.append(Contender(
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
        contenders.append(Contender(
            "deepspeed", True, lambda p: _measure_deepspeed(ds, scratch, ds_buf, p)))
    contenders.append(Contender(
        "python", False, lambda p: _measure_python(scratch, block_buf, cap_s, p)))
    contenders.append(Contender(
        "aiofiles", False, lambda p: _measure_aiofiles(scratch, block_buf, cap_s, p)))
    return contenders

"""What disk I/O costs the compute that runs beside it, on this machine: a fixed amount of
matrix multiplication on all torch threads, timed alone and while the engine streams reads or
writes (O_DIRECT, 64 MiB requests, 4 in flight) through a scratch file, interleaved over
rounds. Reports, per direction, the compute's slowdown per second of I/O:
(compute beside I/O - compute alone) / (I/O alone). 0 means I/O is free beside compute (the
max(compute, I/O) floor is reachable); 1 means each second of I/O stops compute for a second
(the floor is compute + I/O).

    python bench/io_beside_compute.py --dir /mnt/nvme --gib 4 --rounds 3
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import threading
import time

import torch

from tieroffload.aio.buffers import aligned_empty
from tieroffload.aio.config import IOConfig
from tieroffload.aio.files import open as aio_open
from tieroffload.aio.throughput import AGG_INFLIGHT, CHUNK, stream
from tieroffload.utils.memory import drop_page_cache


def matmul(reps: int, n: int = 2048) -> float:
    """``reps`` products of two n x n fp32 matrices (bound by arithmetic); seconds."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    t = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    return time.perf_counter() - t


def adamw(reps: int, n: int = 1 << 25) -> float:
    """``reps`` steps of torch's fused AdamW over n fp32 parameters (bound by memory
    bandwidth: 16 bytes read and written per parameter); seconds."""
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    opt.step()
    t = time.perf_counter()
    for _ in range(reps):
        opt.step()
    return time.perf_counter() - t




def beside(fn, io) -> tuple[float, float]:
    """(seconds of ``fn``, seconds of ``io``) with both started together."""
    out: dict[str, float] = {}

    def run_io() -> None:
        t = time.perf_counter()
        io()
        out["io"] = time.perf_counter() - t

    th = threading.Thread(target=run_io)
    th.start()
    c = fn()
    th.join()
    return c, out["io"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None, help="scratch directory on the disk to measure")
    p.add_argument("--gib", type=float, default=4.0, help="bytes streamed per I/O run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--adamw-params", type=int, default=1 << 25,
                   help="parameters of the AdamW work")
    args = p.parse_args()
    size = int(args.gib * (1 << 30)) // CHUNK * CHUNK
    eng = IOConfig().engine()
    fd, path = tempfile.mkstemp(dir=args.dir or None, prefix=".io-beside-compute-")
    os.close(fd)
    f = aio_open(path, "w+", engine=eng, direct=True)
    try:
        f.allocate(size)
        bufs = [aligned_empty(CHUNK, pin=False) for _ in range(AGG_INFLIGHT)]
        for b in bufs:
            b.fill_(7)
        stream(f, bufs, size, write=True)  # first writes convert extents: not timed

        def read() -> None:
            drop_page_cache()
            stream(f, bufs, size, write=False)

        def write() -> None:
            stream(f, bufs, size, write=True)

        alone_io = {"read": statistics.median(beside(lambda: 0.0, read)[1] for _ in range(2)),
                    "write": statistics.median(beside(lambda: 0.0, write)[1] for _ in range(2))}
        print(f"{torch.get_num_threads()} torch threads, {args.gib:g} GiB per I/O run, medians "
              f"of {args.rounds} rounds; alone: read {alone_io['read']:.2f} s "
              f"({size / alone_io['read'] / 1e9:.2f} GB/s), write {alone_io['write']:.2f} s "
              f"({size / alone_io['write'] / 1e9:.2f} GB/s)")
        work_kinds = {"matmul": matmul, "adamw": functools.partial(adamw, n=args.adamw_params)}
        for name, work in work_kinds.items():
            # compute a little longer than the longer I/O run, so that all of it is beside
            reps = max(2, round(1.2 * max(alone_io.values()) / (work(2) / 2)))
            rows: dict[str, list[float]] = {"alone": [], "read": [], "write": []}
            for _ in range(args.rounds):
                rows["alone"].append(work(reps))
                for way, io in (("read", read), ("write", write)):
                    rows[way].append(beside(functools.partial(work, reps), io)[0])
            med = {k: statistics.median(v) for k, v in rows.items()}
            costs = ", ".join(f"{(med[w] - med['alone']) / alone_io[w]:.2f} s per second of "
                              f"{w} ({med[w]:.2f} s beside it)" for w in ("read", "write"))
            print(f"{name}: alone {med['alone']:.2f} s; loses {costs}")
    finally:
        f.close()
        eng.close()
        os.unlink(path)


if __name__ == "__main__":
    main()

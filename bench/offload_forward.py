"""Forward (and one training step's forward+backward) of a stack of blocks whose weights total
several GiB, in one run: all weights resident (the compute floor), tieroffload with the params on
NVMe, Accelerate ``disk_offload`` (when installed), and the pure I/O time of reading the same
bytes. Every offloaded run starts with a cold page cache.

    python bench/offload_forward.py --dir /mnt/nvme --gib 3 --batch 8 --batch 96

Reports tieroffload / max(compute, I/O) and Accelerate / tieroffload for each batch size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from torch import nn

import tieroffload
from tieroffload import aio
from tieroffload.sizes import drop_page_cache

WIDTH = 4096


def build(gib: float) -> nn.Sequential:
    n = max(1, int(gib * (1 << 30) / (WIDTH * WIDTH * 4)))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(n)])


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn`` with a cold page cache before each run."""
    times = []
    for _ in range(repeats):
        drop_page_cache()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_model(model: nn.Module, x: torch.Tensor, train: bool) -> None:
    if train:
        model(x).square().mean().backward()
        model.zero_grad(set_to_none=True)
    else:
        with torch.no_grad():
            model(x)


def io_floor(directory: str, nbytes: int, repeats: int) -> float:
    """Seconds to read ``nbytes`` cold with O_DIRECT at 1 MiB, queue depth 32."""
    path = os.path.join(directory, "bench-io.bin")
    chunk = 64 << 20
    buf = aio.aligned_empty(chunk)
    with aio.Engine(queue_depth=32, block_size=1 << 20) as eng:
        with aio.open(path, "w+", engine=eng) as f:
            f.allocate(nbytes)
            for off in range(0, nbytes, chunk):
                f.pwrite(buf, off, min(chunk, nbytes - off)).result()

            def read_all() -> None:
                futs = [f.pread(aio.aligned_empty(min(chunk, nbytes - off)), off)
                        for off in range(0, nbytes, chunk)]
                for fut in futs:
                    fut.result()

            t = timed(read_all, repeats)
    os.remove(path)
    return t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", default=None, help="NVMe scratch directory (default: a temp dir here)")
    p.add_argument("--gib", type=float, default=3.0, help="weights in GiB (default 3)")
    p.add_argument("--batch", type=int, action="append", help="batch sizes (default 8 and 96)")
    p.add_argument("--budget", default="1GiB", help="tieroffload cpu_budget (default 1GiB)")
    p.add_argument("--prefetch", default="512MiB", help="tieroffload prefetch (default 512MiB)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--train", action="store_true", help="forward+backward instead of inference")
    p.add_argument("--threads", type=int, default=None, help="torch compute threads")
    args = p.parse_args()
    batches = args.batch or [8, 96]
    tmp = tempfile.TemporaryDirectory(dir=args.dir or ".", prefix="bench-offload-")
    directory = tmp.name
    torch.set_num_threads(args.threads or os.cpu_count() or 1)

    model = build(args.gib)
    nbytes = sum(q.numel() * q.element_size() for q in model.parameters())
    print(f"{len(model)} x Linear({WIDTH},{WIDTH}) = {nbytes / 2**30:.2f} GiB fp32, "
          f"{'train step' if args.train else 'inference'}, cold cache, medians of {args.repeats}")
    io_s = io_floor(directory, nbytes, args.repeats)
    xs = {b: torch.randn(b, WIDTH) for b in batches}
    resident = {b: timed(lambda b=b: run_model(model, xs[b], args.train), args.repeats)
                for b in batches}

    policy = tieroffload.Policy(params="nvme", nvme_dir=directory, device="cpu",
                                cpu_budget=args.budget, prefetch=args.prefetch)
    tieroffload.offload(model, policy)
    run_model(model, xs[batches[0]], args.train)  # records the order
    ours = {b: timed(lambda b=b: run_model(model, xs[b], args.train), args.repeats)
            for b in batches}
    st = tieroffload.stats(model)
    tieroffload.close(model)

    accel: dict[int, float] = {}
    try:
        from accelerate import disk_offload
    except ImportError:
        print("accelerate is not installed: its row is skipped")
    else:
        disk_offload(model, os.path.join(directory, "accelerate"), execution_device="cpu")
        run_model(model, xs[batches[0]], args.train)
        accel = {b: timed(lambda b=b: run_model(model, xs[b], args.train), args.repeats)
                 for b in batches}

    print(f"pure I/O (read {nbytes / 1e9:.2f} GB, O_DIRECT 1 MiB qd32): {io_s:.2f} s "
          f"= {nbytes / io_s / 1e9:.2f} GB/s")
    print(f"tieroffload stats: wait {st['wait_s']:.2f} s, hits {st['hits']}, late {st['late']}, "
          f"misses {st['misses']}, peak resident {st['peak_resident'] / 2**20:.0f} MiB "
          f"(budget {st['budget'] / 2**20:.0f} MiB + staging {st['overhead'] / 2**20:.0f} MiB)")
    print(f"{'batch':>5} {'resident':>9} {'tieroffload':>12} {'accelerate':>11} "
          f"{'ours/max(c,io)':>15} {'accel/ours':>11}")
    for b in batches:
        bound = max(resident[b], io_s)
        acc = f"{accel[b]:10.2f}s" if b in accel else f"{'-':>11}"
        ratio = f"{accel[b] / ours[b]:10.2f}x" if b in accel else f"{'-':>11}"
        print(f"{b:5d} {resident[b]:8.2f}s {ours[b]:11.2f}s {acc} {ours[b] / bound:14.2f}x {ratio}")
    tmp.cleanup()


if __name__ == "__main__":
    main()

"""The main job on an embedded default: write tensors to a scratch directory through the async
engine, read them back cold, check every byte, and print the throughput of each backend."""

from __future__ import annotations

import argparse
import os
import shutil
import time

import torch

from .. import aio
from ..utils.memory import drop_page_cache
from ..utils.sizes import format_bytes, parse_bytes


def roundtrip(directory: str, backend: str, total: int, tensor_bytes: int) -> tuple[float, float]:
    """(write GB/s, read GB/s) for ``total`` bytes in tensors of ``tensor_bytes``."""
    count = max(1, total // tensor_bytes)
    gen = torch.Generator().manual_seed(0)
    src = [aio.aligned_empty(tensor_bytes) for _ in range(count)]
    for t in src:
        t.copy_(torch.randint(0, 256, (tensor_bytes,), dtype=torch.uint8, generator=gen))
    dst = [aio.aligned_empty(tensor_bytes) for _ in range(count)]
    path = os.path.join(directory, f"demo-{backend}.bin")
    with aio.Engine(backend) as eng, aio.open(path, "w+", engine=eng) as f:
        f.allocate(count * tensor_bytes)
        t0 = time.perf_counter()
        for fut in [f.pwrite(t, i * tensor_bytes) for i, t in enumerate(src)]:
            fut.result()
        f.sync()
        t1 = time.perf_counter()
        drop_page_cache()
        t2 = time.perf_counter()
        for fut in [f.pread(t, i * tensor_bytes) for i, t in enumerate(dst)]:
            fut.result()
        t3 = time.perf_counter()
    os.remove(path)
    bad = [i for i, (a, b) in enumerate(zip(src, dst)) if not torch.equal(a, b)]
    if bad:
        raise SystemExit(f"tensors {bad} did not read back as written ({backend})")
    nbytes = count * tensor_bytes
    return nbytes / (t1 - t0) / 1e9, nbytes / (t3 - t2) / 1e9


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tieroffload", description=__doc__)
    p.add_argument("--dir", default="scratch", help="scratch directory (default %(default)s)")
    p.add_argument("--size", default="512M", help="bytes to move per backend (default %(default)s)")
    p.add_argument("--tensor", default="16M", help="size of each tensor (default %(default)s)")
    args = p.parse_args(argv)
    try:
        total, tensor = parse_bytes(args.size), parse_bytes(args.tensor)
    except ValueError as e:
        p.error(str(e))
    created = not os.path.isdir(args.dir)
    os.makedirs(args.dir, exist_ok=True)
    print(f"tieroffload demo: {format_bytes(total)} in {format_bytes(tensor)} tensors, "
          f"O_DIRECT, in {args.dir}/ (backends: {', '.join(aio.backends())})")
    try:
        for backend in aio.backends():
            w, r = roundtrip(args.dir, backend, total, tensor)
            print(f"  {backend:9s} write {w:6.2f} GB/s   read {r:6.2f} GB/s   bytes verified")
    finally:
        if created:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()

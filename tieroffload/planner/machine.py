"""The machine's figures the cost model needs: disk GB/s, what NVMe traffic costs compute,
host-to-device GB/s, RAM and GPU memory."""

from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import dataclass, field

import torch

from .. import aio
from ..aio.config import IOConfig
from ..aio.private import ScratchFile
from ..aio.swap import check_directory
from ..aio.throughput import disk_gbps
from ..utils import memory
from ..utils.paths import directories


@dataclass(frozen=True)
class Machine:
    """Measured figures of this machine. GB/s are 1e9 bytes per second."""

    read_gbps: float
    write_gbps: float
    io_cost: float            # seconds of compute lost per byte moved (see ``io_cost``)
    io: IOConfig = field(default_factory=IOConfig)
    h2d_gbps: float | None = None
    ram: int = 0
    gpu: int | None = None

    @classmethod
    def measure(cls, nvme_dir: str | os.PathLike | None = None,
                bench: dict | str | os.PathLike | None = None, size: int = 256 << 20) -> Machine:
        """Reads disk figures from a bench result (its dict or JSON file) or measures them in
        ``nvme_dir`` (``size`` bytes, O_DIRECT, cold reads where allowed); measures the rest.
        Several directories are measured striped, as the swap space stripes them (on one
        device they share its bandwidth); the ranks of one node (``LOCAL_WORLD_SIZE``) share
        the drives, so each rank counts its share."""
        dirs = [check_directory(d) for d in directories(nvme_dir)]
        nvme_dir = dirs[0] if dirs else None
        cost = 0.0
        if bench is not None:
            where = "given" if isinstance(bench, dict) else os.fspath(bench)
            try:
                if not isinstance(bench, dict):
                    with open(bench) as f:
                        bench = json.load(f)
                fig = bench["recommended_figures"]
                read, write = float(fig["read_gbps"]), float(fig["write_gbps"])
                io = IOConfig.from_dict(bench["recommended"])
            except (ValueError, KeyError, TypeError) as e:  # OSError: the file's own message
                raise ValueError(f"bench {where} is not a result of tieroffload-bench nvme "
                                 f"--json ({type(e).__name__}: {e})".splitlines()[0]) from None
            if nvme_dir is not None:
                cost = io_cost(nvme_dir, io)
        elif nvme_dir is not None:
            io = IOConfig()
            read, write = disk_gbps(dirs, size, io)
            cost = io_cost(nvme_dir, io)
        else:  # no NVMe tier: its figures are never used
            io, read, write = IOConfig(), math.nan, math.nan
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        read, write = read / ranks, write / ranks
        gpu = h2d = None
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_properties(0).total_memory
            h2d = _h2d_gbps()
        return cls(read, write, cost, io, h2d, memory.ram_limit(), gpu)


def io_cost(directory: str, io: IOConfig | None = None, chunk: int = 16 << 20,
            span: int = 256 << 20) -> float:
    """Seconds of compute lost per byte that NVMe traffic moves while compute runs: a matmul
    loop is timed alone and then against a stream of writes and reads of fresh page-aligned
    buffers, the way offload's traffic looks (staging copies, page faults, the I/O itself)."""
    src = torch.ones(chunk, dtype=torch.uint8)
    a = torch.randn(768, 768)

    def compute(k: int) -> float:
        t0 = time.perf_counter()
        for _ in range(k):
            a @ a
        return time.perf_counter() - t0

    k = 8
    while compute(k) < 0.5:
        k *= 2
    alone = min(compute(k) for _ in range(2))
    moved = [0]
    stop = threading.Event()
    name = f"tieroffload-probe-{os.getpid()}.bin"
    with (io or IOConfig()).engine() as eng, ScratchFile.create(directory, name, eng) as f:
        f.allocate(span)

        def traffic() -> None:
            off = 0
            while not stop.is_set():
                b = aio.aligned_empty(chunk, pin=False)
                b.copy_(src)
                f.pwrite(b, off).result()
                b = aio.aligned_empty(chunk, pin=False)
                f.pread(b, (off + span // 2) % span).result()
                moved[0] += 2 * chunk
                off = (off + chunk) % span

        th = threading.Thread(target=traffic, daemon=True)
        th.start()
        time.sleep(0.05)
        m0 = moved[0]
        both = compute(k)
        m1 = moved[0]
        stop.set()
        th.join()
    return max(both - alone, 0.0) / max(m1 - m0, 1)


def _h2d_gbps(nbytes: int = 256 << 20) -> float:
    src = aio.aligned_empty(nbytes, pin=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * nbytes / (time.perf_counter() - t0) / 1e9

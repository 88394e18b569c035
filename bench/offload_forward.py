"""Forward (and one training step's forward+backward) of a stack of blocks whose weights total
several GiB, in one run: all weights resident (the compute floor), tieroffload with the params on
NVMe, Accelerate ``disk_offload`` (when installed), and the pure I/O time of reading the same
bytes. Every offloaded run starts with a cold page cache.

    python bench/offload_forward.py --dir /mnt/nvme --gib 3 --batch 8 --batch 64

Reports tieroffload / max(compute, I/O) and Accelerate / tieroffload for each batch size. The
I/O bound is the pure read time scaled to the bytes tieroffload read in that pass: a training
step reads the weights twice (forward, backward), and a pass starts with the units that the end
of the previous one kept or prefetched along the recorded order. Those reads are timed in the
pass that started them (it waits for them before its clock stops), so that no pass gets a head
start from the pause between timed runs. The "overlap" column runs the
resident compute and a pure read of those bytes at the same time, with no scheduling at all:
on a machine with few cores the two slow each other down, and this is the floor that perfect
overlap would reach there (tieroffload / overlap).

A training step has a floor of its own under a budget smaller than the model: backward cannot
start before forward ends, and each phase must read what the budget could not keep from the
other (forward the weights past the first units, backward those before the last), whatever the
schedule. The "phases" column adds up max(compute, I/O) of forward and of backward, each with
the resident compute of that phase and the I/O time of the bytes tieroffload read in it.
Forward is a third of a step's compute and backward two thirds, but each reads half its bytes:
where the step's compute equals its I/O (the balanced batch size), no schedule under such a
budget beats 7/6 of max(compute, I/O) (I/2 + 2C/3 with C = I).

Accelerate's column needs ``pip install accelerate`` (torch is already there: nothing else moves).
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
from tieroffload.utils.memory import drop_page_cache

WIDTH = 4096


def build(gib: float) -> nn.Sequential:
    n = max(1, int(gib * (1 << 30) / (WIDTH * WIDTH * 4)))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(n)])


def cold(fn) -> float:
    """Seconds of ``fn`` after dropping the page cache."""
    drop_page_cache()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bytes_read(model: nn.Module) -> int:
    """Bytes tieroffload has read from NVMe for ``model`` (0 for the others)."""
    return tieroffload.stats(model)["bytes_read"]["nvme"] if hasattr(model, "_tieroffload") else 0


def run_model(model: nn.Module, x: torch.Tensor, train: bool,
              forward: list[tuple[float, int]] | None = None) -> None:
    """One pass; a training step appends its forward's seconds, and the bytes read by its end,
    to ``forward``."""
    if train:
        t0 = time.perf_counter()
        loss = model(x).square().mean()
        if forward is not None:
            forward.append((time.perf_counter() - t0, bytes_read(model)))
        loss.backward()
        model.zero_grad(set_to_none=True)
    else:
        with torch.no_grad():
            model(x)
    state = getattr(model, "_tieroffload", None)
    if state is not None:
        # The reads this pass started for the next one (its first units, prefetched along the
        # recorded order) are done in this pass's time, as its bytes-read figure counts them:
        # the next pass gets no head start from the pause between timed runs.
        for u in state.units:
            if u.ticket is not None:
                u.ticket.wait()


class IOFloor:
    """Reads the same bytes as the model's weights, O_DIRECT, 1 MiB, queue depth 32."""

    CHUNK = 64 << 20

    def __init__(self, directory: str, nbytes: int) -> None:
        self.nbytes = nbytes
        self.eng = aio.Engine(queue_depth=32, block_size=1 << 20)
        self.file = aio.open(os.path.join(directory, "bench-io.bin"), "w+", engine=self.eng)
        self.file.allocate(nbytes)
        buf = aio.aligned_empty(self.CHUNK)
        for off in range(0, nbytes, self.CHUNK):
            self.file.pwrite(buf, off, min(self.CHUNK, nbytes - off)).result()
        self.bufs: list[torch.Tensor] = []
        self.reserve(nbytes)

    def reserve(self, nbytes: int) -> None:
        """Buffers for reads of ``nbytes``, touched now so that no timed read faults them in."""
        while len(self.bufs) * self.CHUNK < nbytes:
            self.bufs.append(aio.aligned_empty(self.CHUNK).zero_())

    def start(self, nbytes: int) -> list[aio.Future]:
        """Issues reads of ``nbytes`` at once (after ``reserve``), going round the file again
        past its end: a training step reads the weights twice."""
        futs = []
        for buf, done in zip(self.bufs, range(0, nbytes, self.CHUNK)):
            off = done % self.nbytes
            futs.append(self.file.pread(buf, off, min(self.CHUNK, nbytes - done,
                                                      self.nbytes - off)))
        return futs

    def read_all(self) -> None:
        for fut in self.start(self.nbytes):
            fut.result()

    def close(self) -> None:
        self.file.close()
        self.eng.close()
        os.remove(self.file.path)


def overlapped(floor: IOFloor, nbytes: int, model: nn.Module, x: torch.Tensor,
               train: bool) -> float:
    """The resident compute and a pure read of ``nbytes`` at the same time, no scheduling:
    what perfect overlap gives on this machine, where the two share cores and memory
    bandwidth (each slows the other), as against max(compute, I/O) measured apart."""
    nbytes = -(-nbytes // 4096) * 4096  # O_DIRECT lengths
    floor.reserve(nbytes)

    def both() -> None:
        futs = floor.start(nbytes)
        run_model(model, x, train)
        for fut in futs:
            fut.result()
    return cold(both)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", default=None, help="NVMe scratch directory (default: a temp dir here)")
    p.add_argument("--gib", type=float, default=3.0, help="weights in GiB (default 3)")
    p.add_argument("--batch", type=int, action="append", help="batch sizes (default 8 and 64)")
    p.add_argument("--budget", default="1GiB", help="tieroffload cpu_budget (default 1GiB)")
    p.add_argument("--prefetch", default=str(tieroffload.Policy().prefetch),
                   help="tieroffload prefetch: units, or a size (default: Policy's, 2 units)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--train", action="store_true", help="forward+backward instead of inference")
    p.add_argument("--threads", type=int, default=None, help="torch compute threads")
    p.add_argument("--lend-core", action="store_true",
                   help="Policy(lend_core=True): compute lends a core to reads while behind them")
    args = p.parse_args()
    batches = args.batch or [8, 64]
    tmp = tempfile.TemporaryDirectory(dir=args.dir or ".", prefix="bench-offload-")
    directory = tmp.name
    torch.set_num_threads(args.threads or os.cpu_count() or 1)

    # Three copies of one model: resident, tieroffload (NVMe), Accelerate (disk_offload). The
    # disk is noisy, so every repeat runs all of them, interleaved, and medians are reported.
    model = build(args.gib)
    nbytes = sum(q.numel() * q.element_size() for q in model.parameters())
    print(f"{len(model)} x Linear({WIDTH},{WIDTH}) = {nbytes / 2**30:.2f} GiB fp32, "
          f"{'train step' if args.train else 'inference'}, cold cache, medians of {args.repeats}"
          f" interleaved runs{', lend_core' if args.lend_core else ''}")
    xs = {b: torch.randn(b, WIDTH) for b in batches}
    ours_model = tieroffload.offload(build(args.gib), tieroffload.Policy(
        params="nvme", nvme_dir=directory, device="cpu", cpu_budget=args.budget,
        prefetch=int(args.prefetch) if args.prefetch.isdigit() else args.prefetch,
        lend_core=args.lend_core))
    contenders = {"resident": model, "tieroffload": ours_model}
    try:
        from accelerate import disk_offload
    except ImportError:
        print("accelerate is not installed: its column is empty")
    else:
        accel_model = build(args.gib)
        disk_offload(accel_model, os.path.join(directory, "accelerate"), execution_device="cpu")
        contenders["accelerate"] = accel_model
    floor = IOFloor(directory, nbytes)
    for m in contenders.values():
        run_model(m, xs[batches[0]], args.train)  # warm-up; tieroffload records the order
    times: dict[tuple[str, int], list[float]] = {}
    read: dict[int, list[int]] = {}  # bytes tieroffload read from NVMe in each timed pass
    fwd_s: dict[int, list[float]] = {}  # the resident forward's seconds (training)
    fwd_read: dict[int, list[int]] = {}  # bytes tieroffload read in forward (training)
    for _ in range(args.repeats):
        times.setdefault(("io", 0), []).append(cold(floor.read_all))
        for b in batches:
            for name, m in contenders.items():
                before, ends = bytes_read(m), []
                t = cold(lambda m=m, b=b, e=ends: run_model(m, xs[b], args.train, e))
                times.setdefault((name, b), []).append(t)
                if name == "tieroffload":
                    read.setdefault(b, []).append(bytes_read(m) - before)
                    if ends:
                        fwd_read.setdefault(b, []).append(ends[0][1] - before)
                if name == "resident" and ends:
                    fwd_s.setdefault(b, []).append(ends[0][0])
            times.setdefault(("overlap", b), []).append(
                overlapped(floor, read[b][-1], model, xs[b], args.train))
    floor.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    io_s = med[("io", 0)]
    io_b = {b: io_s * statistics.median(read[b]) / nbytes for b in batches}
    resident = {b: med[("resident", b)] for b in batches}
    ours = {b: med[("tieroffload", b)] for b in batches}
    both = {b: med[("overlap", b)] for b in batches}
    accel = {b: med[("accelerate", b)] for b in batches if ("accelerate", b) in med}
    phases = {}  # max(compute, I/O) of forward plus that of backward; one phase in inference
    for b in batches:
        if b in fwd_s:
            fc, fio = statistics.median(fwd_s[b]), io_s * statistics.median(fwd_read[b]) / nbytes
            phases[b] = max(fc, fio) + max(resident[b] - fc, io_b[b] - fio)
        else:
            phases[b] = max(resident[b], io_b[b])
    st = tieroffload.stats(ours_model)
    tieroffload.close(ours_model, restore=False)

    print(f"pure I/O (read {nbytes / 1e9:.2f} GB, O_DIRECT 1 MiB qd32): {io_s:.2f} s "
          f"= {nbytes / io_s / 1e9:.2f} GB/s")
    print(f"tieroffload stats: wait {st['wait_s']:.2f} s, hits {st['hits']}, late {st['late']}, "
          f"misses {st['misses']}, lent {st['lent']}, "
          f"peak resident {st['peak_resident'] / 2**20:.0f} MiB "
          f"(budget {st['budget'] / 2**20:.0f} MiB + staging {st['overhead'] / 2**20:.0f} MiB)")
    print(f"{'batch':>5} {'resident':>9} {'read':>8} {'I/O':>6} {'phases':>7} {'overlap':>8} "
          f"{'tieroffload':>12} {'accelerate':>11} {'ours/max(c,io)':>15} {'ours/phases':>12} "
          f"{'ours/overlap':>13} {'accel/ours':>11}")
    for b in batches:
        bound = max(resident[b], io_b[b])
        acc = f"{accel[b]:10.2f}s" if b in accel else f"{'-':>11}"
        ratio = f"{accel[b] / ours[b]:10.2f}x" if b in accel else f"{'-':>11}"
        gb = statistics.median(read[b]) / 1e9
        print(f"{b:5d} {resident[b]:8.2f}s {gb:6.2f}GB {io_b[b]:5.2f}s {phases[b]:6.2f}s "
              f"{both[b]:7.2f}s {ours[b]:11.2f}s {acc} {ours[b] / bound:14.2f}x "
              f"{ours[b] / phases[b]:11.2f}x {ours[b] / both[b]:12.2f}x {ratio}")
    print("phases: max(compute, I/O) of forward plus that of backward (what any schedule under "
          "this budget needs); overlap: the resident compute while a pure read of the same "
          "bytes runs, without tieroffload (perfect overlap on this machine)")
    tmp.cleanup()


if __name__ == "__main__":
    main()

"""One AdamW training step of a GPT whose parameters and Adam state total several GiB, in one
run: parameters, gradients and optimizer state on NVMe under a CPU budget, and after each of its
steps, in a child process, the same step all resident (the compute floor) and the disk's read
and write GB/s. Reports each step against the compute and I/O lower bound (bytes moved / the
disk's GB/s) measured right after it, and against the same bounds taken pass by pass (forward,
then backward and the step), and peak RSS.

    python bench/train_step.py --dir /mnt/nvme --layers 16 --d 1024 --budget 1GiB
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import threading
import time

import torch
import torch.nn.functional as F

import tieroffload
from tieroffload.aio.throughput import disk_gbps
from tieroffload.testing.models import GPT, token_batch
from tieroffload.utils.memory import peak_rss, rss, start_peak
from tieroffload.utils.sizes import format_bytes


class RandomWeights(dict):
    """GPT-2-style initial weights, made one tensor at a time as load_weights asks for them."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__((name, tuple(p.shape)) for name, p in model.named_parameters())

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = super().__getitem__(name)
        if name.endswith("bias"):
            return torch.zeros(shape)
        if len(shape) == 1:
            return torch.ones(shape)
        return torch.randn(shape) * 0.02


MONITOR_S: list[float] = []  # seconds each monitor.step() took (--monitor)


def step(model, opt, args, i: int, count: bool = False,
         monitor: tieroffload.Monitor | None = None) -> tuple[float, float, float, int, int]:
    """(seconds, seconds in the forwards, loss, NVMe bytes read and written in the forwards) of
    training step ``i``; the bytes only with ``count`` (an offloaded model), else 0. A
    ``monitor`` makes (and writes) the step's record inside the time measured."""
    def moved() -> tuple[int, int]:
        if not count:
            return 0, 0
        st = tieroffload.stats(model)
        return st["bytes_read"]["nvme"], st["bytes_written"]["nvme"]

    t0 = time.perf_counter()
    forward, read, written = 0.0, 0, 0
    for micro in range(args.accumulate):
        x, y = token_batch(i * args.accumulate + micro, args.batch, args.seq, args.vocab)
        r0, w0 = moved()
        t = time.perf_counter()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / args.accumulate
        forward += time.perf_counter() - t
        r1, w1 = moved()
        read, written = read + r1 - r0, written + w1 - w0
        loss.backward()
    opt.step()
    opt.zero_grad()
    value = loss.item() * args.accumulate
    if monitor is not None:
        t = time.perf_counter()
        monitor.step(loss=value)
        MONITOR_S.append(time.perf_counter() - t)
    return time.perf_counter() - t0, forward, value, read, written


def _probe_worker(args, layer_counts: list[int], directory: str, conn) -> None:
    """The child of ResidentProbe: plain GPTs of each layer count, all in RAM; for each request,
    the fastest of ``args.probe_repeats`` steps of each after a warm-up (this machine's compute
    wanders by 2x between seconds; the fastest is the floor the offloaded step is held to) with
    its forwards' share, the peak RSS of those steps above the RSS before them, and the disk's
    read and write GB/s."""
    models = []
    for k in layer_counts:
        torch.manual_seed(0)
        model = GPT(args.vocab, args.d, k, 16, args.seq)
        models.append((model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)))
    i = 0
    while conn.recv():
        times, base = [], start_peak(torch.device("cpu"))
        for model, opt in models:
            runs = [step(model, opt, args, i + j)[:2] for j in range(args.probe_repeats + 1)]
            times.append(min(runs[1:]))
            i += len(runs)
        conn.send((times, peak_rss() - base, disk_gbps(directory, 1 << 30)))


class ResidentProbe:
    """The compute floor, measured in a child process between the offloaded steps, so that
    both see the machine as it is at that moment: a resident run of the whole GPT, or with
    ``--meta`` (a model too large for RAM) of ``--probe-layers`` blocks and twice that, the time
    per block from their difference, scaled to ``--layers``; then the disk's speed. The child's
    memory is its own: the offloaded process's RSS does not include it."""

    def __init__(self, args, directory: str) -> None:
        k = args.probe_layers
        self.counts = [k, 2 * k] if args.meta else [args.layers]
        self.layers = args.layers
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # A daemon: if the offloaded run raises, exit ends the child instead of waiting on it.
        self._proc = ctx.Process(target=_probe_worker, args=(args, self.counts, directory, child),
                                 daemon=True)
        self._proc.start()
        self.peak = 0

    def measure(self) -> tuple[float, float, float, float]:
        """(seconds of compute of one step of the whole GPT, of its forwards, read GB/s, write
        GB/s), now."""
        self._conn.send(True)
        times, peak, (read_gbps, write_gbps) = self._conn.recv()
        self.peak = max(self.peak, peak)
        if len(times) == 1:
            return *times[0], read_gbps, write_gbps
        (k1, k2), ((t1, f1), (t2, f2)) = self.counts, times
        scale = (self.layers - k1) / (k2 - k1)
        return t1 + (t2 - t1) * scale, f1 + (f2 - f1) * scale, read_gbps, write_gbps

    def close(self) -> None:
        self._conn.send(False)
        self._proc.join()


class PeakSampler:
    """Samples RSS every ``period`` s and keeps ``stats()["memory"]`` from the highest sample:
    where the peak went."""

    def __init__(self, model: torch.nn.Module, period: float = 0.2) -> None:
        self.model, self.period = model, period
        self.top, self.parts = 0, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            if rss() > self.top:
                self.parts = tieroffload.stats(self.model)["memory"]
                self.top = self.parts["rss"]

    def stop(self) -> str:
        self._stop.set()
        self._thread.join()
        return ", ".join(f"{k} {format_bytes(v)}" for k, v in self.parts.items() if k != "rss")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", default=None)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--d", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--budget", default="1GiB")
    p.add_argument("--prefetch", default=None,
                   help="units or a size such as 128MiB (default: the policy's, adaptive)")
    p.add_argument("--steps", type=int, default=3, help="measured steps (after one warm-up)")
    p.add_argument("--step-in-backward", action="store_true",
                   help='tieroffload.optimizer(overlap="backward"): each chunk steps during '
                        "backward")
    p.add_argument("--lend-core", action="store_true",
                   help="Policy(lend_core=True): compute lends a core to reads while behind them")
    p.add_argument("--checksum", action="store_true",
                   help="Policy(checksum=True): a CRC-32 of every unit written, checked on read")
    p.add_argument("--meta", action="store_true",
                   help="no resident run: build on the meta device and stream random weights "
                        "into NVMe (for a model whose training state exceeds RAM); the compute "
                        "is estimated from resident runs of a few blocks")
    p.add_argument("--probe-layers", type=int, default=2,
                   help="--meta: blocks in the smaller of the two resident runs")
    p.add_argument("--activations", default=None, choices=["cpu", "nvme"],
                   help="Policy(activations=...): where saved activations go")
    p.add_argument("--monitor", metavar="DIR",
                   help="a tieroffload.Monitor writes each measured step's record to "
                        "DIR/run.csv (its cost is inside the step times)")
    p.add_argument("--probe-repeats", type=int, default=3,
                   help="resident steps after each offloaded one (after a warm-up); the "
                        "fastest counts")
    args = p.parse_args()
    tmp = tempfile.TemporaryDirectory(dir=args.dir or ".", prefix="bench-train-")
    probe = ResidentProbe(args, tmp.name)

    torch.manual_seed(0)
    with torch.device("meta" if args.meta else "cpu"):
        model = GPT(args.vocab, args.d, args.layers, 16, args.seq)
    n = sum(q.numel() for q in model.parameters())
    print(f"GPT {args.layers}x{args.d}: {n / 1e6:.0f} M params; params {format_bytes(4 * n)}, "
          f"Adam state {format_bytes(8 * n)}, grads {format_bytes(4 * n)}")
    prefetch = {} if args.prefetch is None else {
        "prefetch": int(args.prefetch) if args.prefetch.isdigit() else args.prefetch}
    tieroffload.offload(model, tieroffload.Policy(
        params="nvme", optimizer="nvme", grads="nvme", nvme_dir=tmp.name, device="cpu",
        cpu_budget=args.budget, lend_core=args.lend_core, checksum=args.checksum,
        activations=args.activations, **prefetch))
    if args.meta:
        t0 = time.perf_counter()
        tieroffload.load_weights(model, RandomWeights(model))
        print(f"streamed random weights to NVMe in {time.perf_counter() - t0:.0f} s")
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=1e-4, fused=True,
                                **({"overlap": "backward", "accumulation_steps": args.accumulate}
                                   if args.step_in_backward else {}))
    step(model, opt, args, 0)
    probe.measure()  # the child's first steps run slow: not counted
    before = peak_rss()  # loading and the warm-up step
    base = start_peak(torch.device("cpu"))
    monitor = None
    if args.monitor:
        from tieroffload.monitor import CSVWriter

        os.makedirs(args.monitor, exist_ok=True)
        monitor = tieroffload.Monitor(model, opt, writers=[
            CSVWriter(os.path.join(args.monitor, "run.csv"))])
    st0 = tieroffload.stats(model)
    sampler = PeakSampler(model)
    rows = []
    for i in range(args.steps):
        st = tieroffload.stats(model)
        seconds, fwd, loss, fwd_read, fwd_written = step(model, opt, args, i + 1, count=True,
                                                         monitor=monitor)
        end = tieroffload.stats(model)
        compute, fwd_compute, read_gbps, write_gbps = probe.measure()
        read = end["bytes_read"]["nvme"] - st["bytes_read"]["nvme"]
        written = end["bytes_written"]["nvme"] - st["bytes_written"]["nvme"]
        fwd_io = fwd_read / 1e9 / read_gbps + fwd_written / 1e9 / write_gbps
        io = read / 1e9 / read_gbps + written / 1e9 / write_gbps
        rows.append((seconds, compute, io,
                     max(fwd_compute, fwd_io) + max(compute - fwd_compute, io - fwd_io)))
        print(f"step {i + 1}: {seconds:.1f} s, loss {loss:.4f}; forward {fwd:.2f} s, the rest "
              f"{seconds - fwd:.2f} s; then compute {fwd_compute:.2f} + "
              f"{compute - fwd_compute:.2f} s, I/O bound {fwd_io:.2f} + {io - fwd_io:.2f} s "
              f"(disk read {read_gbps:.2f} and write {write_gbps:.2f} GB/s)", flush=True)
    parts = sampler.stop()
    st = tieroffload.stats(model)
    peak = peak_rss()
    if monitor is not None:  # it starts a new peak at each step: the run's is its highest
        monitor.close()
        peak = max(peak, monitor.peak_rss)
    probe.close()
    opt.close()
    tieroffload.close(model, restore=False)
    tmp.cleanup()
    read = (st["bytes_read"]["nvme"] - st0["bytes_read"]["nvme"]) / args.steps
    written = (st["bytes_written"]["nvme"] - st0["bytes_written"]["nvme"]) / args.steps
    ratios = [s / max(c, b) for s, c, b, _ in rows]
    passes = [s / b for s, _, _, b in rows]
    print(f"per step: NVMe read {format_bytes(read)}, written {format_bytes(written)}; "
          f"I/O lower bound {statistics.median(r[2] for r in rows):.2f} s (median)")
    what = "compute (estimated)" if args.meta else "resident"
    print(f"step time, medians: {what} {statistics.median(r[1] for r in rows):.2f} s, "
          f"tieroffload {statistics.median(r[0] for r in rows):.2f} s; each step against the "
          f"compute and disk measured after it: {statistics.median(ratios):.2f}x max(compute, "
          f"I/O bound) ({', '.join(f'{x:.2f}' for x in ratios)}), "
          f"{statistics.median(passes):.2f}x the sum over forward and the rest of "
          f"max(compute, I/O bound) of each; "
          f"waited on I/O {(st['wait_s'] - st0['wait_s']) / args.steps:.2f} s/step"
          + (f"; a core lent at {(st['lent'] - st0['lent']) / args.steps:.0f} acquires/step"
             if args.lend_core else ""))
    print(f"peak RSS over the measured steps: {format_bytes(peak)} "
          f"({format_bytes(peak - base)} above the {format_bytes(base)} before them); "
          f"budget {format_bytes(st['budget'])}, staging {format_bytes(st['overhead'])}; "
          f"the whole run's peak {format_bytes(max(before, peak))}; the resident steps (in "
          f"their own process) peaked {format_bytes(probe.peak)} above theirs")
    print(f"at the highest sample, {format_bytes(sampler.top)}: {parts}")
    if MONITOR_S:
        print(f"monitor.step(), inside the step times: {statistics.median(MONITOR_S) * 1e3:.1f} "
              f"ms median, {max(MONITOR_S) * 1e3:.1f} ms at most")


if __name__ == "__main__":
    main()

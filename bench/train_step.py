"""One AdamW training step of a GPT whose parameters and Adam state total several GiB, in one
run: everything resident (the compute floor), then parameters, gradients and optimizer state on
NVMe under a CPU budget. Reports the I/O lower bound (bytes moved / the disk's read and write
GB/s measured here), step time / max(compute, I/O bound), and peak RSS.

    python bench/train_step.py --dir /mnt/nvme --layers 16 --d 1024 --budget 1GiB
"""

from __future__ import annotations

import argparse
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


def step(model, opt, args, i: int) -> tuple[float, float]:
    """(seconds, loss) of training step ``i``."""
    t0 = time.perf_counter()
    for micro in range(args.accumulate):
        x, y = token_batch(i * args.accumulate + micro, args.batch, args.seq, args.vocab)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / args.accumulate
        loss.backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t0, loss.item() * args.accumulate


def resident_compute(args, layers: int) -> float:
    """Seconds of a plain step of the same GPT with ``layers`` blocks, all in RAM: the fastest
    of five after a warm-up (this machine's compute wanders by 2x between seconds; the fastest
    is the floor the offloaded step is held to)."""
    torch.manual_seed(0)
    model = GPT(args.vocab, args.d, layers, 16, args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    times = [step(model, opt, args, i)[0] for i in range(6)]
    return min(times[1:])


def compute_estimate(args) -> float:
    """The compute of a step too large to run in RAM: two resident runs of a few blocks, the
    time per block from their difference, scaled to ``args.layers``."""
    k1, k2 = args.probe_layers, 2 * args.probe_layers
    t1, t2 = resident_compute(args, k1), resident_compute(args, k2)
    per_block = (t2 - t1) / (k2 - k1)
    print(f"resident steps of {k1} and {k2} blocks: {t1:.2f} s, {t2:.2f} s "
          f"({per_block:.2f} s a block)")
    return t1 + per_block * (args.layers - k1)


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
    args = p.parse_args()
    tmp = tempfile.TemporaryDirectory(dir=args.dir or ".", prefix="bench-train-")

    read_gbps, write_gbps = disk_gbps(tmp.name, 1 << 30)
    torch.manual_seed(0)
    with torch.device("meta" if args.meta else "cpu"):
        model = GPT(args.vocab, args.d, args.layers, 16, args.seq)
    n = sum(q.numel() for q in model.parameters())
    print(f"GPT {args.layers}x{args.d}: {n / 1e6:.0f} M params; params {format_bytes(4 * n)}, "
          f"Adam state {format_bytes(8 * n)}, grads {format_bytes(4 * n)}")
    print(f"disk here: read {read_gbps:.2f} GB/s, write {write_gbps:.2f} GB/s")

    resident = None
    if not args.meta:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        step(model, opt, args, 0)
        base, times = start_peak(torch.device("cpu")), []
        for i in range(args.steps):
            times.append(step(model, opt, args, i + 1)[0])
        resident = statistics.median(times)
        resident_peak = peak_rss() - base
        del opt
        state0 = {k: v.clone() for k, v in model.state_dict().items()}
        torch.manual_seed(0)
        model = GPT(args.vocab, args.d, args.layers, 16, args.seq)
        model.load_state_dict(state0)
        del state0
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
    before = peak_rss()  # loading and the warm-up step
    base = start_peak(torch.device("cpu"))
    st0 = tieroffload.stats(model)
    sampler = PeakSampler(model)
    times = []
    for i in range(args.steps):
        seconds, loss = step(model, opt, args, i + 1)
        times.append(seconds)
        print(f"step {i + 1}: {seconds:.1f} s, loss {loss:.4f}", flush=True)
    parts = sampler.stop()
    st = tieroffload.stats(model)
    peak = peak_rss()
    opt.close()
    tieroffload.close(model, restore=False)
    tmp.cleanup()
    if args.meta:  # after the offloaded run, so that its peak is its own
        resident = compute_estimate(args)
    ours = statistics.median(times)
    read = (st["bytes_read"]["nvme"] - st0["bytes_read"]["nvme"]) / args.steps
    written = (st["bytes_written"]["nvme"] - st0["bytes_written"]["nvme"]) / args.steps
    io_bound = read / 1e9 / read_gbps + written / 1e9 / write_gbps
    print(f"per step: NVMe read {format_bytes(read)}, written {format_bytes(written)}; "
          f"I/O lower bound {io_bound:.2f} s")
    floor = max(resident, io_bound)
    what = "compute (estimated)" if args.meta else "resident"
    print(f"step time: {what} {resident:.2f} s, "
          f"tieroffload {ours:.2f} s ({ours / floor:.2f}x max(compute, I/O bound)); "
          f"waited on I/O {(st['wait_s'] - st0['wait_s']) / args.steps:.2f} s/step"
          + (f"; a core lent at {(st['lent'] - st0['lent']) / args.steps:.0f} acquires/step"
             if args.lend_core else ""))
    print(f"peak RSS over the measured steps: {format_bytes(peak)} "
          f"({format_bytes(peak - base)} above the {format_bytes(base)} before them); "
          f"budget {format_bytes(st['budget'])}, staging {format_bytes(st['overhead'])}; "
          f"the whole run's peak {format_bytes(max(before, peak))}"
          + ("" if args.meta else
             f"; the resident steps peaked {format_bytes(resident_peak)} above theirs "
             "(activations, gradients and temporaries)"))
    print(f"at the highest sample, {format_bytes(sampler.top)}: {parts}")


if __name__ == "__main__":
    main()

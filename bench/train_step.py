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
import time

import torch
import torch.nn.functional as F

import tieroffload
from tieroffload.aio.throughput import disk_gbps
from tieroffload.testing.models import GPT, token_batch
from tieroffload.utils.memory import peak_rss, start_peak
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
                        "into NVMe (for a model whose training state exceeds RAM)")
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
        cpu_budget=args.budget, lend_core=args.lend_core, checksum=args.checksum, **prefetch))
    if args.meta:
        t0 = time.perf_counter()
        tieroffload.load_weights(model, RandomWeights(model))
        print(f"streamed random weights to NVMe in {time.perf_counter() - t0:.0f} s")
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=1e-4,
                                **({"overlap": "backward", "accumulation_steps": args.accumulate}
                                   if args.step_in_backward else {}))
    step(model, opt, args, 0)
    base = start_peak(torch.device("cpu"))
    st0 = tieroffload.stats(model)
    times = []
    for i in range(args.steps):
        seconds, loss = step(model, opt, args, i + 1)
        times.append(seconds)
        print(f"step {i + 1}: {seconds:.1f} s, loss {loss:.4f}", flush=True)
    st = tieroffload.stats(model)
    peak = peak_rss()
    ours = statistics.median(times)
    read = (st["bytes_read"]["nvme"] - st0["bytes_read"]["nvme"]) / args.steps
    written = (st["bytes_written"]["nvme"] - st0["bytes_written"]["nvme"]) / args.steps
    io_bound = read / 1e9 / read_gbps + written / 1e9 / write_gbps
    print(f"per step: NVMe read {format_bytes(read)}, written {format_bytes(written)}; "
          f"I/O lower bound {io_bound:.2f} s")
    floor = io_bound if resident is None else max(resident, io_bound)
    print(f"step time: resident {'-' if resident is None else f'{resident:.2f} s'}, "
          f"tieroffload {ours:.2f} s ({ours / floor:.2f}x max(compute, I/O bound)); "
          f"waited on I/O {(st['wait_s'] - st0['wait_s']) / args.steps:.2f} s/step"
          + (f"; a core lent at {(st['lent'] - st0['lent']) / args.steps:.0f} acquires/step"
             if args.lend_core else ""))
    print(f"peak RSS over the measured steps: {format_bytes(peak)} "
          f"({format_bytes(peak - base)} above the {format_bytes(base)} before them); "
          f"budget {format_bytes(st['budget'])}, staging {format_bytes(st['overhead'])}"
          + ("" if resident is None else
             f"; the resident steps peaked {format_bytes(resident_peak)} above theirs "
             "(activations, gradients and temporaries)"))
    opt.close()
    tieroffload.close(model, restore=False)
    tmp.cleanup()


if __name__ == "__main__":
    main()

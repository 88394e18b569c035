"""The host step on a GPU, side by side in one run: a bf16 GPT trained with AdamW fully resident
on the GPU (where it fits), then with its fp32 masters and AdamW state in pinned RAM
(optimizer="cpu"), ZeRO-Offload's placement (params and gradients paged to pinned RAM too:
"cpu +grads") and on NVMe (optimizer="nvme"). Reports step time, tokens/s, GPU and host peak
memory, pinned memory, the GPU's busy share of one more step (torch.profiler), and the bounds
the step cannot beat: PCIe (bytes moved / the link's GB/s measured here from pinned memory),
host Adam (a fused CPU AdamW step timed here, scaled) and NVMe (state bytes / the disk's GB/s
measured here); step / max(compute, bounds).
Also the link: pinned host<->device GB/s against a plain ``tensor.to(non_blocking=True)``.

    python bench/gpu_step.py --dir /mnt/nvme --layers 24 --d 2048 --json out.json
    python bench/gpu_step.py --device cpu --layers 2 --d 128   # the same code, on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

import tieroffload
from tieroffload.aio.buffers import aligned_empty
from tieroffload.aio.throughput import disk_gbps
from tieroffload.testing.models import GPT, token_batch
from tieroffload.utils.memory import peak_rss, reset_peak_rss
from tieroffload.utils.sizes import format_bytes


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def link_gbps(device: torch.device, nbytes: int) -> dict[str, float]:
    """Host-to-device and device-to-host GB/s, pinned and pageable (median of 5)."""
    if device.type != "cuda":
        return {}
    out = {}
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for name, host in (("pinned", aligned_empty(nbytes, pin=True)),
                       ("pageable", torch.empty(nbytes, dtype=torch.uint8))):
        for way in ("h2d", "d2h"):
            times = []
            for _ in range(5):
                sync(device)
                t = time.perf_counter()
                if way == "h2d":
                    dev.copy_(host, non_blocking=True)
                else:
                    host.copy_(dev, non_blocking=True)
                sync(device)
                times.append(time.perf_counter() - t)
            out[f"{way}_{name}"] = nbytes / statistics.median(times) / 1e9
    return out


def host_adam_s_per_param(n: int = 1 << 24) -> float:
    """Seconds a fused CPU AdamW step takes per parameter (fp32 masters)."""
    p = torch.nn.Parameter(torch.zeros(n))
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    opt.step()
    t = time.perf_counter()
    for _ in range(3):
        opt.step()
    return (time.perf_counter() - t) / 3 / n


def union_length(spans: list[tuple[float, float]]) -> float:
    """The length covered by the union of (start, end) intervals (overlaps counted once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def gpu_busy_share(step: Callable[[], object], device: torch.device) -> float | None:
    """The share of one step's wall time in which the GPU ran kernels or copies (the union of
    their intervals, from torch.profiler); None off CUDA."""
    if device.type != "cuda":
        return None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        sync(device)
        t = time.perf_counter()
        step()
        sync(device)
        wall = time.perf_counter() - t
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA]  # microseconds
    return union_length(spans) * 1e-6 / wall


def run(args: argparse.Namespace, device: torch.device, optimizer: str | None,
        paged_grads: bool = False) -> dict:
    """Warm-up, then ``args.steps`` timed steps; ``optimizer`` None is the resident run;
    ``paged_grads``: parameters paged from pinned RAM and gradients paged to it during
    backward (``params="cpu", grads="cpu"``), else both stay on the GPU."""
    torch.manual_seed(0)
    with device:  # initialised where it computes: no fp32 copy of a large model in host RAM
        model = GPT(args.vocab, args.d, args.layers, max(1, args.d // 64), args.seq)
    model = model.to(torch.bfloat16)
    if optimizer is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    else:
        on_gpu = "gpu" if device.type == "cuda" and not paged_grads else "cpu"
        tieroffload.offload(model, tieroffload.Policy(
            params=on_gpu, optimizer=optimizer, grads=on_gpu, device=str(device),
            nvme_dir=args.dir))
        opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=1e-4)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    reset_peak_rss()

    def one_step(step: int) -> torch.Tensor:
        x, y = (t.to(device) for t in token_batch(step, args.batch, args.seq, args.vocab))
        loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    times, losses = [], []
    for step in range(args.steps + 1):
        sync(device)
        t = time.perf_counter()
        loss = one_step(step)
        sync(device)
        if step:
            times.append(time.perf_counter() - t)
        losses.append(loss.item())
    busy = gpu_busy_share(lambda: one_step(args.steps + 1), device)  # one more, profiled
    n = sum(p.numel() for p in model.parameters())
    name = (optimizer or "resident") + (" +grads" if paged_grads else "")
    res = dict(optimizer=name, params=n, step_s=statistics.median(times),
               losses=losses, host_peak=peak_rss(), gpu_busy=busy,
               gpu_peak=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0)
    if optimizer is not None:
        res["pinned"] = tieroffload.stats(model)["pinned"]
        opt.close()
        tieroffload.close(model, restore=False)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dir", default=None, help="NVMe scratch directory")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-resident", action="store_true", help="the model does not fit")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    args.dir = args.dir or tempfile.mkdtemp()
    link = link_gbps(device, 256 << 20)
    read, write = disk_gbps(args.dir, 64 << 20)
    disk = {"read": read, "write": write}
    adam = host_adam_s_per_param()
    print(f"GPT {args.layers} x {args.d}, bf16, on {device}")
    if link:
        print("link GB/s: " + ", ".join(f"{k} {v:.1f}" for k, v in link.items()))
    print(f"disk GB/s: read {disk['read']:.2f}, write {disk['write']:.2f}; host AdamW "
          f"{adam * 1e9:.2f} ns/parameter", flush=True)
    runs: list[tuple[str | None, bool]] = [] if args.no_resident else [(None, False)]
    runs.append(("cpu", False))
    if device.type == "cuda":  # ZeRO-Offload's placement: only working copies on the GPU
        runs.append(("cpu", True))
    runs.append(("nvme", False))  # last: the disk's speed is the least known
    rows: list[dict] = []
    for optimizer, paged_grads in runs:
        r = run(args, device, optimizer, paged_grads)
        compute = rows[0]["step_s"] if rows and rows[0]["optimizer"] == "resident" else 0.0
        add_bounds(r, compute, link, disk, adam, args.batch * args.seq)
        rows.append(r)
        report(r)
        if args.json:  # after each row: a run cut short keeps the rows before it
            with open(args.json, "w") as f:
                json.dump(dict(link=link, disk=disk, adam_s_per_param=adam, rows=rows), f,
                          indent=1)


def add_bounds(r: dict, compute: float, link: dict[str, float], disk: dict[str, float],
               adam: float, tokens: int) -> None:
    """Adds to a row the times its step cannot beat (compute: the resident step), the step
    against the largest of them, and tokens/s."""
    n = r["params"]
    bounds = {"compute": compute}
    if r["optimizer"] != "resident":
        if link and r["optimizer"].endswith("+grads"):
            # bf16 gradients out; bf16 parameters in for forward and for backward
            bounds["pcie"] = n * 2 / (link["d2h_pinned"] * 1e9) + \
                n * 4 / (link["h2d_pinned"] * 1e9)
        elif link:  # fp32 gradients out, bf16 working copies back
            bounds["pcie"] = n * 4 / (link["d2h_pinned"] * 1e9) + \
                n * 2 / (link["h2d_pinned"] * 1e9)
        bounds["host_adam"] = n * adam
    if r["optimizer"].startswith("nvme"):  # masters and two moments read and written
        bounds["nvme"] = n * 12 / (disk["read"] * 1e9) + n * 12 / (disk["write"] * 1e9)
    r["bounds"] = bounds
    r["vs_bound"] = r["step_s"] / max(bounds.values()) if max(bounds.values()) else None
    r["tokens_per_s"] = tokens / r["step_s"]


def report(r: dict) -> None:
    vs = f"{r['vs_bound']:.2f}x" if r["vs_bound"] else "-"
    busy = "-" if r["gpu_busy"] is None else f"{r['gpu_busy']:.0%}"
    print(f"{r['optimizer']:>9}: step {r['step_s']:.3f} s ({vs} of the bound "
          f"{max(r['bounds'].values()):.3f} s), {r['tokens_per_s']:.0f} tok/s, "
          f"{r['params'] / 1e6:.1f} M parameters, GPU peak {format_bytes(r['gpu_peak'])}, "
          f"host peak {format_bytes(r['host_peak'])}, pinned "
          f"{format_bytes(r.get('pinned', 0))}, GPU busy {busy}, losses {r['losses'][0]:.4f}"
          f"->{r['losses'][-1]:.4f}", flush=True)

if __name__ == "__main__":
    main()

"""Peak memory and step time of one forward and backward of a long-sequence GPT, in one run,
interleaved: activations resident, offloaded to "cpu" and to "nvme" by tieroffload, and saved
with ``torch.autograd.graph.save_on_cpu``. On a machine without a GPU the "cpu" tier and
save_on_cpu move from RAM to RAM: they can save nothing there, and the table shows what they
cost.

    python bench/activations.py --dir /mnt/nvme --seq 2048 --layers 6 --batch 2
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

import tieroffload
from tieroffload.testing.models import GPT, token_batch
from tieroffload.utils.memory import peak_rss, reset_peak_rss, return_freed_memory, rss
from tieroffload.utils.sizes import format_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=".", help="directory for the NVMe tier (default: .)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if not reset_peak_rss():
        raise SystemExit("this bench needs /proc/self/clear_refs to measure peak memory")
    return_freed_memory()
    torch.manual_seed(0)
    vocab = 512
    base = GPT(vocab, args.d, args.layers, args.heads, args.seq)
    x, y = token_batch(0, args.batch, args.seq, vocab)
    print(f"GPT {args.layers}x{args.d}, sequence {args.seq}, batch {args.batch}, "
          f"threads {torch.get_num_threads()}")

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-act-") as scratch:
        models = {
            "resident": (base, contextlib.nullcontext),
            "tieroffload cpu": (tieroffload.offload(copy.deepcopy(base), tieroffload.Policy(
                device="cpu", activations="cpu")), contextlib.nullcontext),
            "tieroffload nvme": (tieroffload.offload(copy.deepcopy(base), tieroffload.Policy(
                device="cpu", activations="nvme", nvme_dir=scratch, prefetch="256MiB")),
                contextlib.nullcontext),
            "save_on_cpu": (base, torch.autograd.graph.save_on_cpu),
        }
        times: dict[str, list[float]] = {k: [] for k in models}
        peaks: dict[str, list[int]] = {k: [] for k in models}
        losses: dict[str, float] = {}
        for _ in range(args.repeats + 1):  # the first round warms up and is not counted
            for name, (model, ctx) in models.items():
                model.zero_grad(set_to_none=True)
                before = rss()
                reset_peak_rss()
                t0 = time.perf_counter()
                with ctx():
                    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                loss.backward()
                times[name].append(time.perf_counter() - t0)
                peaks[name].append(peak_rss() - before)
                losses[name] = loss.item()
        offloaded = tieroffload.stats(models["tieroffload nvme"][0])["activations"]
        for model, _ in models.values():
            if getattr(model, "_tieroffload", None) is not None:
                tieroffload.close(model)

    floor_t = statistics.median(times["resident"][1:])
    floor_m = statistics.median(peaks["resident"][1:])
    print(f"{'':18} {'step s':>8} {'/resident':>9} {'peak above start':>17} {'/resident':>9}"
          f" {'loss':>8}")
    for name in models:
        t = statistics.median(times[name][1:])
        m = statistics.median(peaks[name][1:])
        print(f"{name:18} {t:8.2f} {t / floor_t:9.2f} {format_bytes(m):>17} {m / floor_m:9.2f}"
              f" {losses[name]:8.4f}")
    rounds = args.repeats + 1
    print(f"nvme tier per step: {offloaded['offloaded'] // rounds} tensors, "
          f"{format_bytes(offloaded['bytes_written'] // rounds)} written, "
          f"{format_bytes(offloaded['bytes_read'] // rounds)} read back, "
          f"waited {offloaded['wait_s'] / rounds:.3f} s")


if __name__ == "__main__":
    main()

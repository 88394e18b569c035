"""Train a GPT-style transformer built from code with its parameters, gradients and AdamW state
on NVMe, under a CPU budget far smaller than the training state.

    python examples/train_gpt.py                      # embedded defaults: ./scratch, 8 MiB budget
    python examples/train_gpt.py --dir /mnt/nvme --layers 12 --d 768 --budget 256MiB
    python examples/train_gpt.py --monitor runs/gpt     # + run.csv, TensorBoard, dashboard.png
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

import torch
from tqdm import tqdm

import tieroffload
from tieroffload.testing.models import GPT, token_batch
from tieroffload.utils.memory import peak_rss
from tieroffload.utils.sizes import format_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", default="scratch", help="NVMe scratch directory (default ./scratch)")
    p.add_argument("--budget", default="8MiB", help="CPU budget for resident parameters")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
    p.add_argument("--step-in-backward", action="store_true",
                   help='overlap="backward": each chunk steps during the last micro-batch\'s '
                        "backward, as soon as its gradients are final")
    p.add_argument("--monitor", metavar="DIR",
                   help="write a record per step to DIR/run.csv (and TensorBoard's DIR/tb "
                        "where tensorboard is installed), the dashboard DIR/dashboard.png and "
                        "the trace of step 3, DIR/trace_step3.json")
    p.add_argument("--disk", metavar="NVME.json",
                   help="tieroffload-bench nvme --json output: the disk's GB/s on the dashboard")
    args = p.parse_args()

    created = not os.path.isdir(args.dir)
    os.makedirs(args.dir, exist_ok=True)
    torch.manual_seed(0)
    model = GPT(args.vocab, args.d, args.layers, 4, args.seq)
    nparams = sum(q.numel() for q in model.parameters())
    policy = tieroffload.Policy(params="nvme", optimizer="nvme", grads="nvme",
                                nvme_dir=args.dir, device="cpu", cpu_budget=args.budget)
    tieroffload.offload(model, policy)
    in_backward = {"overlap": "backward", "accumulation_steps": args.accumulate}
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=3e-3, weight_decay=0.1,
                                **(in_backward if args.step_in_backward else {}))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    monitor = make_monitor(args, model, opt) if args.monitor else None
    print(f"GPT {args.layers}x{args.d}: {nparams / 1e6:.1f} M parameters, training state "
          f"{format_bytes(16 * nparams)} (params, grads, AdamW) on NVMe in {args.dir}/, "
          f"CPU budget {args.budget}")
    tokens, t0, losses = 0, time.perf_counter(), []
    try:
        bar = tqdm(range(args.steps), unit="step")
        for step in bar:
            for micro in range(args.accumulate):
                x, y = token_batch(step * args.accumulate + micro, args.batch, args.seq,
                                   args.vocab)
                loss = torch.nn.functional.cross_entropy(
                    model(x).flatten(0, 1), y.flatten()) / args.accumulate
                loss.backward()
                losses.append(loss.item() * args.accumulate)
                tokens += x.numel()
            opt.step()
            sched.step()
            opt.zero_grad()
            if monitor is not None:
                monitor.step(loss=sum(losses[-args.accumulate:]) / args.accumulate)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        seconds = time.perf_counter() - t0
        st = tieroffload.stats(model)
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} | {tokens / seconds:,.0f} tokens/s | "
              f"NVMe read {format_bytes(st['bytes_read']['nvme'])}, written "
              f"{format_bytes(st['bytes_written']['nvme'])} | waited on I/O {st['wait_s']:.1f} s")
        # The monitor starts a new peak at each step: the run's is the highest of its steps'.
        peak = peak_rss() if monitor is None else max(monitor.peak_rss, peak_rss())
        print(f"peak resident parameters {format_bytes(st['peak_resident'])} (budget "
              f"{format_bytes(st['budget'])}) | peak RSS {format_bytes(peak)}")
        if monitor is not None:
            monitor.close()
            from tieroffload.cli.bench.report_plot import plot_dashboard

            plot_dashboard(os.path.join(args.monitor, "run.csv"),
                           os.path.join(args.monitor, "dashboard.png"))
            print(f"monitor: {args.monitor}/run.csv, dashboard.png, trace_step3.json")
    finally:
        tieroffload.close(model, restore=False)  # its optimizer and swap space too
        if created:
            shutil.rmtree(args.dir, ignore_errors=True)


def make_monitor(args: argparse.Namespace, model: torch.nn.Module,
                 opt: torch.optim.Optimizer) -> tieroffload.Monitor:
    from tieroffload.monitor import CSVWriter, TensorBoardWriter

    os.makedirs(args.monitor, exist_ok=True)
    writers = [CSVWriter(os.path.join(args.monitor, "run.csv"))]
    try:
        writers.append(TensorBoardWriter(os.path.join(args.monitor, "tb")))
    except ImportError:
        pass  # the CSV and the dashboard do without
    return tieroffload.Monitor(model, opt, writers=writers, trace_steps=[3],
                               trace_dir=args.monitor, disk=args.disk)


if __name__ == "__main__":
    main()

"""One DeepSpeed config, one GPT, one token stream, through ``deepspeed.initialize`` and
``tieroffload.initialize`` in one run: the loss, learning rate and gradient norm of every
optimizer step of both, the largest relative loss difference, and a PNG of both loss curves and
both learning-rate curves.

    python bench/vs_deepspeed_curves.py --dir DIR --deepspeed-python DSVENV/bin/python \\
        --steps 20 --png curves.png --json curves.json

The config is ``article_config`` of ``tieroffload/testing/deepspeed.py``, the one
``examples/deepspeed_config.py`` runs (ZeRO-3, parameters and optimizer state on NVMe, CPU
activation checkpointing, WarmupLR, bf16, accumulation 2, clipping 1.0), written once as JSON
and read by both, unchanged: DeepSpeed 0.19.8 runs it on its CPU accelerator as it is (with bf16
on, the fp32/bf16 mix-up that ``vs_deepspeed.py`` works around cannot arise). Only
``--max-live`` changes it, for both: the example's ``stage3_max_live_parameters`` 5e5 is below
one layer of a larger GPT, which tieroffload
refuses as a budget (DeepSpeed fetches the module regardless).

Each contender runs in a fresh process: tieroffload in this Python, DeepSpeed in
``--deepspeed-python`` (CPU accelerator, gloo, one process, DeepSpeed's CPU Adam), which needs
neither tieroffload installed nor matplotlib: the model comes from
``tieroffload/testing/models.py`` by file, as in ``vs_deepspeed.py``. The training loop is
the example's, the same for both: every micro-batch ``engine.backward(loss)`` and
``engine.step()``; a step's loss is the mean of its micro-batches' and its learning rate is
``engine.get_lr()`` read before it (the rate the step applies).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vs_deepspeed import load_file, one_rank, peak_rss  # beside this file

ROOT = Path(__file__).resolve().parent.parent


def deepspeed_engine(model, config: str):
    import deepspeed
    one_rank()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    return engine


def worker(args) -> None:
    """One contender, in this process; prints one RESULT line of JSON."""
    import torch
    import torch.nn.functional as F
    models = load_file("gpt_models", ROOT / "tieroffload" / "testing" / "models.py")
    layers, d = map(int, args.size.split("x"))
    torch.manual_seed(0)
    model = models.GPT(vocab=args.vocab, d=d, layers=layers, heads=args.heads, seq=args.seq)
    params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    if args.worker == "deepspeed":
        engine = deepspeed_engine(model, args.config)
    else:
        import tieroffload
        engine, *_ = tieroffload.initialize(model=model, config=args.config)
    init_s = time.perf_counter() - t0
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    steps = []
    for step in range(args.steps):
        lr = float(engine.get_lr()[0])
        t0 = time.perf_counter()
        losses = []
        for m in range(gas):
            x, y = models.token_batch(step * gas + m, micro, args.seq, args.vocab)
            loss = F.cross_entropy(engine(x).float().view(-1, args.vocab), y.reshape(-1))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        norm = engine.get_global_grad_norm()
        steps.append({"loss": statistics.fmean(losses), "lr": lr,
                      "grad_norm": None if norm is None else float(norm),
                      "time_s": time.perf_counter() - t0})
    if args.worker != "deepspeed":
        import tieroffload
        tieroffload.close(engine.module, restore=False)
    print("RESULT " + json.dumps({"params": params, "init_s": init_s, "steps": steps,
                                  "peak_rss": peak_rss()}), flush=True)


def contend(args, who: str, python: str, config: str) -> dict:
    cmd = [python, __file__, "--worker", who, "--config", config]
    for k in ("size", "vocab", "seq", "heads", "steps"):
        cmd += [f"--{k}", str(getattr(args, k))]
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    sys.stderr.write(out.stderr[-4000:])
    tail = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"error": tail[:300]}


def plot(results: dict, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(12, 3.4))
    for who, style in (("tieroffload", "-o"), ("deepspeed", "--x")):
        r = results.get(who, {})
        if "steps" not in r:
            continue
        x = range(1, len(r["steps"]) + 1)
        ax1.plot(x, [s["loss"] for s in r["steps"]], style, ms=3, label=who)
        ax2.plot(x, [s["lr"] for s in r["steps"]], style, ms=3, label=who)
    a, b = (results.get(w, {}).get("steps") for w in ("tieroffload", "deepspeed"))
    if a and b:
        rel = [abs(s["loss"] - t["loss"]) / abs(t["loss"]) for s, t in zip(a, b)]
        ax3.plot(range(1, len(rel) + 1), [max(r, 1e-9) for r in rel], "-s", ms=3, color="k")
        ax3.set_yscale("log")
    ax1.set(xlabel="optimizer step", ylabel="loss (mean of the micro-batches)")
    ax2.set(xlabel="optimizer step", ylabel="learning rate applied")
    ax3.set(xlabel="optimizer step", ylabel="relative loss difference (0 drawn at 1e-9)")
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
    ax1.legend()
    ax2.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", default=".", help="NVMe scratch directory (the config's nvme_path)")
    p.add_argument("--deepspeed-python", default=None, help="a Python where deepspeed imports")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--size", default="2x128", help="GPT LAYERSxWIDTH (the example's: 2x128)")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--max-live", type=float, default=None,
                   help="stage3_max_live_parameters for both (the example's: 5e5)")
    p.add_argument("--png", default=None, help="write both curves here")
    p.add_argument("--json", default=None, help="write every step of both here")
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    example = load_file("deepspeed_article", ROOT / "tieroffload" / "testing" / "deepspeed.py")
    scratch = tempfile.mkdtemp(dir=args.dir, prefix="vs-curves-")
    results: dict[str, dict] = {}
    try:
        nvme = os.path.join(scratch, "nvme")
        config = example.article_config(nvme)
        changed = []
        if args.max_live is not None:  # for both: the example's 5e5 is below one layer's size
            config["zero_optimization"]["stage3_max_live_parameters"] = args.max_live
            changed.append(f"stage3_max_live_parameters {args.max_live:g} (--max-live, both)")
        config_path = os.path.join(scratch, "ds_config.json")
        with open(config_path, "w") as f:
            json.dump(config, f, indent=1)
        print("the example's config (article_config), changed: "
              + ("; ".join(changed) or "nothing"))
        ds = args.deepspeed_python or sys.executable
        contenders = [("tieroffload", sys.executable)]
        if subprocess.run([ds, "-c", "import deepspeed"], capture_output=True,
                          env=dict(os.environ, DS_ACCELERATOR="cpu")).returncode == 0:
            contenders.append(("deepspeed", ds))
        else:
            print("DeepSpeed: does not import here (--deepspeed-python); tieroffload alone")
        for who, python in contenders:
            shutil.rmtree(nvme, ignore_errors=True)
            os.makedirs(nvme)
            results[who] = contend(args, who, python, config_path)
            r = results[who]
            print(f"{who}: " + (r["error"] if "error" in r else
                                f"{r['params'] / 1e6:.2f} M params, init {r['init_s']:.1f} s"),
                  flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    a, b = (results.get(w, {}).get("steps") for w in ("tieroffload", "deepspeed"))
    print(f"\nGPT {args.size}, vocab {args.vocab}, seq {args.seq}; {args.steps} optimizer steps")
    print("| step | tieroffload loss | deepspeed loss | rel. diff | tieroffload lr | "
          "deepspeed lr | tieroffload grad norm | deepspeed grad norm |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    worst = lr_diff = None
    for i in range(max(len(a or []), len(b or []))):
        s = a[i] if a and i < len(a) else {}
        t = b[i] if b and i < len(b) else {}
        rel = (abs(s["loss"] - t["loss"]) / abs(t["loss"])) if s and t else None
        if rel is not None and (worst is None or rel > worst[1]):
            worst = (i + 1, rel)
        if s and t and s["lr"] != t["lr"]:
            lr_diff = max(lr_diff or 0.0, abs(s["lr"] - t["lr"]))
        f = lambda v, fmt: "" if v is None else format(v, fmt)  # noqa: E731
        print(f"| {i + 1} | {f(s.get('loss'), '.5f')} | {f(t.get('loss'), '.5f')} | "
              f"{f(rel, '.2e')} | {f(s.get('lr'), '.4e')} | {f(t.get('lr'), '.4e')} | "
              f"{f(s.get('grad_norm'), '.4f')} | {f(t.get('grad_norm'), '.4f')} |")
    for who, r in results.items():
        if "steps" in r:
            med = statistics.median(s["time_s"] for s in r["steps"][1:] or r["steps"])
            print(f"{who}: median step {med:.3f} s (after the first), init {r['init_s']:.1f} s, "
                  f"peak RSS {r['peak_rss'] / (1 << 20):.0f} MiB")
    if worst:
        print(f"largest relative loss difference: {worst[1]:.2e} (step {worst[0]})")
    if a and b:
        print("learning rates: " + ("equal at every step" if lr_diff is None
                                    else f"differ, by up to {lr_diff}"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("worker",)},
                       "config_changes": changed, "results": results,
                       "largest_rel_loss_diff": worst}, f, indent=1)
    if args.png:
        plot(results, args.png, f"GPT {args.size}, vocab {args.vocab}: the same DeepSpeed "
             "config through deepspeed.initialize and tieroffload.initialize")


if __name__ == "__main__":
    main()

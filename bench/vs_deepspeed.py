"""tieroffload beside DeepSpeed ZeRO-3 (``offload_param`` and ``offload_optimizer`` on NVMe) on
the same GPT, the same token stream, the same initial weights and the same AdamW, interleaved
in one run (rounds x sizes x contenders, each run in a fresh process): step time, peak RSS,
bytes the process read and wrote on disk (``/proc/self/io``, the same count for both), the
first and last losses, and with ``--cap`` whether it finishes inside a memory cgroup of that
size.

    python bench/vs_deepspeed.py --dir /mnt/nvme --sizes 6x1024,16x1024
    python bench/vs_deepspeed.py --dir /mnt/nvme --deepspeed-python /opt/ds/bin/python --cap 4GiB

DeepSpeed runs where ``deepspeed`` imports in ``--deepspeed-python`` (default: this Python),
on its CPU accelerator with gloo in one process: ZeRO-3, both offloads on NVMe, DeepSpeed's
CPU Adam, and the settings ``deepspeed_config`` below lists (those DeepSpeed needs changed
from its defaults to run at all here). The model is partitioned by ``deepspeed.zero.Init``
with the config before ``deepspeed.initialize``: left to ``initialize``, DeepSpeed 0.19.8 swaps
fp32 parameters through bf16 buffers on a CPU without mkldnn fp16 and stops with "expected m1
and m2 to have the same dtype" (see ``run_deepspeed``). Its
``async_io`` op needs libaio's headers and builds on first use (minutes). tieroffload runs
with ``Policy(params="nvme", optimizer="nvme", grads="nvme")`` under ``--budget``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MiB, GiB = 1 << 20, 1 << 30


def load_file(name: str, path: Path):
    """A module of tieroffload's loaded from its file, so that a DeepSpeed environment without
    tieroffload installed uses the same code."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_models():
    """The GPT and token stream of ``tieroffload.testing.models``."""
    mod = load_file("gpt_models", ROOT / "tieroffload" / "testing" / "models.py")
    return mod.GPT, mod.token_batch


def one_rank() -> None:
    """A process group of this one process (gloo), as DeepSpeed needs one."""
    import torch.distributed as dist
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(29500 + os.getpid() % 1000)),
                 ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)


def io_bytes() -> tuple[int, int]:
    """(bytes read, bytes written) by this process at the storage layer."""
    with open("/proc/self/io") as f:
        d = dict(line.split(": ") for line in f.read().splitlines())
    return int(d["read_bytes"]), int(d["write_bytes"])


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def deepspeed_config(args, largest: int) -> dict:
    """ZeRO-3 with parameters and optimizer state on NVMe. Raised or set from DeepSpeed's
    defaults because it does not run without them here (DeepSpeed 0.19.8, one CPU process):
    ``buffer_size`` to the largest parameter (every partition must fit one buffer; the default
    1e8 elements with 5 buffers pins 2 GB and at 6x1024 kept every parameter off NVMe,
    ``max_in_cpu`` 1e9 holding them in RAM), ``max_in_cpu`` 0, ``stage3_max_reuse_distance``
    0 and ``sub_group_size`` 2e7 (at 16x1024 the defaults stop with "Not enough buffers 0 for
    swapping 1" whatever the buffer count)."""
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": args.nvme, "pin_memory": True,
                              "buffer_count": 5, "buffer_size": largest, "max_in_cpu": 0},
            "offload_optimizer": {"device": "nvme", "nvme_path": args.nvme, "pin_memory": True,
                                  "buffer_count": 4},
            "stage3_max_reuse_distance": 0,
            "sub_group_size": int(2e7),
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1,
                "single_submit": False, "overlap_events": True},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def run_deepspeed(args, model, batches) -> tuple[list[float], list[float]]:
    import deepspeed
    import torch.nn.functional as F
    one_rank()
    config = deepspeed_config(args, max(p.numel() for p in model.parameters()))
    # Partition first, in the config's precision (fp32 here). Left to deepspeed.initialize, the
    # model is partitioned with ``dtype=`` its fp32 parameters, and DeepSpeed 0.19.8's
    # ``_set_dtype`` reads that as ``(dtype or fp16) if accelerator.is_fp16_supported() else
    # bf16``: on a CPU without mkldnn fp16 the NVMe swap buffers are bf16 under fp32 weights and
    # forward stops with "expected m1 and m2 to have the same dtype, but got: float !=
    # c10::BFloat16". (``"bf16": {"enabled": true}`` also runs, but in another precision.)
    deepspeed.zero.Init(module=model, config_dict_or_path=config)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    times, losses = [], []
    for x, y in batches:
        t0 = time.perf_counter()
        loss = F.cross_entropy(engine(x).flatten(0, 1), y.flatten())
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return times, losses


def run_tieroffload(args, model, batches) -> tuple[list[float], list[float]]:
    import torch
    import torch.nn.functional as F

    import tieroffload
    tieroffload.offload(model, tieroffload.Policy(
        params="nvme", optimizer="nvme", grads="nvme", nvme_dir=args.nvme, device="cpu",
        cpu_budget=args.budget))
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=args.lr, weight_decay=0.01,
                                fused=True, overlap="backward")
    times, losses = [], []
    for x, y in batches:
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    opt.close()
    tieroffload.close(model, restore=False)
    return times, losses


def worker(args) -> None:
    """One contender on one size, in this process; prints one RESULT line of JSON."""
    import torch
    GPT, token_batch = load_models()
    layers, d = map(int, args.size.split("x"))
    torch.manual_seed(0)
    model = GPT(args.vocab, d, layers, 16, args.seq)
    n = sum(p.numel() for p in model.parameters())
    batches = [token_batch(i, args.batch, args.seq, args.vocab) for i in range(args.steps + 1)]
    r0, w0 = io_bytes()
    run = run_deepspeed if args.worker == "deepspeed" else run_tieroffload
    times, losses = run(args, model, batches)
    r1, w1 = io_bytes()
    print("RESULT " + json.dumps({
        "params": n, "step_s": statistics.median(times[1:]), "losses": losses,
        "peak_rss": peak_rss(), "read": (r1 - r0) / len(times), "written": (w1 - w0) / len(times)}),
        flush=True)


class Cgroup:
    """A cgroup (v1 or v2) with a memory limit, for the children this bench starts; None of it
    where none can be made."""

    def __init__(self, limit: int) -> None:
        name = f"tieroffload-bench-{os.getpid()}"
        self.path = None
        for base, key in (("/sys/fs/cgroup/memory", "memory.limit_in_bytes"),
                          ("/sys/fs/cgroup", "memory.max")):
            try:
                p = Path(base) / name
                p.mkdir()
                (p / key).write_text(str(limit))
                self.path = p
                return
            except OSError:
                continue

    def enter(self) -> None:  # in the child, before exec
        if self.path is not None:
            (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def close(self) -> None:
        if self.path is not None:
            self.path.rmdir()


def contend(args, who: str, python: str, size: str, cg: Cgroup | None) -> dict:
    with tempfile.TemporaryDirectory(dir=args.dir, prefix=f"vs-{who}-") as nvme:
        cmd = [python, __file__, "--worker", who, "--size", size, "--nvme", nvme]
        for k in ("vocab", "seq", "batch", "steps", "budget", "lr"):
            cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
        env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
        out = subprocess.run(cmd, capture_output=True, text=True, env=env,
                             preexec_fn=cg.enter if cg is not None else None,
                             timeout=args.timeout)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
    killed = out.returncode == -9
    return {"error": "killed (out of memory under the cap)" if killed and cg else tail[:160]}


def deepspeed_python(args) -> str | None:
    python = args.deepspeed_python or sys.executable
    ok = subprocess.run([python, "-c", "import deepspeed"], capture_output=True,
                        env=dict(os.environ, DS_ACCELERATOR="cpu")).returncode == 0
    return python if ok else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", default=".", help="NVMe scratch directory")
    p.add_argument("--sizes", default="6x1024,16x1024", help="GPTs as LAYERSxWIDTH, by commas")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="measured steps, after one warm-up")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--budget", default="256MiB", help="tieroffload's CPU budget")
    p.add_argument("--cap", default=None, help="run each contender in a memory cgroup of this size")
    p.add_argument("--deepspeed-python", default=None)
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--size", default=None, help=argparse.SUPPRESS)
    p.add_argument("--nvme", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    from tieroffload.utils.sizes import format_bytes, parse_bytes
    contenders = [("tieroffload", sys.executable)]
    ds = deepspeed_python(args)
    if ds is None:
        print("DeepSpeed: does not import here (--deepspeed-python); tieroffload alone")
    else:
        contenders.append(("deepspeed", ds))
    cg = Cgroup(parse_bytes(args.cap)) if args.cap else None
    if cg is not None and cg.path is None:
        print(f"no memory cgroup can be made here: --cap {args.cap} is not enforced")
        cg = None
    results: dict[tuple[str, str], list[dict]] = {}
    try:
        for r in range(args.rounds):
            for size in args.sizes.split(","):
                for who, python in (contenders if r % 2 == 0 else contenders[::-1]):
                    res = contend(args, who, python, size, cg)
                    results.setdefault((size, who), []).append(res)
                    print(f"round {r + 1} {size} {who}: {res}", flush=True)
    finally:
        if cg is not None:
            cg.close()

    print(f"\nGPT LAYERSxWIDTH, vocab {args.vocab}, batch {args.batch}x{args.seq}; medians of "
          f"{args.rounds} rounds of {args.steps} steps; tieroffload budget {args.budget}"
          + (f"; memory cap {args.cap}" if args.cap else ""))
    print("| size | params | contender | step | peak RSS | read/step | written/step | "
          "first, last loss |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (size, who), runs in results.items():
        ok = [x for x in runs if "error" not in x]
        if not ok:
            print(f"| {size} | | {who} | failed: {runs[0]['error']} | | | | |")
            continue
        med = {k: statistics.median(x[k] for x in ok)
               for k in ("step_s", "peak_rss", "read", "written")}
        print(f"| {size} | {ok[0]['params'] / 1e6:.0f} M | {who} | {med['step_s']:.2f} s | "
              f"{format_bytes(med['peak_rss'])} | {format_bytes(med['read'])} | "
              f"{format_bytes(med['written'])} | {ok[0]['losses'][0]:.4f}, "
              f"{ok[0]['losses'][-1]:.4f} |")


if __name__ == "__main__":
    main()

"""The cost model against measurement, in one run: for each bench model, every policy of a grid
(the notebook's: tiers of parameters, optimizer state and activations, prefetch depth, resident
budget) predicted and measured; then Policy.auto's choice under a CPU budget against the best
measured policy of the grid within that budget.

    python bench/cost_model.py --dir /mnt/nvme
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile

import torch
import torch.nn.functional as F

from tieroffload import Policy
from tieroffload.planner import Machine, Profile, measure, predict
from tieroffload.testing.models import GPT, token_batch
from tieroffload.utils.sizes import format_bytes

MODELS = {
    "GPT 8x512 seq 256": dict(vocab=2048, d=512, layers=8, heads=8, seq=256, batch=4),
    "GPT 4x1024 seq 128": dict(vocab=8192, d=1024, layers=4, heads=16, seq=128, batch=4),
}


def grid(d: str, prof: Profile) -> list[Policy]:
    out = []
    for params, opt, act in itertools.product(("cpu", "nvme"), ("cpu", "nvme"), (None, "nvme")):
        budgets = [None] if params == "cpu" else [4 * prof.largest_unit, prof.param_bytes // 2]
        for budget, prefetch in itertools.product(budgets, (1, 4) if params == "nvme" else (2,)):
            out.append(Policy(device="cpu", params=params, optimizer=opt, activations=act,
                              grads="nvme" if params == "nvme" else "cpu", nvme_dir=d,
                              cpu_budget=budget, prefetch=prefetch))
    return out


def name_of(p: Policy) -> str:
    s = f"params {p.params:4} opt {p.optimizer:4} act {p.activations or '-':4}"
    if p.params == "nvme":
        s += f" budget {format_bytes(p.cpu_budget):>10} prefetch {p.prefetch}"
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=".")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-cost-") as d:
        machine = Machine.measure(d)
        print(f"disk read {machine.read_gbps:.2f} GB/s, write {machine.write_gbps:.2f} GB/s; "
              f"I/O costs compute {machine.io_cost * 1e9:.2f} s per GB moved")
        for title, s in MODELS.items():
            def build(s=s):
                torch.manual_seed(0)
                return GPT(s["vocab"], s["d"], s["layers"], s["heads"], s["seq"])

            x, y = token_batch(0, s["batch"], s["seq"], s["vocab"])

            def sample(model, x=x, y=y):
                return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

            prof = Profile.measure(build(), sample)
            print(f"\n{title}: {prof.params / 1e6:.1f} M params, activations "
                  f"{format_bytes(prof.activation_bytes)}, compute {prof.forward_s:.2f} + "
                  f"{prof.backward_s:.2f} + {prof.optimizer_s:.2f} s")
            print(f"{'policy':58} {'pred s':>7} {'meas s':>7} {'ratio':>6} {'pred peak':>10} "
                  f"{'meas peak':>10}")
            rows = []
            for p in grid(d, prof):
                pr, me = predict(p, prof, machine), measure(build, sample, p, steps=args.steps)
                rows.append((p, pr, me))
                print(f"{name_of(p):58} {pr.step_s:7.2f} {me.step_s:7.2f} "
                      f"{me.step_s / pr.step_s:6.2f} {format_bytes(pr.peak['cpu']):>10} "
                      f"{format_bytes(me.peak):>10}", flush=True)
            errors = [abs(me.step_s / pr.step_s - 1) for _, pr, me in rows]
            print(f"|measured / predicted - 1|: median {statistics.median(errors):.2f}, "
                  f"max {max(errors):.2f}; within 25%: "
                  f"{sum(e <= 0.25 for e in errors)} of {len(errors)}")
            resident = next(me.peak for p, _, me in rows if p.params == p.optimizer == "cpu"
                            and p.activations is None)
            budget = resident // 2
            auto = Policy.auto(build(), sample=sample, cpu_budget=budget, nvme_dir=d,
                               machine=machine, profile=prof, device="cpu", build=build)
            got = measure(build, sample, auto, steps=args.steps)
            fits = [(me.step_s, p) for p, _, me in rows if me.peak <= budget]
            for q, m in auto.plan.trials:
                print(f"  auto measured {name_of(q)}: {m.step_s:.2f} s, peak "
                      f"{format_bytes(m.peak)}")
            print(f"Policy.auto under {format_bytes(budget)}: {name_of(auto)}; predicted "
                  f"{auto.plan.prediction.step_s:.2f} s, measured {got.step_s:.2f} s, peak "
                  f"{format_bytes(got.peak)}")
            if fits:
                best_s, best = min(fits, key=lambda t: t[0])
                print(f"best of the grid within the budget: {name_of(best)}, {best_s:.2f} s; "
                      f"auto / best = {got.step_s / best_s:.2f}")


if __name__ == "__main__":
    main()

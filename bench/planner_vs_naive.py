"""Policy.auto's placement against everything on NVMe, measured: the planner predicts that its
choice steps faster than the naive all-NVMe placement; this measures both, interleaved (auto,
naive, auto, naive, ...), and reports the medians and their ratio. The test suite checks the
prediction only (tests/test_planner.py): wall time on a shared machine belongs here.

    python bench/planner_vs_naive.py --dir /mnt/nvme --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from tieroffload import Policy
from tieroffload.planner import Machine, Profile, measure, predict
from tieroffload.testing.models import gpt_task
from tieroffload.utils.sizes import format_bytes

# The test suite's "deep" shape (tests/test_planner.py): deep and narrow.
SHAPE = dict(vocab=2048, d=512, layers=4, heads=8, seq=128, batch=4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=".", help="directory for the NVMe tier")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians)")
    ap.add_argument("--steps", type=int, default=2, help="measured steps per round")
    ap.add_argument("--budget", default="4GiB", help="Policy.auto's cpu_budget")
    args = ap.parse_args()
    build, sample = gpt_task(**SHAPE)

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-planner-") as d:
        machine = Machine.measure(d, size=128 << 20)
        prof = Profile.measure(build(), sample)
        auto = Policy.auto(build(), sample=sample, cpu_budget=args.budget, nvme_dir=d,
                           machine=machine, profile=prof, device="cpu")
        naive = Policy(device="cpu", params="nvme", optimizer="nvme", grads="nvme",
                       activations="nvme", nvme_dir=d, cpu_budget=4 * prof.largest_unit)
        pred_auto, pred_naive = auto.plan.prediction.step_s, predict(naive, prof, machine).step_s
        print(f"disk read {machine.read_gbps:.2f} GB/s, write {machine.write_gbps:.2f} GB/s; "
              f"model {prof.params / 1e6:.1f} M params, naive budget "
              f"{format_bytes(naive.cpu_budget)}")
        ours, theirs = [], []
        for r in range(args.rounds):
            ours.append(measure(build, sample, auto, steps=args.steps).step_s)
            theirs.append(measure(build, sample, naive, steps=args.steps).step_s)
            print(f"round {r + 1}: auto {ours[-1]:.3f} s, all on NVMe {theirs[-1]:.3f} s",
                  flush=True)
        a, n = statistics.median(ours), statistics.median(theirs)
        print(f"predicted step: auto {pred_auto:.3f} s, all on NVMe {pred_naive:.3f} s")
        print(f"measured step (median of {args.rounds}): auto {a:.3f} s, all on NVMe {n:.3f} s; "
              f"all on NVMe / auto = {n / a:.2f}")


if __name__ == "__main__":
    main()

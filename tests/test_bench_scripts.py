"""The scripts under bench/ run to the end at a tiny size (their figures are not checked
here: timing on a shared machine belongs in bench/README.md)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--layers", "2", "--d", "64", "--vocab", "128", "--seq", "16", "--batch", "2"]


@pytest.mark.parametrize("script,args,says", [
    ("train_step.py", TINY + ["--meta", "--steps", "1", "--probe-layers", "1"],
     "max(compute, I/O bound)"),
    ("gpu_step.py", TINY + ["--device", "cpu", "--steps", "1"], "nvme: step"),
    ("io_beside_compute.py", ["--gib", "0.0625", "--rounds", "1", "--adamw-params", "1048576"],
     "adamw: alone"),
])
def test_bench_script_runs_at_a_tiny_size(script, args, says, tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--dir", str(tmp_path),
                          *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert says in out.stdout

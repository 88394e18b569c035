"""The scripts under bench/ run to the end at a tiny size (their figures are not checked
here: timing on a shared machine belongs in bench/README.md)."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--layers", "2", "--d", "64", "--vocab", "128", "--seq", "16", "--batch", "2"]


@pytest.mark.parametrize("script,args,says", [
    ("train_step.py", TINY + ["--meta", "--steps", "1", "--probe-layers", "1"],
     "max(compute, I/O bound)"),
    ("gpu_step.py", TINY + ["--device", "cpu", "--steps", "1"], "nvme: step"),
    ("io_beside_compute.py", ["--gib", "0.0625", "--rounds", "1", "--adamw-params", "1048576"],
     "adamw: alone"),
    ("vs_deepspeed_curves.py", ["--steps", "2", "--size", "1x64", "--vocab", "128"], "| 2 | "),
])
def test_bench_script_runs_at_a_tiny_size(script, args, says, tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--dir", str(tmp_path),
                          *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert says in out.stdout


GPU_CHECK = ROOT / "bench" / "gpu_check.sh"


def test_gpu_check_script_parses_and_refuses_an_unknown_argument(tmp_path):
    assert subprocess.run(["bash", "-n", str(GPU_CHECK)]).returncode == 0
    out = subprocess.run(["bash", str(GPU_CHECK), "--fast"], capture_output=True, text=True,
                         timeout=60, env={"PATH": os.environ["PATH"], "OUT": str(tmp_path)})
    assert out.returncode == 64 and "unknown argument --fast" in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("nvidia_smi", ["absent", "prints a GPU", "fails"])
def test_gpu_check_stops_at_once_without_a_cuda_device(nvidia_smi, tmp_path):
    """No CUDA device: exit 2 with one line saying so, nothing built or run, whatever
    nvidia-smi says; the log is under $OUT."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "mktemp", "tee"):  # all the script needs before it stops
        (bin_dir / tool).symlink_to(shutil.which(tool))
    body = {"prints a GPU": "echo 'NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04'",
            "fails": "echo 'NVIDIA-SMI has failed' >&2; exit 9"}.get(nvidia_smi)
    if body:
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    env = {"PATH": str(bin_dir), "OUT": str(out_dir), "PYTHON": sys.executable}
    out = subprocess.run([shutil.which("bash"), str(GPU_CHECK)], capture_output=True, text=True,
                         timeout=120, env=env)
    says = "gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing run"
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout.strip().splitlines()[-1] == says and "== build" not in out.stdout
    assert (out_dir / "gpu_check.log").read_text() == out.stdout


def load_bench(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_busy_share_counts_overlapping_kernels_once():
    gpu_step = load_bench("gpu_step")
    assert gpu_step.union_length([(5, 6), (0, 2), (1, 3), (2.5, 2.75)]) == 4.0
    assert gpu_step.union_length([]) == 0.0
    assert gpu_step.gpu_busy_share(lambda: None, torch.device("cpu")) is None


def test_gpu_step_json_holds_each_row_with_nvme_last(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_step.py"), "--dir",
                          str(tmp_path), *TINY, "--device", "cpu", "--steps", "1", "--json",
                          str(tmp_path / "out.json")], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert [r["optimizer"] for r in rows] == ["resident", "cpu", "nvme"]
    assert all(r["gpu_busy"] is None and len(r["losses"]) == 2 for r in rows)
    assert rows[1]["losses"] == rows[2]["losses"]  # the two host steps: the same updates

"""The sdist carries every source the build needs, and what it installs imports and offloads a
model with only the runtime dependencies (torch, numpy, psutil, safetensors): the bench's and
the tests' extras stay out of the library."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tarfile

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent

CHECK = """
import sys
for extra in ("tqdm", "aiofiles", "matplotlib", "transformers", "accelerate", "pytest"):
    sys.modules[extra] = None  # importing any of them now fails
sys.path.insert(0, sys.argv[1])
import torch
import tieroffload
assert tieroffload.__file__.startswith(sys.argv[1]), tieroffload.__file__
torch.manual_seed(0)
ref = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
x = torch.randn(8, 32)
want = ref(x)
model = tieroffload.offload(ref, tieroffload.Policy(params="nvme", nvme_dir=sys.argv[2],
                                                    device="cpu"))
assert torch.equal(model(x), want)
tieroffload.close(model)
print("ok", tieroffload.__version__)
"""


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("dist")
    code = ("import sys, setuptools.build_meta as b; "
            "print(b.build_sdist(sys.argv[1]))")
    proc = subprocess.run([sys.executable, "-c", code, str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out / proc.stdout.strip().splitlines()[-1]


def test_the_sdist_holds_every_native_source_and_header(sdist):
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    native = {f"native/{f}" for f in os.listdir(REPO / "native")}
    assert native <= names, sorted(native - names)
    assert "tieroffload/_version.py" in names


def test_the_sdist_installs_and_offloads_with_runtime_dependencies_only(sdist, tmp_path):
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                           "--no-build-isolation", "--disable-pip-version-check",
                           "--target", str(target), str(sdist)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    swap = tmp_path / "swap"
    swap.mkdir()
    proc = subprocess.run([sys.executable, "-c", CHECK, str(target), str(swap)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("ok 0.")

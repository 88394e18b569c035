"""Several directories (striping) and several ranks (torchrun, gloo, DDP)."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from models import TinyGPT

import tieroffload
from tieroffload import Policy, aio
from tieroffload.swap import STRIPE, SwapSpace

WORKER = Path(__file__).resolve().parent / "dist_worker.py"


def test_striped_swap_round_trips_and_uses_every_directory(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    swap = SwapSpace([str(d) for d in dirs], 0, "stripe-test")
    try:
        assert isinstance(swap.file, aio.StripedFile)
        nbytes = 5 * STRIPE + 3 * 4096  # not a whole number of stripes
        off = swap.alloc(nbytes)
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        buf = aio.aligned_empty(nbytes, pin=False)
        buf.copy_(data)
        assert swap.file.pwrite(buf, off).result() == nbytes
        back = aio.aligned_empty(nbytes, pin=False)
        assert swap.file.pread(back, off).result() == nbytes
        assert torch.equal(back, data)
        # Stripe k lies in directory k % 2: check the raw files hold the right pieces.
        for k in range(6):
            path = swap.paths[k % 2]
            with open(path, "rb") as f:
                f.seek((k // 2) * STRIPE)
                piece = f.read(min(STRIPE, nbytes - k * STRIPE))
            assert piece == bytes(data[k * STRIPE:k * STRIPE + len(piece)].numpy())
        assert all(os.path.dirname(p).endswith("rank0") for p in swap.paths)
    finally:
        swap.close()
    assert not any(os.listdir(d) for d in dirs)  # files and rank folders gone


def test_offload_striped_over_two_directories(tmp_path):
    torch.manual_seed(0)
    ref = TinyGPT(d=256)  # 3 MiB per block: units span stripes
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    for d in dirs:
        os.mkdir(d)
    pol = Policy(params="nvme", optimizer="nvme", nvme_dir=dirs, device="cpu",
                 cpu_budget="8MiB")
    assert pol.nvme_dir == tuple(dirs) and Policy.from_dict(pol.to_dict()) == pol
    model = tieroffload.offload(copy.deepcopy(ref), pol)
    x = torch.randint(0, 97, (2, 16))
    for _ in range(2):
        assert torch.equal(model(x), ref(x))
    st = tieroffload.stats(model)
    assert st["bytes_read"]["nvme"] > 0
    sizes = [os.path.getsize(p) for p in model._tieroffload.swap.paths]
    assert all(s > 0 for s in sizes), sizes
    tieroffload.close(model)


def torchrun(tmp_path: Path, name: str, *args: str, nproc: int = 2) -> dict:
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(WORKER), "--mode", "ddp", "--out", str(out), *args]
    if nproc == 1:
        cmd = [sys.executable, str(WORKER), "--mode", "single", "--out", str(out), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single-process reference, two DDP ranks, and two ranks that save after 5 steps
    and two fresh ones that resume from that checkpoint."""
    tmp = tmp_path_factory.mktemp("dist")
    nvme = tmp / "nvme"
    nvme.mkdir()
    ckpt = str(tmp / "ckpt")
    return {
        "single": torchrun(tmp, "single", "--dir", str(nvme), nproc=1),
        "ddp": torchrun(tmp, "ddp", "--dir", str(nvme), "--save-at", "5", "--ckpt", ckpt),
        "resumed": torchrun(tmp, "resumed", "--dir", str(nvme), "--resume", ckpt),
        "ckpt": ckpt,
    }


def test_ddp_two_ranks_match_one_process(runs):
    single, ddp = runs["single"]["losses"], runs["ddp"]["losses"]
    assert len(single) == len(ddp) == 10
    assert single[-1] < single[0]  # it learns
    assert ddp == pytest.approx(single, rel=1e-6, abs=1e-6)
    a, b = runs["ddp"]["swaps"]
    assert a != b and "rank0" in a and "rank1" in b  # a folder and a file of its own each


def test_checkpoint_from_two_ranks_resumes_exactly(runs):
    manifest = json.loads(Path(runs["ckpt"], "manifest.json").read_text())
    assert manifest["world_size"] == 2 and len(manifest["ranks"]) == 2
    assert sorted(os.listdir(runs["ckpt"])) == ["manifest.json", "rank0", "rank1"]
    assert runs["resumed"]["losses"] == runs["ddp"]["losses"][5:]

"""Several directories (striping) and several ranks (torchrun, gloo, DDP and FSDP2)."""

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
from tieroffload.aio.swap import STRIPE, SwapSpace

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


def torchrun(tmp_path: Path, name: str, *args: str, mode: str = "ddp") -> dict:
    """Runs the worker (two ranks, or one process for mode "single"); its JSON, with the final
    parameters under "params"."""
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node=2", str(WORKER), "--mode", mode, "--out", str(out), *args]
    if mode == "single":
        cmd = [sys.executable, str(WORKER), "--mode", "single", "--out", str(out), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return {**json.loads(out.read_text()), "params": torch.load(f"{out}.pt")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single-process reference; for DDP and for FSDP2, two ranks that save after 5
    steps and two fresh ones that resume from that checkpoint; FSDP2 alone; DDP with gradients
    on NVMe."""
    tmp = tmp_path_factory.mktemp("dist")
    nvme = tmp / "nvme"
    nvme.mkdir()
    d = ("--dir", str(nvme))
    out = {"single": torchrun(tmp, "single", *d, mode="single"),
           "fsdp-plain": torchrun(tmp, "fsdp-plain", *d, "--plain", mode="fsdp"),
           "ddp-grads": torchrun(tmp, "ddp-grads", *d, "--grads", "nvme", mode="ddp")}
    for mode in ("ddp", "fsdp"):
        ckpt = str(tmp / f"ckpt-{mode}")
        out[mode] = torchrun(tmp, mode, *d, "--save-at", "5", "--ckpt", ckpt, mode=mode)
        out[f"{mode}-resumed"] = torchrun(tmp, f"{mode}-resumed", *d, "--resume", ckpt,
                                          mode=mode)
        out[f"{mode}-ckpt"] = ckpt
    assert os.listdir(nvme) == []  # every rank's swap space is gone
    return out


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "ddp-grads"])
def test_two_ranks_match_one_process(runs, mode):
    """ddp-grads: gradients paged to NVMe too, after DDP has reduced them."""
    single, ranks = runs["single"], runs[mode]
    assert len(single["losses"]) == len(ranks["losses"]) == 10
    assert single["losses"][-1] < single["losses"][0]  # it learns
    assert ranks["losses"] == pytest.approx(single["losses"], rel=1e-6, abs=1e-6)
    for k, v in single["params"].items():
        # Adam turns rounding-level differences in tiny gradients into steps of up to lr
        # (3e-3); the final parameters agree far closer than that
        torch.testing.assert_close(ranks["params"][k], v, rtol=0, atol=1e-4, msg=k)
    a, b = ranks["swaps"]
    assert a != b and "rank0" in a and "rank1" in b  # a folder and a file of its own each
    for r in ranks["ranks"]:  # each rank paged its part from NVMe within its budget
        assert r["read"] > 0 and r["peak"] <= r["budget"], r


def test_fsdp_paged_shards_equal_fsdp_alone(runs):
    """tieroffload under FSDP2 computes exactly what FSDP2 does with everything resident."""
    assert runs["fsdp"]["losses"] == runs["fsdp-plain"]["losses"]
    for k, v in runs["fsdp-plain"]["params"].items():
        assert torch.equal(runs["fsdp"]["params"][k], v), k


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_checkpoint_from_two_ranks_resumes_exactly(runs, mode):
    ckpt = runs[f"{mode}-ckpt"]
    manifest = json.loads(Path(ckpt, "manifest.json").read_text())
    assert manifest["world_size"] == 2 and len(manifest["ranks"]) == 2
    assert sorted(os.listdir(ckpt)) == ["manifest.json", "rank0", "rank1"]
    assert runs[f"{mode}-resumed"]["losses"] == runs[mode]["losses"][5:]
    for k, v in runs[mode]["params"].items():
        assert torch.equal(runs[f"{mode}-resumed"]["params"][k], v), k


@pytest.fixture
def one_rank():
    """A single-rank gloo group in this process: FSDP2 over it runs the same hooks."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _sharded(seed: int = 0) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    from tieroffload.testing.models import GPT

    torch.manual_seed(seed)
    model = GPT(97, 40, 3, 4, 16)
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def test_fsdp_shards_paged_in_process_equal_fsdp_alone(one_rank, tmp_path):
    import torch.nn.functional as F

    from tieroffload.testing.models import token_batch

    ref, model = _sharded(), _sharded()
    # room for the largest group (a block) and a little: most of the model is away at a time
    budget = max(sum(p.numel() * 4 for p in b.parameters()) for b in model.blocks) + (8 << 10)
    tieroffload.offload(model, Policy(params="nvme", optimizer="nvme", nvme_dir=str(tmp_path),
                                      device="cpu", cpu_budget=budget))
    units = model._tieroffload.units
    assert len(units) == 4 and all("FSDP shards" in u.name for u in units)
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for step in range(4):
        x, y = token_batch(step, 4, 16, 97)
        for m, o in ((model, opt), (ref, ref_opt)):
            F.cross_entropy(m(x).flatten(0, 1), y.flatten()).backward()
            o.step()
            o.zero_grad()
        with torch.no_grad():
            assert torch.equal(model(x), ref(x))
    for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), k
    st = tieroffload.stats(model)
    assert st["bytes_read"]["nvme"] > 0 and st["peak_resident"] <= budget
    assert st["hits"] > 0  # prefetched along the order of FSDP's all-gathers
    tieroffload.close(model)
    assert os.listdir(tmp_path) == []


def test_fsdp_refuses_paged_gradients(one_rank, tmp_path):
    model = _sharded()
    with pytest.raises(NotImplementedError, match="grads='nvme'"):
        tieroffload.offload(model, Policy(params="nvme", grads="nvme", nvme_dir=str(tmp_path),
                                          device="cpu"))
    assert getattr(model, "_tieroffload", None) is None

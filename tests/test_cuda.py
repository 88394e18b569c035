"""The CUDA paths: pinned buffers, NVMe -> pinned staging -> GPU on a side stream, and the
paged optimizer with its state on the GPU. Skipped where there is no GPU."""

import copy
import time

import pytest
import torch
from models import TinyGPT, mlp

import tieroffload
from tieroffload import Policy, aio

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_aligned_empty_is_pinned_and_round_trips(tmp_path):
    buf = aio.aligned_empty(8 << 20)
    assert buf.is_pinned() and buf.data_ptr() % 4096 == 0
    buf.copy_(torch.randint(0, 256, (8 << 20,), dtype=torch.uint8))
    with aio.open(tmp_path / "x", "w+") as f:
        f.pwrite(buf).result()
        out = aio.aligned_empty(8 << 20)
        f.pread(out).result()
    assert torch.equal(out, buf)
    assert torch.equal(out.cuda(non_blocking=True).cpu(), buf)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("delay", [0.0, 0.003])
def test_gpu_compute_matches_resident(tier, delay, tmp_path):
    torch.manual_seed(0)
    ref = TinyGPT().cuda()
    model = copy.deepcopy(ref)
    budget = 2 * max(p.numel() * 4 for p in ref.parameters())
    tieroffload.offload(model, Policy(params=tier, nvme_dir=str(tmp_path), device="cuda",
                                      gpu_budget=budget),
                        _io_delay=(lambda: time.sleep(delay)) if delay else None)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(4):
        x = torch.randint(0, 97, (2, 16), device="cuda")
        for m, o in ((ref, opt_ref), (model, opt)):
            o.zero_grad()
            m(x).float().square().mean().backward()
            o.step()
        assert torch.equal(ref(x), model(x)), step
    st = tieroffload.stats(model)
    assert st["peak_resident"] <= st["budget"]
    assert st["bytes_read"][tier] > 0
    tieroffload.close(model)


def test_gpu_paged_optimizer_state_on_gpu(tmp_path):
    torch.manual_seed(0)
    ref = mlp().cuda()
    model = tieroffload.offload(copy.deepcopy(ref), Policy(params="nvme", nvme_dir=str(tmp_path),
                                                           device="cuda", optimizer="gpu"))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=1e-2)
    for _ in range(3):
        x = torch.randn(4, 64, device="cuda")
        for m, o in ((ref, opt_ref), (model, opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    x = torch.randn(4, 64, device="cuda")
    assert torch.equal(ref(x), model(x))
    tieroffload.close(model)

"""The CUDA paths: pinned buffers, NVMe -> pinned staging -> GPU on a side stream, and the
paged optimizer with its state on the GPU. Skipped where there is no GPU."""

import copy
import gc
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


def test_gpu_bf16_parameters_get_fp32_masters_on_the_gpu(tmp_path):
    """optimizer="gpu" with bf16 parameters: fp32 masters beside them on the GPU, stepped by
    AdamW(fused=True) with the bf16 gradients; no host buffer, nothing pinned."""
    torch.manual_seed(0)
    ref = mlp().to("cuda", torch.bfloat16)
    model = tieroffload.offload(copy.deepcopy(ref), Policy(params="nvme", nvme_dir=str(tmp_path),
                                                           device="cuda", optimizer="gpu"))
    masters = [torch.nn.Parameter(p.detach().float()) for p in ref.parameters()]
    opt_ref = torch.optim.AdamW(masters, lr=1e-2, fused=True)
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=1e-2)
    for _ in range(3):
        x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
        ref(x).float().square().mean().backward()
        for q, p in zip(masters, ref.parameters()):
            q.grad = p.grad.float()
        opt_ref.step()
        with torch.no_grad():
            for q, p in zip(masters, ref.parameters()):
                p.copy_(q)
        ref.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(ref(x), model(x))
    assert tieroffload.stats(model)["pinned"] == 0
    opt.close()
    tieroffload.close(model)


# -- the host step: fp32 masters and AdamW state in RAM or on NVMe, compute on the GPU ---------

# (params, optimizer state, gradients): gradients stay on the GPU until the step, or go to
# pinned RAM as each unit's backward ends (with paged parameters)
HOST_PLACEMENTS = [(p, o, g) for p in ("gpu", "cpu", "nvme") for o in ("cpu", "nvme")
                   for g in ("gpu", "cpu") if g == "gpu" or p != "gpu"]


def host_policy(params, optim, tmp_path, ref, grads="gpu", **kw):
    if params != "gpu":  # a few units on the GPU at once: they really come and go
        kw.setdefault("gpu_budget", 2 * max(p.numel() * p.element_size()
                                            for p in ref.parameters()))
    return Policy(params=params, optimizer=optim, grads=grads, device="cuda",
                  nvme_dir=str(tmp_path), **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("params,optim,grads", HOST_PLACEMENTS)
def test_host_step_equals_fused_adamw_over_host_masters(params, optim, grads, dtype, tmp_path):
    """Each placement against plain PyTorch on the GPU whose fp32 masters are stepped on the
    host by AdamW(fused=True), with clipping: the same losses, norms and parameters."""
    torch.manual_seed(0)
    ref = TinyGPT().to("cuda", dtype)
    model = copy.deepcopy(ref)
    masters = [torch.nn.Parameter(p.detach().to("cpu", torch.float32, copy=True))
               for p in ref.parameters()]
    opt_ref = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, fused=True)
    policy = host_policy(params, optim, tmp_path, ref, grads)
    tieroffload.offload(model, policy)
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    for step in range(4):
        x = torch.randint(0, 97, (2, 16), device="cuda",
                          generator=torch.Generator("cuda").manual_seed(step))
        loss_ref = ref(x).float().square().mean()
        loss_ref.backward()
        norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        for q, p in zip(masters, ref.parameters()):
            q.grad = p.grad.float().cpu()
        opt_ref.step()
        opt_ref.zero_grad()
        with torch.no_grad():
            for q, p in zip(masters, ref.parameters()):
                p.copy_(q.to(dtype))
        ref.zero_grad()
        loss = model(x).float().square().mean()
        loss.backward()
        # grads="cpu": every gradient left the GPU during backward
        assert all(p.grad is None for p in model.parameters()) == (grads == "cpu")
        norm = opt.clip_grad_norm_(0.05)
        opt.step()
        opt.zero_grad()
        assert loss.item() == loss_ref.item(), step
        assert torch.equal(norm, norm_ref), step
    st = tieroffload.stats(model)
    nbytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    homes = nbytes * ((params == "cpu") + (grads == "cpu"))
    # every page-locked byte is counted: RAM homes, staging, the host step's buffers
    assert st["pinned"] > homes
    if params != "gpu":
        assert st["peak_resident"] <= policy.gpu_budget
    with tieroffload.materialize(model):
        for a, b in zip(ref.parameters(), model.parameters()):
            assert b.device.type == "cuda" and b.dtype == dtype and torch.equal(a, b)
    ledger = model._tieroffload.stats
    opt.close()
    tieroffload.close(model)
    gc.collect()
    assert ledger.pinned == 0  # all of it unregistered


def test_host_step_orders_copies_with_events_not_synchronisation(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = TinyGPT().cuda()
    tieroffload.offload(model, host_policy("gpu", "cpu", tmp_path, model))
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=1e-2)
    model(torch.randint(0, 97, (2, 16), device="cuda")).square().mean().backward()

    def refuse(*a, **k):
        raise AssertionError("the host step synchronised a stream or the device")
    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", refuse)
    opt.step()
    monkeypatch.undo()
    opt.close()
    tieroffload.close(model)


def test_cpu_budget_bounds_the_pinned_homes_of_parameters_and_gradients(tmp_path):
    model = TinyGPT().cuda()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kw = dict(optimizer="cpu", grads="cpu", device="cuda", nvme_dir=str(tmp_path))
    with pytest.raises(MemoryError, match=f'grads="cpu" keeps all gradients in pinned RAM: '
                                          f'{nbytes} bytes.*over cpu_budget={nbytes - 1}'):
        tieroffload.offload(model, Policy(params="nvme", cpu_budget=nbytes - 1, **kw))
    with pytest.raises(MemoryError, match='params="cpu" keeps all parameters and grads="cpu"'):
        tieroffload.offload(model, Policy(params="cpu", cpu_budget=2 * nbytes - 1, **kw))
    tieroffload.offload(model, Policy(params="cpu", cpu_budget=4 * nbytes, **kw))
    tieroffload.close(model)


def test_gradients_in_pinned_ram_need_paged_parameters():
    with pytest.raises(ValueError, match='grads="cpu" with CUDA.*params="cpu" or "nvme"'):
        Policy(params="gpu", optimizer="cpu", grads="cpu", device="cuda")

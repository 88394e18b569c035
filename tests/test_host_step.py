"""The host step (the paged optimizer stepping fp32 masters on the host for working copies
elsewhere), run through its CPU device interface: bf16 working copies on the CPU, fp32 masters
and AdamW state in RAM or on NVMe. Bit-identical to torch AdamW(fused=True) over fp32 masters,
with gradient accumulation, clipping, an LR schedule, a checkpoint and an exact resume."""

import copy
import gc

import pytest
import torch
from models import TinyGPT
from test_optimizer import CONFIGS, batch, manual_master_step, policy, warmup

import tieroffload
from tieroffload.core.devices import HostBuffers, Transfers, pinned_empty
from tieroffload.core.homes import RamHome
from tieroffload.core.stats import Stats
from tieroffload.hooks.grads import GradPager
from tieroffload.hooks.state import _state

ACCUM = 2
CLIP = 0.05  # small enough that every step clips


def test_cpu_transfers_copy_and_cast_in_order():
    x = Transfers(torch.device("cpu"))
    assert not x.cuda and x.stream is None
    src = torch.randn(5, 3, dtype=torch.bfloat16)
    dst = torch.empty(5, 3, dtype=torch.float32)
    x.wait(x.to_host(src, dst))
    assert torch.equal(dst, src.float())
    back = torch.empty(5, 3, dtype=torch.bfloat16)
    x.wait(x.to_device(dst.to(torch.bfloat16), back))
    assert torch.equal(back, src)


def test_host_buffers_lay_out_aligned_views_and_count_pinned_memory():
    stats = Stats()
    bufs = HostBuffers(1000, 2, pin=False, stats=stats)
    like = [torch.empty(3, 5), torch.empty(7, dtype=torch.bfloat16)]
    a = bufs.views(0, like)
    b = bufs.views(1, like, torch.float32)
    assert [t.shape for t in a] == [(3, 5), (7,)] and a[1].dtype == torch.bfloat16
    assert b[1].dtype == torch.float32
    assert all(t.data_ptr() % 64 == 0 for t in a + b)
    assert a[0].data_ptr() != b[0].data_ptr()  # two slots
    assert bufs.views(2, like)[0].data_ptr() == a[0].data_ptr()  # slot 2 is slot 0 again
    assert stats.pinned == 0  # not pinned without CUDA
    with pytest.raises(ValueError, match="cannot hold"):
        bufs.views(0, [torch.empty(1000)])
    bufs.close()


def test_pinned_bytes_are_counted_until_the_last_view_is_freed(monkeypatch):
    """Every pinned buffer is made by pinned_empty, which counts it in ``stats.pinned`` from
    registration until its memory goes (here a fake CUDA runtime registers the pages)."""
    calls = []

    class FakeRuntime:
        def cudaHostRegister(self, addr, n, flags):
            calls.append(("register", addr, n))
            return 0

        def cudaHostUnregister(self, addr):
            calls.append(("unregister", addr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", FakeRuntime)
    stats = Stats()
    buf = pinned_empty(10000, True, stats)
    view = buf[4096:8192].view(torch.float32)
    assert stats.pinned == 10000 and calls == [("register", buf.data_ptr(), 10000)]
    del buf
    gc.collect()
    assert stats.pinned == 10000  # a view still holds the pages
    del view
    gc.collect()
    assert stats.pinned == 0 and calls[-1][0] == "unregister"
    assert pinned_empty(10000, False, stats).numel() == 10000 and stats.pinned == 0


def reference_step(ref, masters, opt_ref):
    """fp32 masters stepped by torch AdamW(fused=True) with the bf16 gradients, clipped by
    torch's clip_grad_norm_; the parameters get the masters rounded."""
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
    manual_master_step(ref, masters, opt_ref, None)
    return norm


def train(model, opt, sched, steps, clip):
    losses, norms = [], []
    for step in steps:
        total = 0.0
        for micro in range(ACCUM):
            loss = model(batch(step, micro)).float().square().mean() / ACCUM
            loss.backward()
            total += loss.item()
        norms.append(clip())
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(total)
    return losses, norms


RAM_GRADS = "nvme-nvme-ram-grads"


def offload(model, config, tmp_path):
    """``config`` of test_optimizer; RAM_GRADS: gradients paged to a RAM home as each unit's
    backward ends, by the pager ``grads="cpu"`` makes with CUDA compute (here over unpinned
    RAM: on the CPU that policy leaves them in ``p.grad``)."""
    model = tieroffload.offload(model, policy("nvme-nvme-grads" if config == RAM_GRADS
                                              else config, tmp_path))
    if config == RAM_GRADS:
        st = _state(model)
        st.grads.close()
        st.grads = GradPager(st.units, lambda n: RamHome(n, False, st.stats), st.mover, st.stats)
    return model


@pytest.mark.parametrize("config", list(CONFIGS) + [RAM_GRADS])
def test_bf16_host_step_equals_fused_adamw_over_fp32_masters_through_resume(config, tmp_path):
    torch.manual_seed(0)
    ref = TinyGPT().to(torch.bfloat16)
    init = copy.deepcopy(ref)
    masters = [torch.nn.Parameter(p.detach().float()) for p in ref.parameters()]
    opt_ref = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, fused=True)
    sched_ref = warmup(opt_ref)

    def ref_clip():
        return reference_step(ref, masters, opt_ref)

    class RefOpt:  # the reference steps inside its clip: nothing more per step
        step = zero_grad = staticmethod(lambda: None)

    want, want_norms = train(ref, RefOpt, sched_ref, range(6), ref_clip)

    (tmp_path / "a").mkdir()
    model = offload(copy.deepcopy(init), config, tmp_path / "a")
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    assert opt.grad_bufs is not None  # the host-step pipeline runs
    assert all(opt._grads_in_ram(c) for c in opt.chunks) == (config == RAM_GRADS)
    sched = warmup(opt)
    got, norms = train(model, opt, sched, range(3), lambda: opt.clip_grad_norm_(CLIP))
    ckpt = tmp_path / "ckpt"
    tieroffload.save_checkpoint(ckpt, model, opt, extra={"sched": sched.state_dict()})
    opt.close()
    tieroffload.close(model)

    (tmp_path / "b").mkdir()
    torch.manual_seed(1)  # other values: everything comes from the checkpoint
    model = offload(TinyGPT().to(torch.bfloat16), config, tmp_path / "b")
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    sched = warmup(opt)
    sched.load_state_dict(tieroffload.load_checkpoint(ckpt, model, opt)["sched"])
    more, more_norms = train(model, opt, sched, range(3, 6),
                             lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
    assert got + more == want
    assert all(torch.equal(a, b) for a, b in zip(norms + more_norms, want_norms))
    assert all(n > CLIP for n in want_norms)  # every step clipped
    with tieroffload.materialize(model):
        for a, b in zip(ref.parameters(), model.parameters()):
            assert b.dtype == torch.bfloat16 and torch.equal(a, b)
    sd = opt.state_dict()
    for i, q in enumerate(masters):
        assert torch.equal(sd["state"][i]["master"], q)
        assert torch.equal(sd["state"][i]["exp_avg_sq"], opt_ref.state[q]["exp_avg_sq"])
    opt.close()
    tieroffload.close(model)


@pytest.mark.parametrize("config", ["nvme-nvme-grads", RAM_GRADS])
def test_bf16_host_step_in_backward_equals_fused_adamw_over_fp32_masters(config, tmp_path):
    """overlap="backward" with paged gradients: each chunk's host step runs from backward's
    hook once its units' gradients (the stored micro-batch's plus the last one's) are final."""
    torch.manual_seed(0)
    ref = TinyGPT().to(torch.bfloat16)
    model = offload(copy.deepcopy(ref), config, tmp_path)
    masters = [torch.nn.Parameter(p.detach().float()) for p in ref.parameters()]
    opt_ref = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, fused=True)
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                                overlap="backward", accumulation_steps=ACCUM)
    for step in range(4):
        for m in (ref, model):
            for micro in range(ACCUM):
                (m(batch(step, micro)).float().square().mean() / ACCUM).backward()
        assert len(opt._stepped) == len(opt.chunks)  # every chunk stepped inside backward
        manual_master_step(ref, masters, opt_ref, None)
        opt.step()
        opt.zero_grad()
    with tieroffload.materialize(model):
        for a, b in zip(ref.parameters(), model.parameters()):
            assert torch.equal(a, b)
    opt.close()
    tieroffload.close(model)


class Branchy(torch.nn.Module):
    """``b`` runs only when asked: a unit whose chunk gets no gradient from some micro-batch."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x, use_b):
        h = self.a(x)
        return self.c(h + self.b(h) if use_b else h)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("config", ["nvme-nvme-grads", RAM_GRADS])
def test_a_unit_without_gradients_in_the_last_micro_batch_steps_after_backward(config, dtype,
                                                                              tmp_path):
    """overlap="backward": a chunk one of whose units got no gradient in the last micro-batch
    steps in step(), from what the first stored; the read started for an in-backward merge
    that did not happen is finished, not left to hand a freed buffer to the next step. fp32
    parameters are stepped in place (the reference's fp32 masters then equal them)."""
    if dtype == torch.float32 and config == RAM_GRADS:
        pytest.skip("the RAM home serves the host step, which fp32 on the CPU does not take")
    torch.manual_seed(0)
    ref = Branchy().to(dtype)
    model = offload(copy.deepcopy(ref), config, tmp_path)
    masters = [torch.nn.Parameter(p.detach().float()) for p in ref.parameters()]
    opt_ref = torch.optim.AdamW(masters, lr=1e-2, fused=True)
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=1e-2, overlap="backward",
                                accumulation_steps=ACCUM)
    for step, uses in enumerate([(True, False), (True, True), (False, True)]):
        for m in (ref, model):
            for micro, use_b in enumerate(uses):
                x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + micro))
                (m(x.to(dtype), use_b).float().square().mean() / ACCUM).backward()
        manual_master_step(ref, masters, opt_ref, None)
        opt.step()
        opt.zero_grad()
        with tieroffload.materialize(model):
            for a, b in zip(ref.parameters(), model.parameters()):
                assert torch.equal(a, b), step
    opt.close()
    tieroffload.close(model)

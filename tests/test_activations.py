"""Activation offload and AutoBatch: same gradients and losses, less memory."""

import copy
import functools
import os
import time

import pytest
import torch
from helpers import cached
from models import TinyGPT
from torch import nn
from torch.utils.checkpoint import checkpoint

import tieroffload
from tieroffload import AutoBatch, Policy
from tieroffload.compat.autograd import top_pack_hook
from tieroffload.utils import memory


class Stack(nn.Module):
    """Blocks of low arithmetic density (a missing wait shows up), optionally checkpointed."""

    def __init__(self, width: int = 128, depth: int = 6, ckpt: str | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width))
            for _ in range(depth))
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            if self.ckpt is None:
                x = b(x)
            else:
                x = checkpoint(b, x, use_reentrant=self.ckpt == "reentrant")
        return x


def grads_of(model: nn.Module, x: torch.Tensor, steps: int = 2):
    out = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        loss = model(x).float().square().mean()
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    return out


def assert_same(a, b):
    for (la, ga), (lb, gb) in zip(a, b):
        assert torch.equal(la, lb)
        for x, y in zip(ga, gb):
            assert torch.equal(x, y)


@cached
def stack_reference(ckpt: str | None):
    """The plain Stack, its input and its losses and gradients: the same for every tier and
    delay of test_gradients_match, so computed once per ``ckpt``."""
    torch.manual_seed(0)
    ref = Stack(ckpt=ckpt)
    x = torch.randn(1024, 128, requires_grad=ckpt == "reentrant")
    return ref, x, grads_of(ref, x)


@pytest.mark.parametrize("delay", [0.0, 0.004])
@pytest.mark.parametrize("ckpt", [None, "nonreentrant", "reentrant"])
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_gradients_match(tier, ckpt, delay, tmp_path):
    ref, x, want = stack_reference(ckpt)
    model = tieroffload.offload(copy.deepcopy(ref), Policy(
        params="cpu", device="cpu", nvme_dir=str(tmp_path), activations=tier,
        activation_threshold="64KiB"),
        _io_delay=functools.partial(time.sleep, delay) if delay else None)
    got = grads_of(model, x)
    assert_same(got, want)
    st = tieroffload.stats(model)["activations"]
    if tier == "cpu":  # compute is on the CPU: they are in RAM already, nothing moves
        assert st["offloaded"] == 0 and st["bytes_written"] == 0
    else:
        assert st["offloaded"] > 0 and st["bytes_written"] >= st["offloaded"] * (64 << 10) // 2
        assert st["bytes_read"] > 0
    tieroffload.close(model)


def test_transformer_with_params_on_nvme(tmp_path):
    """Views of one storage (attention's q, k, v) come back as the same views; parameters on
    NVMe are not saved twice."""
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=64)
    x = torch.randint(0, 97, (8, 64))
    want = grads_of(ref, x, steps=3)
    model = tieroffload.offload(copy.deepcopy(ref), Policy(
        params="nvme", nvme_dir=str(tmp_path), device="cpu", activations="nvme",
        activation_threshold="16KiB", cpu_budget=2 * 4 * 64 * 64 * 4 * 2),
        _io_delay=functools.partial(time.sleep, 0.002))
    assert_same(grads_of(model, x, steps=3), want)
    st = tieroffload.stats(model)
    assert st["activations"]["offloaded"] > 0 and st["activations"]["bytes_read"] > 0
    tieroffload.close(model)


class Spectral(nn.Module):
    """Saves a complex tensor and its conjugate view, and a negative view: lazy flags over the
    same bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)
        self.head = nn.Linear(33, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        X = torch.fft.rfft(self.proj(x))
        power = (X * X.conj()).real
        return self.head(power * torch._neg_view(power))


def test_conjugate_and_negative_views_come_back_with_their_flags(tmp_path):
    torch.manual_seed(0)
    ref = Spectral()
    x = torch.randn(64, 64)
    want = grads_of(ref, x)
    model = tieroffload.offload(copy.deepcopy(ref), Policy(
        params="cpu", device="cpu", nvme_dir=str(tmp_path), activations="nvme",
        activation_threshold=0))
    assert_same(grads_of(model, x), want)
    assert tieroffload.stats(model)["activations"]["offloaded"] > 0
    tieroffload.close(model)


def test_swap_space_is_reused_and_removed(tmp_path):
    torch.manual_seed(0)
    model = tieroffload.offload(Stack(), Policy(device="cpu", nvme_dir=str(tmp_path),
                                                activations="nvme", activation_threshold=4096))
    x = torch.randn(512, 128)
    grads_of(model, x, steps=1)
    model._tieroffload.activations.retire(block=True)
    swap = model._tieroffload.swap
    size = swap.capacity
    assert size > 0 and swap._free == [(0, size)]  # all extents back once the graph is gone
    grads_of(model, x, steps=3)
    assert swap.capacity == size  # later iterations reuse the space
    path = swap.path
    assert os.path.exists(path)
    tieroffload.close(model)
    assert not os.path.exists(path)


def test_peak_memory_drops_by_the_offloaded_bytes(tmp_path):
    if not memory.reset_peak_rss():
        pytest.skip("cannot reset the peak RSS here")
    memory.return_freed_memory()
    torch.manual_seed(0)
    width, batch = 512, 4096  # each saved activation is 8 MiB
    x = torch.randn(batch, width)

    def peak_of(model: nn.Module) -> int:
        grads_of(model, x, steps=1)  # warm up allocator and swap space
        model.zero_grad(set_to_none=True)
        before = memory.rss()
        memory.reset_peak_rss()
        model(x).square().mean().backward()
        return memory.peak_rss() - before

    ref = Stack(width, depth=8)
    base = peak_of(ref)
    model = tieroffload.offload(copy.deepcopy(ref), Policy(
        device="cpu", nvme_dir=str(tmp_path), activations="nvme", prefetch="16MiB"))
    peak = peak_of(model)
    st = tieroffload.stats(model)["activations"]
    offloaded = st["bytes_written"] // 2  # two iterations ran
    tieroffload.close(model)
    # Saved per block: the Linear's and the LayerNorm's inputs and the GELU's: 24 MiB.
    assert offloaded >= 8 * 16 * 2**20
    assert base - peak >= offloaded // 2, (base, peak, offloaded)


@pytest.mark.parametrize("prefetch", [1, 3, "1MiB"])
def test_a_slow_disk_slows_forward_rather_than_holding_more_activations(prefetch, tmp_path):
    """Writes not yet done hold their activations: forward waits for them once the prefetch
    window and one record more are in flight, as the planner counts, however slow the disk."""
    torch.manual_seed(0)
    ref = Stack(depth=8)
    x = torch.randn(1024, 128)  # each saved activation is 512 KiB
    want = grads_of(ref, x)
    model = tieroffload.offload(copy.deepcopy(ref), Policy(
        device="cpu", nvme_dir=str(tmp_path), activations="nvme", activation_threshold="64KiB",
        prefetch=prefetch), _io_delay=functools.partial(time.sleep, 0.02))
    assert_same(grads_of(model, x), want)
    st = tieroffload.stats(model)["activations"]
    record = 1024 * 128 * 4
    window = prefetch * record if isinstance(prefetch, int) else 1 << 20
    assert st["offloaded"] >= 16 and st["peak_inflight"] <= window + record, st
    tieroffload.close(model)


def test_a_keyboard_interrupt_in_forward_leaves_no_hooks_that_page_other_code(tmp_path):
    """torch skips always-call forward hooks on a KeyboardInterrupt, so the pager's saved-tensor
    hooks stay pushed: the model's next forward takes them off, and nothing else is paged."""
    torch.manual_seed(0)
    ref = Stack(depth=4)
    x = torch.randn(256, 128)
    want = grads_of(ref, x, steps=1)
    model = tieroffload.offload(copy.deepcopy(ref), Policy(
        device="cpu", nvme_dir=str(tmp_path), activations="nvme", activation_threshold="4KiB",
        prefetch=1), _io_delay=functools.partial(time.sleep, 0.002))
    calls = []

    def interrupt(module, args, output):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt

    handle = model.blocks[2].register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(x)
    assert_same(grads_of(model, x, steps=1), want)
    handle.remove()
    assert top_pack_hook() is None
    offloaded = tieroffload.stats(model)["activations"]["offloaded"]
    plain = copy.deepcopy(ref)
    grads_of(plain, x, steps=1)
    assert tieroffload.stats(model)["activations"]["offloaded"] == offloaded
    tieroffload.close(model)
    assert_same(grads_of(plain, x, steps=1), want)


def test_saved_tensor_hooks_disabled_by_the_user_refuse_training_only(tmp_path):
    torch.manual_seed(0)
    ref = Stack(depth=2)
    x = torch.randn(64, 128)
    model = tieroffload.offload(copy.deepcopy(ref), Policy(
        device="cpu", nvme_dir=str(tmp_path), activations="nvme", activation_threshold="4KiB"))
    with torch.autograd.graph.disable_saved_tensors_hooks("not in this region"):
        with torch.no_grad():
            assert torch.equal(model(x), ref(x))
        with pytest.raises(RuntimeError, match=r"activations='nvme'.*\(not in this region\)"):
            model(x)
    assert_same(grads_of(model, x, steps=1), grads_of(ref, x, steps=1))
    tieroffload.close(model)


def test_bad_activation_policy(tmp_path):
    with pytest.raises(ValueError, match="activations"):
        Policy(activations="disk")
    with pytest.raises(ValueError, match="nvme_dir"):
        Policy(activations="nvme")
    with pytest.raises(ValueError, match="activation_threshold"):
        Policy(activations="cpu", activation_threshold="lots")


# -- AutoBatch -----------------------------------------------------------------------------------

PER_SAMPLE = 32 << 20


class Hungry(nn.Module):
    """A small model whose backward needs PER_SAMPLE bytes per sample, saved in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        big = x[:, :1].repeat(1, PER_SAMPLE // 4)  # saved by the multiply below
        return self.lin(x).squeeze(1) * big.mean(1)


def train(batches, micro=None, fail_at=None, budget=None):
    torch.manual_seed(0)
    model = Hungry()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    auto = AutoBatch(len(batches[0][0]), budget, model=model, optimizer=opt,
                     start=micro or 1, device="cpu")
    failed = []

    def fn(part):
        if fail_at is not None and len(part[0]) >= fail_at and not failed:
            failed.append(len(part[0]))
            raise torch.OutOfMemoryError("injected")
        x, y = part
        return (model(x) - y).square().mean()

    losses, micros = [], []
    for x, y in batches:
        if micro is not None:
            auto.micro = micro  # a fixed micro-batch: the reference run
        losses.append(auto.backward(fn, (x, y)).item())
        micros.append(auto.micro)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, micros, auto


def make_batches(n: int = 8, size: int = 16):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(size, 16, generator=g), torch.randn(size, generator=g))
            for _ in range(n)]


def test_autobatch_converges_to_the_largest_fitting_micro_batch():
    if not memory.reset_peak_rss():
        pytest.skip("cannot measure peak RSS here")
    memory.return_freed_memory()
    batches = make_batches()
    # The reference first: it also makes what a first run allocates once (thread pools, lazy
    # kernels), which would otherwise count against the budget as if it were per sample.
    ref, _, _ = train(batches, micro=16)
    budget = memory.rss() + int(5.5 * PER_SAMPLE)
    losses, micros, auto = train(batches, budget=budget)
    assert micros[-1] == 5 and micros[-2] == 5, micros
    assert micros[0] > 1  # it grew
    assert losses == pytest.approx(ref, rel=1e-5, abs=1e-6)
    assert auto.stats()["changes"] and auto.stats()["accumulation"] == 4


def test_autobatch_recovers_from_out_of_memory_without_losing_a_step():
    batches = make_batches(6)
    losses, micros, auto = train(batches, fail_at=4, budget="1TiB")
    assert auto.ooms == 1 and auto.steps == len(batches)
    assert micros[-3:] == [3, 3, 3]  # the largest under the size that failed
    assert any("out of memory" in c["why"] for c in auto.changes)
    ref, _, _ = train(batches, micro=16)
    assert losses == pytest.approx(ref, rel=1e-5, abs=1e-6)


def test_autobatch_refuses_a_budget_one_sample_overruns():
    """Once a micro-batch of 1 sample peaks over the budget there is nothing smaller to try:
    a MemoryError with both numbers, not a run over budget for ever."""
    if not memory.reset_peak_rss():
        pytest.skip("cannot measure peak RSS here")
    model = nn.Linear(16, 1)
    auto = AutoBatch(4, "1MiB", model=model, device="cpu")  # under the process's own RSS
    with pytest.raises(MemoryError, match=r"1 sample peaked at \d+ bytes.*budget of 1048576"):
        auto.backward(lambda p: model(p).square().mean(), torch.randn(4, 16))


def test_autobatch_reports_in_offload_stats(tmp_path):
    model = tieroffload.offload(nn.Linear(16, 1), Policy(device="cpu"))
    auto = AutoBatch(4, "1TiB", model=model, device="cpu")
    auto.backward(lambda p: model(p).square().mean(), torch.randn(4, 16))
    assert tieroffload.stats(model)["autobatch"]["steps"] == 1
    with pytest.raises(ValueError, match="8 samples"):
        auto.backward(lambda p: model(p).sum(), torch.randn(8, 16))


def test_the_activation_swap_file_stays_flat_however_fast_its_writes_are(tmp_path):
    """A storage saved twice in one forward (attention's q, k and v from one input) is paged
    once, whether its first write is still on its way or done by the second save: every step
    then pages the same records, and the swap file does not grow once warmed up. (It grew
    16% in 100 steps where fast writes paged a storage twice in some steps.) The first steps
    write slowly (all in flight); the later ones wait for each write before the next save."""
    slow = [True]
    model = tieroffload.offload(TinyGPT(), Policy(
        params="cpu", device="cpu", nvme_dir=str(tmp_path), activations="nvme",
        activation_threshold=0), _io_delay=lambda: time.sleep(0.002) if slow[0] else None)
    pager = model._tieroffload.activations
    pack = pager.pack

    def pack_then_wait(t):
        h = pack(t)
        if not slow[0]:
            pager.retire(block=True)
        return h

    pager.pack = pack_then_wait
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    sizes = []
    for step in range(8):
        slow[0] = step < 3
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
        sizes.append(os.path.getsize(model._tieroffload.swap.path))
    assert sizes[2:] == [sizes[2]] * 6, sizes
    tieroffload.close(model)

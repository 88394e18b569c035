"""The paged optimizer and checkpoints: the same training as plain PyTorch, bit for bit."""

import contextlib
import copy
import errno
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import mounted
from helpers import ADAMW, cpu_policy, offloaded_pair
from models import CheckpointedGPT, TinyGPT, mlp
from torch import nn
from torch.utils.checkpoint import checkpoint

import tieroffload
from tieroffload import Policy
from tieroffload.aio.buffers import aligned_empty
from tieroffload.compat.tensors import plain_tensors
from tieroffload.testing.models import GPT

CONFIGS = {  # (params, optimizer state, gradients)
    "cpu-cpu": ("cpu", "cpu", None),
    "cpu-nvme": ("cpu", "nvme", None),
    "nvme-nvme": ("nvme", "nvme", None),
    "nvme-nvme-grads": ("nvme", "nvme", "nvme"),
}


def policy(config: str, tmp_path) -> Policy:
    params, optim, grads = CONFIGS[config]
    budget = "80KiB" if params == "nvme" else None  # a few units: chunks really stream
    return cpu_policy(tmp_path, params=params, optimizer=optim, grads=grads, cpu_budget=budget)


def batch(step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, 97, (2, 16), generator=g)


def warmup(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))


def train(model, opt, sched, steps, start=0, accumulate=2):
    losses = []
    for step in range(start, steps):
        for micro in range(accumulate):
            loss = model(batch(step, micro)).float().square().mean() / accumulate
            loss.backward()
            losses.append(loss.item())
        opt.step()
        sched.step()
        opt.zero_grad()
    return losses


def adamw_pair(config: str, delay: float, overlap, tmp_path, make=TinyGPT, **opt_kw):
    """A TinyGPT (or ``make()``) and its offloaded copy, with plain AdamW and the paged one."""
    ref, model = offloaded_pair(make, policy(config, tmp_path),
                                _io_delay=(lambda: time.sleep(delay)) if delay else None)
    opt_ref = torch.optim.AdamW(ref.parameters(), fused=True, **ADAMW)
    return ref, model, opt_ref, tieroffload.optimizer(model, torch.optim.AdamW,
                                                      overlap=overlap, **ADAMW, **opt_kw)


def assert_same_params(ref, model) -> None:
    """Parameters equal, bit for bit."""
    with tieroffload.materialize(model):
        for (n, a), b in zip(ref.named_parameters(), model.parameters()):
            assert torch.equal(a, b), n


def assert_same_state(ref, model, opt_ref, opt) -> None:
    """Parameters and optimizer state equal, bit for bit."""
    assert_same_params(ref, model)
    sd, sd_ref = opt.state_dict(), opt_ref.state_dict()
    assert sd["state"].keys() == sd_ref["state"].keys()
    for i, st in sd_ref["state"].items():
        for k, v in st.items():
            assert torch.equal(sd["state"][i][k], v), (i, k)


def train_both_on_two_micro_batches(ref, model, opt_ref, opt, steps: int) -> None:
    """Trains the offloaded model (gradients on NVMe) and the plain one on two micro-batches a
    step: no gradient stays in memory, an in-backward step (accumulation_steps=2) steps every
    chunk in the second backward and none in the first, and both end in the same state."""
    in_backward = opt.overlap == "backward" and opt.accumulation_steps == 2
    for m, o in ((model, opt), (ref, opt_ref)):
        for step in range(steps):
            for micro in range(2):
                m(batch(step, micro)).float().square().mean().backward()
                if m is model:
                    assert all(p.grad is None for p in model.parameters())
                    assert len(opt._stepped) == (len(opt.chunks) if micro and in_backward
                                                 else 0)
            o.step()
            o.zero_grad()
    assert_same_state(ref, model, opt_ref, opt)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("delay", [0.0, 0.002])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_eight_adamw_steps_match_pytorch(config, delay, overlap, tmp_path):
    """overlap: with paged parameters, each chunk's update waits for the next forward (with
    the learning rate of its step, although the scheduler has moved on)."""
    if delay and CONFIGS[config][1] != "nvme":
        pytest.skip("no I/O to delay")
    if not overlap and CONFIGS[config][0] != "nvme":
        pytest.skip("updates are deferred only where parameters are paged")
    ref, model, opt_ref, opt = adamw_pair(config, delay, overlap, tmp_path)
    assert opt.overlap == (overlap and CONFIGS[config][0] == "nvme")
    if CONFIGS[config][0] == "nvme":
        assert len(opt.chunks) > 2
    assert train(model, opt, warmup(opt), 8) == train(ref, opt_ref, warmup(opt_ref), 8)
    assert bool(opt._pending) == opt.overlap  # the last step waits for a use
    assert_same_state(ref, model, opt_ref, opt)
    if CONFIGS[config][1] == "nvme":
        assert tieroffload.stats(model)["bytes_written"]["nvme"] > 0
    opt.close()
    tieroffload.close(model)


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("delay", [0.0, 0.002])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_step_in_backward_matches_pytorch(config, delay, accumulate, tmp_path):
    """overlap="backward": each chunk steps during the last micro-batch's backward, as soon
    as its gradients are final; eight steps (warm-up and after) give the same losses,
    parameters and state as plain PyTorch."""
    if delay and CONFIGS[config][1] != "nvme":
        pytest.skip("no I/O to delay")
    ref, model, opt_ref, opt = adamw_pair(config, delay, "backward", tmp_path,
                                          accumulation_steps=accumulate)
    paged = CONFIGS[config][0] == "nvme"
    sched, sched_ref = warmup(opt), warmup(opt_ref)
    for step in range(8):
        losses = []
        for micro in range(accumulate):
            loss = model(batch(step, micro)).float().square().mean() / accumulate
            loss.backward()
            losses.append(loss.item())
            # with paged parameters every chunk has stepped after the last micro-batch, and
            # no gradient is left; none before it
            last = micro == accumulate - 1
            assert len(opt._stepped) == (len(opt.chunks) if paged and last else 0)
        assert all(p.grad is None for p in model.parameters()) == paged
        opt.step()
        sched.step()
        opt.zero_grad()
        assert losses == train(ref, opt_ref, sched_ref, step + 1, step, accumulate), step
    assert_same_state(ref, model, opt_ref, opt)
    # one backward more than accumulation_steps before step() would step the chunks twice
    for micro in range(accumulate):
        model(batch(0, micro)).square().mean().backward()
    if paged:
        with pytest.raises(RuntimeError, match="accumulation_steps"):
            model(batch(0, 9)).square().mean().backward()
    opt.close()
    tieroffload.close(model)


def large_embedding_pair(tmp_path):
    """A GPT whose embedding's chunk is twice the others' (12 chunks under 768 KiB) and its
    offloaded copy, with plain AdamW and the paged one stepping in backward."""
    torch.manual_seed(0)
    ref = GPT(1024, 64, 8, 4, 16)
    model = tieroffload.offload(copy.deepcopy(ref), Policy(
        params="nvme", optimizer="nvme", nvme_dir=str(tmp_path), device="cpu",
        cpu_budget="768KiB"))
    kw = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    opt_ref = torch.optim.AdamW(ref.parameters(), fused=True, **kw)
    return ref, model, opt_ref, tieroffload.optimizer(model, torch.optim.AdamW,
                                                      overlap="backward", **kw)


def test_the_state_backward_steps_first_is_read_in_the_forward_before_it(tmp_path):
    """With overlap="backward", the forward whose backward steps reads the state of the last
    chunks as it reaches them (backward steps those first), where the disk has time to spare,
    and backward reads ahead past the next chunk where small chunks leave room. Either way the
    state in memory stays within twice the largest chunk's (one more where the next chunk does
    not fit), a forward without gradients reads none, and training is PyTorch's bit for bit."""
    ref, model, opt_ref, opt = large_embedding_pair(tmp_path)

    def held() -> list[int]:
        return [i for i, c in enumerate(opt.chunks)
                if c.state_unit is not None and c.state_unit.state.value != "away"]

    def nbytes(chunks: list[int]) -> int:
        return sum(opt.chunks[i].state_unit.nbytes for i in chunks)

    peaks = []
    page_in = opt._page_in

    def counting_page_in(chunk) -> None:
        page_in(chunk)
        peaks.append(nbytes(held()))

    opt._page_in = counting_page_in
    for step in range(4):
        for m, o in ((model, opt), (ref, opt_ref)):
            loss = m(batch(step, 0)).float().square().mean()
            if m is model and step:
                sizes = [c.state_unit.nbytes for c in opt.chunks]
                window = 2 * max(sizes)
                tail = held()
                assert tail == list(range(len(sizes) - len(tail), len(sizes)))
                assert len(tail) > 1 and nbytes(tail) <= window < nbytes(tail) + sizes[tail[0] - 1]
                peaks.clear()
            loss.backward()
            if m is model and step:
                assert max(peaks) <= window + max(sizes) < sum(sizes)
            o.step()
            o.zero_grad()
    model._tieroffload.mover.submit(lambda: None).wait()
    with torch.no_grad():
        model(batch(0, 0))
    assert held() == []
    assert_same_state(ref, model, opt_ref, opt)
    opt.close()
    tieroffload.close(model)


def test_step_in_backward_returns_while_the_last_state_store_goes_on(tmp_path):
    """With overlap="backward", step() does not wait for the state stores backward started
    last: they go on beside the next forward, whose acquires free their memory once done (or
    keep it, for the chunk that backward steps first). Here every move after the embedding's
    gradient arrives is held until step() has returned; the training stays bit for bit that
    of plain PyTorch."""
    armed, go, held_past_step = threading.Event(), threading.Event(), []

    def delay() -> None:  # the mover's thread, before each move
        if armed.is_set() and not go.wait(timeout=5):
            held_past_step.append(True)  # step() waited for this move
            go.set()

    torch.manual_seed(0)
    ref = TinyGPT()
    model = tieroffload.offload(copy.deepcopy(ref), Policy(
        params="nvme", optimizer="nvme", nvme_dir=str(tmp_path), device="cpu",
        cpu_budget="64MiB"), _io_delay=delay)
    kw = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    opt_ref = torch.optim.AdamW(ref.parameters(), fused=True, **kw)
    opt = tieroffload.optimizer(model, torch.optim.AdamW, overlap="backward", **kw)
    # The embedding's output gradient comes before its weight's, the last chunk's step and
    # that chunk's state store.
    def arm_in_backward(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        def arm(grad: torch.Tensor) -> None:
            model._tieroffload.mover.submit(lambda: None).wait()  # the moves before: done
            armed.set()

        if out.requires_grad and steps_done == [2]:
            out.register_hook(arm)

    model.wte.register_forward_hook(arm_in_backward)
    steps_done = [0]
    for step in range(4):
        steps_done[0] = step
        for m, o in ((model, opt), (ref, opt_ref)):
            m(batch(step, 0)).float().square().mean().backward()
            o.step()
            o.zero_grad()
        if step == 2:
            assert armed.is_set() and opt.held()["optimizer"][0]  # the store holds its state
            go.set()
            armed.clear()
    assert not held_past_step
    # Once written, the next forward's acquires free the stored state, and the pages kept
    # for reading state (a forward without gradients does not read any ahead).
    model._tieroffload.mover.submit(lambda: None).wait()
    with torch.no_grad():
        model(batch(0, 0))
    memory = tieroffload.stats(model)["memory"]
    assert memory["optimizer"] == memory["parked"] == 0, memory
    assert_same_state(ref, model, opt_ref, opt)
    opt.close()
    tieroffload.close(model)


@pytest.mark.parametrize("overlap", [True, "backward"])
def test_reentrant_checkpointing_with_accumulation(overlap, tmp_path):
    """Blocks checkpointed with use_reentrant=True run a backward of their own inside the
    model's: it is not a micro-batch of its own, nor the end of the model's backward."""
    kw = {"accumulation_steps": 2} if overlap == "backward" else {}
    ref, model, opt_ref, opt = adamw_pair("nvme-nvme-grads", 0.0, overlap, tmp_path,
                                          make=CheckpointedGPT, **kw)
    train_both_on_two_micro_batches(ref, model, opt_ref, opt, 4)
    opt.close()
    tieroffload.close(model)


class TwiceCheckpointedGPT(TinyGPT):
    """TinyGPT whose first block runs twice, in two reentrant checkpoint segments: its
    parameters get one gradient per segment, each accumulated on its own."""

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        x = checkpoint(self.blocks[0], x, use_reentrant=True)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True)
        return self.head(self.ln_f(x))


def test_a_module_in_two_reentrant_segments_is_named_under_step_in_backward(tmp_path):
    """Deferred steps take both segments' gradients as PyTorch does; a step inside backward
    cannot (the chunk steps on the first), and the error says why rather than blaming
    accumulation_steps."""
    ref, model, opt_ref, opt = adamw_pair("nvme-nvme-grads", 0.0, True, tmp_path,
                                          make=TwiceCheckpointedGPT)
    train_both_on_two_micro_batches(ref, model, opt_ref, opt, 2)
    opt.close()
    tieroffload.close(model)
    _, model, _, opt = adamw_pair("nvme-nvme-grads", 0.0, "backward", tmp_path,
                                  make=TwiceCheckpointedGPT)
    with pytest.raises(RuntimeError, match="second gradient in one micro-batch.*use_reentrant"):
        model(batch(0, 0)).float().square().mean().backward()
    opt.close()
    tieroffload.close(model)


def home_bytes(u) -> torch.Tensor:
    """What the unit's NVMe home holds now."""
    buf = aligned_empty(u.flat.numel(), pin=False)
    u.home.swap.file.pread(buf, u.home.offset).result()
    return buf[:u.nbytes]


def test_an_update_in_backward_is_written_home_while_backward_runs(tmp_path):
    """With overlap="backward", the parameters a chunk's update changed are written home
    during backward, not when a later eviction needs their memory (which, under a small
    budget, sent every updated unit to the disk at once, ahead of the reads backward waited
    for). Under a budget that evicts nothing, backward leaves each home equal to its unit."""
    torch.manual_seed(0)
    model = tieroffload.offload(TinyGPT(), Policy(params="nvme", optimizer="nvme",
                                                  nvme_dir=str(tmp_path), device="cpu",
                                                  cpu_budget="64MiB"))
    opt = tieroffload.optimizer(model, torch.optim.AdamW, overlap="backward", lr=1e-2)
    units = model._tieroffload.units
    for step in range(2):
        model(batch(step, 0)).float().square().mean().backward()
        assert len(opt._stepped) == len(opt.chunks)
        model._tieroffload.scheduler.drain()
        for u in units:
            assert u.state.value == "resident" and not u.changed, u
            assert torch.equal(home_bytes(u), u.flat[:u.nbytes]), u
        opt.step()
        opt.zero_grad()
    opt.close()
    tieroffload.close(model)


def test_a_unit_changed_while_its_write_behind_is_on_its_way_is_written_again(tmp_path):
    """A write in place that no hook sees (as ``nn.Embedding(max_norm=...)`` renormalising
    rows inside forward) after ``write_behind`` started: evicting the unit waits for that
    write and writes the later values after it, so the home ends with them."""
    torch.manual_seed(0)
    model = tieroffload.offload(mlp(), Policy(params="nvme", nvme_dir=str(tmp_path),
                                              device="cpu", cpu_budget="64MiB"))
    sched = model._tieroffload.scheduler
    u = model._tieroffload.units[0]
    sched.acquire([u], record=False)
    sched.release([u])
    with plain_tensors(), torch.no_grad():
        p = u.params[0]
        p.add_(1.0)
        sched.write_behind([u])
        u.ticket.wait()  # done, not yet seen done by the scheduler
        p.mul_(3.0)
        expected = p.clone()
    sched.evict(u)
    sched.drain()
    assert u.state.value == "away"
    with tieroffload.materialize(model):
        assert torch.equal(u.params[0], expected)
    tieroffload.close(model)


@pytest.mark.parametrize("zero", ["opt", "model", "none"])
@pytest.mark.parametrize("overlap", [True, "backward"])
def test_a_backward_after_step_without_zero_grad_is_refused(overlap, zero, tmp_path):
    """PyTorch adds a backward's gradients to those p.grad kept from the last step unless
    zero_grad() came between; the paged optimizer lets them go at step(), so that backward
    is refused before it computes anything, and after opt.zero_grad() or model.zero_grad()
    training equals PyTorch's."""
    ref, model, opt_ref, opt = adamw_pair("nvme-nvme", 0.0, overlap, tmp_path)
    for step in range(3):
        for m, o in ((ref, opt_ref), (model, opt)):
            m(batch(step, 0)).float().square().mean().backward()
            o.step()
            if zero == "opt":
                o.zero_grad()
            elif zero == "model":
                m.zero_grad()
        if zero == "none":
            with pytest.raises(RuntimeError, match="no zero_grad"):
                model(batch(step + 1, 0)).float().square().mean().backward()
            break
    else:
        assert_same_state(ref, model, opt_ref, opt)
    opt.close()
    tieroffload.close(model)


@pytest.mark.parametrize("clip", ["norm", "value", "with_norm"])
def test_clipping_after_an_in_backward_step_is_refused(clip, tmp_path):
    """With overlap="backward" the chunks have stepped when backward returns: p.grad is None,
    and torch's clips would clip nothing (clip_grad_norm_ returning a norm of 0). Each says so
    instead, and the step goes on."""
    ref, model, opt_ref, opt = adamw_pair("nvme-nvme", 0.0, "backward", tmp_path)
    model(batch(0, 0)).float().square().mean().backward()
    params = list(model.parameters())
    with pytest.raises(RuntimeError, match="used up"):
        if clip == "norm":
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        elif clip == "value":
            torch.nn.utils.clip_grad_value_(params, 1.0)
        else:
            torch.nn.utils.clip_grads_with_norm_(params, 1.0, torch.tensor(2.0))
    opt.step()
    opt.zero_grad()
    ref(batch(0, 0)).float().square().mean().backward()
    opt_ref.step()
    assert_same_params(ref, model)
    opt.close()
    tieroffload.close(model)


def test_step_in_backward_early_step(tmp_path):
    """A step() after fewer micro-batches than accumulation_steps (an epoch's end) steps what
    was accumulated, as plain PyTorch does, and the next steps count afresh."""
    ref, model, opt_ref, opt = adamw_pair("nvme-nvme-grads", 0.0, "backward", tmp_path,
                                          accumulation_steps=3)
    for m, o in ((model, opt), (ref, opt_ref)):
        for step, micros in enumerate((3, 1, 3, 2)):
            for micro in range(micros):
                m(batch(step, micro)).float().square().mean().backward()
            o.step()
            o.zero_grad()
    assert_same_state(ref, model, opt_ref, opt)
    opt.close()
    tieroffload.close(model)


def test_step_in_backward_under_autobatch(tmp_path):
    """AutoBatch tells the in-backward step how many micro-batches each batch has (two, then
    one as the micro-batch grows): the same training as AutoBatch with plain AdamW."""
    ref, model, opt_ref, opt = adamw_pair("nvme-nvme-grads", 0.0, "backward", tmp_path)
    runs = []
    for m, o in ((model, opt), (ref, opt_ref)):
        auto = tieroffload.AutoBatch(4, "1TiB", start=2, model=m, optimizer=o, device="cpu")
        losses, micros = [], []
        for step in range(4):
            x = torch.cat([batch(step, 0), batch(step, 1)])
            loss = auto.backward(lambda part, m=m: m(part).float().square().mean(), x)
            losses.append(loss.item())
            micros.append(auto.micro)
            if o is opt:  # every chunk stepped in the batch's last backward
                assert opt.stepped_in_backward and len(opt._stepped) == len(opt.chunks)
            o.step()
            o.zero_grad()
        runs.append((losses, micros))
    assert runs[0] == runs[1]
    assert runs[0][1][0] == 4 and opt.accumulation_steps == 1  # it grew from 2
    assert_same_state(ref, model, opt_ref, opt)
    opt.close()
    tieroffload.close(model)


def test_step_in_backward_out_of_memory_is_not_redone(tmp_path):
    """An out-of-memory error in the last backward, after chunks have stepped, cannot be
    redone by AutoBatch: it says so instead of stepping them twice."""
    _, model, _, opt = adamw_pair("nvme-nvme-grads", 0.0, "backward", tmp_path)
    auto = tieroffload.AutoBatch(4, "1TiB", start=2, model=model, optimizer=opt, device="cpu")
    calls = []

    def fail_in_last_backward(grad):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("injected")
    next(model.parameters()).register_hook(fail_in_last_backward)  # the last grad backward makes
    x = torch.cat([batch(0, 0), batch(0, 1)])
    with pytest.raises(MemoryError, match="cannot be redone"):
        auto.backward(lambda part: model(part).float().square().mean(), x)
    opt.close()
    tieroffload.close(model)


@pytest.mark.parametrize("overlap", [True, "backward"])
def test_backward_that_raised_leaves_no_trace(overlap, tmp_path):
    """A backward that raises midway (an out-of-memory error that AutoBatch redoes) never
    reaches its end-of-backward callback, and may leave a unit with some of its gradients:
    after zero_grad, the next backwards count afresh (every unit's gradients paged once all
    are in, each chunk stepped once) and training goes on as if it had not run."""
    kw = {"accumulation_steps": 2} if overlap == "backward" else {}
    ref, model, opt_ref, opt = adamw_pair("nvme-nvme-grads", 0.0, overlap, tmp_path, **kw)
    fc = model.blocks[1].mlp[0]
    failing = [True]

    def fail_once(grad):
        if failing and failing.pop():
            raise torch.OutOfMemoryError("injected")
    fc.weight.register_hook(fail_once)
    with pytest.raises(torch.OutOfMemoryError):
        model(batch(0, 0)).float().square().mean().backward()
    opt.zero_grad()
    train_both_on_two_micro_batches(ref, model, opt_ref, opt, 3)
    opt.close()
    tieroffload.close(model)


@pytest.mark.parametrize("overlap,failing_micro",
                         [(True, 0), (True, 1), (True, 2), ("backward", 0), ("backward", 1)])
def test_a_backward_retried_without_zero_grad_adds_as_pytorch_adds(overlap, failing_micro,
                                                                   tmp_path):
    """3 micro-batches, gradients on NVMe: a backward that raises midway and is retried at
    once keeps what it accumulated, as PyTorch keeps it in ``p.grad``, and the retry adds to
    it in PyTorch's order (the same bits). With overlap="backward" it is no micro-batch:
    every chunk steps in the third backward that completes."""
    kw = {"accumulation_steps": 3} if overlap == "backward" else {}
    ref, model, opt_ref, opt = adamw_pair("nvme-nvme-grads", 0.0, overlap, tmp_path, **kw)

    def fail(grad):
        raise torch.OutOfMemoryError("injected")
    for m, o in ((ref, opt_ref), (model, opt)):
        for step in range(2):
            for micro in range(3):
                if step == 1 and micro == failing_micro:
                    hook = m.blocks[0].mlp[0].weight.register_hook(fail)
                    with pytest.raises(torch.OutOfMemoryError):
                        m(batch(step, micro)).float().square().mean().backward()
                    hook.remove()
                m(batch(step, micro)).float().square().mean().backward()
                if o is opt:
                    in_backward = micro == 2 and overlap == "backward"
                    assert len(opt._stepped) == (len(opt.chunks) if in_backward else 0)
            o.step()
            o.zero_grad()
    assert_same_state(ref, model, opt_ref, opt)
    opt.close()
    tieroffload.close(model)


class _FailingRead:
    """A mover ticket whose read arrives, then raises EIO, as a failed read does."""

    def __init__(self, ticket) -> None:
        self.ticket = ticket

    def done(self) -> bool:
        return self.ticket.done()

    def wait(self) -> None:
        self.ticket.wait()
        raise OSError(errno.EIO, "injected EIO on a state read")


@pytest.mark.parametrize("no_backward", [False, True])
def test_state_reads_ahead_that_failed_are_read_again_at_their_use(no_backward, tmp_path):
    """overlap="backward": the forward reads the state of several chunks ahead. Reads that
    fail there are read once more where backward needs them, rather than raising from
    backward after a chunk has stepped (a torn step) when the disk has recovered; the same
    when the forward that read them had no backward. Training is PyTorch's bit for bit."""
    ref, model, opt_ref, opt = large_embedding_pair(tmp_path)
    failing, failed = [False], []
    load = opt.mover.load

    def failing_load(unit):
        ticket = load(unit)
        if failing[0] and any(c.state_unit is unit for c in opt.chunks):
            failed.append(unit)
            return _FailingRead(ticket)
        return ticket

    opt.mover.load = failing_load
    for step in range(4):
        for m, o in ((model, opt), (ref, opt_ref)):
            failing[0] = m is model and step == 2
            loss = m(batch(step, 0)).float().square().mean()
            failing[0] = False
            if failed and no_backward:
                loss = m(batch(step, 0)).float().square().mean()
            loss.backward()
            o.step()
            o.zero_grad()
    assert len(failed) > 1
    assert_same_state(ref, model, opt_ref, opt)
    opt.close()
    tieroffload.close(model)


@pytest.mark.parametrize("first", [True, False])
def test_a_state_read_failing_twice_tears_only_the_chunks_that_stepped(first, tmp_path):
    """overlap="backward": a chunk's state read that fails, and fails again read once more,
    raises from backward before that chunk steps. Where it is the first chunk backward steps,
    nothing has changed: zero_grad() and the batch again train as PyTorch, bit for bit (the
    chunk counted as stepped and the step was refused as torn). Further on, the step is torn,
    and the message counts the chunks whose parameters did change."""
    ref, model, opt_ref, opt = large_embedding_pair(tmp_path)
    for step in range(2):
        for m, o in ((model, opt), (ref, opt_ref)):
            m(batch(step, 0)).float().square().mean().backward()
            o.step()
            o.zero_grad()
    target = opt.chunks[-1 if first else opt._window_start() - 1].state_unit
    left = [2]  # the read and its second try
    load = opt.mover.load

    def failing_load(unit):
        ticket = load(unit)
        if unit is target and left[0] > 0:
            left[0] -= 1
            return _FailingRead(ticket)
        return ticket

    opt.mover.load = failing_load
    with tieroffload.materialize(model):
        before = [[p.detach().clone() for p in c.params] for c in opt.chunks]
    with pytest.raises(OSError, match="injected EIO"):
        model(batch(2, 0)).float().square().mean().backward()
    assert left[0] == 0
    with tieroffload.materialize(model):
        changed = sum(any(not torch.equal(p, b) for p, b in zip(c.params, old))
                      for c, old in zip(opt.chunks, before))
    if not first:
        assert changed > 0
        with pytest.raises(RuntimeError, match=f"raised after {changed} of {len(opt.chunks)} "):
            opt.zero_grad()
        return
    assert changed == 0
    for m, o in ((model, opt), (ref, opt_ref)):
        o.zero_grad()
        m(batch(2, 0)).float().square().mean().backward()
        o.step()
        o.zero_grad()
    assert_same_state(ref, model, opt_ref, opt)
    opt.close()
    tieroffload.close(model)


@pytest.mark.parametrize("key,value,late", [("lr", 5e-3, 1e-3),
                                           ("betas", (0.8, 0.9), (0.7, 0.8))])
def test_a_hyperparameter_changed_between_backward_and_step_raises(key, value, late,
                                                                  tmp_path):
    """overlap="backward" has stepped every chunk when step() is called: a warm-up lr (or
    betas) written into param_groups just before it cannot apply, and step() says so, after
    finishing the step with what backward used; set before backward, it applies."""
    ref, model, opt_ref, opt = adamw_pair("nvme-nvme-grads", 0.0, "backward", tmp_path)
    for m, o in ((ref, opt_ref), (model, opt)):
        for step in range(2):
            if step == 1:
                o.param_groups[0][key] = value  # before backward: taken by this step
            m(batch(step, 0)).float().square().mean().backward()
            o.step()
            o.zero_grad()
    assert_same_state(ref, model, opt_ref, opt)
    model(batch(2, 0)).float().square().mean().backward()
    old = opt.param_groups[0][key]
    opt.param_groups[0][key] = late
    with pytest.raises(RuntimeError, match=f"param group 0's '{key}' changed from "
                                           f"{re.escape(repr(old))}.*before backward"):
        opt.step()
    assert not opt.stepped_in_backward
    opt.close()
    tieroffload.close(model)


def test_step_in_backward_refuses_loss_scaling(tmp_path):
    model = tieroffload.offload(TinyGPT(), policy("nvme-nvme", tmp_path))
    with pytest.raises(ValueError, match="loss scaling"):
        tieroffload.optimizer(model, torch.optim.AdamW, overlap="backward", loss_scale=1024.0)
    with pytest.raises(ValueError, match="overlap must be"):
        tieroffload.optimizer(model, torch.optim.AdamW, overlap="later")
    with pytest.raises(ValueError, match="accumulation_steps is for"):
        tieroffload.optimizer(model, torch.optim.AdamW, accumulation_steps=2)
    with pytest.raises(ValueError, match="accumulation_steps must be"):
        tieroffload.optimizer(model, torch.optim.AdamW, overlap="backward", accumulation_steps=0)
    tieroffload.close(model)


@pytest.mark.parametrize("config", ["nvme-nvme", "cpu-cpu"])
def test_a_parameter_from_outside_the_model_is_refused(config, tmp_path):
    """A parameter the model does not hold (a loss temperature) would never be stepped: the
    paged optimizer refuses it when built, naming its group and shape."""
    model = tieroffload.offload(TinyGPT(), policy(config, tmp_path))
    temp = nn.Parameter(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"parameter 0 of param group 1 \(shape \(\), "
                                         r"torch.float32\) is not a parameter of the offloaded"):
        tieroffload.optimizer(model, torch.optim.AdamW,
                              [{"params": model.parameters()}, {"params": [temp]}])
    ps = list(model.parameters())
    with pytest.raises(ValueError, match=f"parameter {len(ps)} of param group 0 .* listed twice"):
        tieroffload.optimizer(model, torch.optim.AdamW, ps + ps[:1])
    tieroffload.close(model)


def test_a_tensor_lr_and_an_inference_forward_between_deferred_steps(tmp_path):
    """A deferred update (overlap=True) takes the lr of its step(): a tensor lr, which a
    scheduler fills in place after step(), is copied then. Applied inside an
    inference_mode() forward, it makes state a later training step can still update."""
    torch.manual_seed(0)
    ref = TinyGPT()
    model = tieroffload.offload(copy.deepcopy(ref), policy("nvme-nvme-grads", tmp_path))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=torch.tensor(1e-2), fused=True)
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=torch.tensor(1e-2))
    for m, o in ((ref, opt_ref), (model, opt)):
        sched = torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5 ** s)
        for step in range(4):
            m(batch(step, 0)).float().square().mean().backward()
            o.step()
            o.zero_grad()
            sched.step()
            with torch.inference_mode():  # the deferred update happens here
                m(batch(step, 1))
    assert_same_state(ref, model, opt_ref, opt)
    opt.close()
    tieroffload.close(model)


def test_a_weight_written_between_an_in_backward_step_and_step_is_refused(tmp_path):
    """overlap="backward" has stepped the chunk when backward ends, so a write before step()
    (which PyTorch's step would update) is refused before it lands; deferred steps take it
    as PyTorch does."""
    ref, model, opt_ref, opt = adamw_pair("nvme-nvme-grads", 0.0, True, tmp_path)
    for m, o in ((ref, opt_ref), (model, opt)):
        m(batch(0, 0)).float().square().mean().backward()
        with torch.no_grad():
            m.head.weight.fill_(0.0)
        o.step()
        o.zero_grad()
    assert_same_state(ref, model, opt_ref, opt)
    opt.close()
    tieroffload.close(model)
    _, model, _, opt = adamw_pair("nvme-nvme-grads", 0.0, "backward", tmp_path)
    model(batch(0, 0)).float().square().mean().backward()
    before = model.head.weight.detach().clone()
    for write in (lambda: model.head.weight.fill_(0.0),
                  lambda: model.load_state_dict({"head.weight": torch.zeros_like(before)},
                                                strict=False)):
        with torch.no_grad(), pytest.raises(RuntimeError, match="'wte.weight' between backward"):
            write()
    assert torch.equal(model.head.weight, before)
    opt.step()
    opt.close()
    tieroffload.close(model)


def test_fp16_backward_of_an_unscaled_loss_and_a_skipped_in_backward_step_are_named(tmp_path):
    """With loss scaling on, step() after a backward of a loss not passed through
    scale_loss would step by 1/scale of the gradients; zero_grad() after an in-backward step
    cannot skip the batch. Both raise, naming the fix."""
    torch.manual_seed(0)
    model = tieroffload.offload(TinyGPT().half(), policy("nvme-nvme-grads", tmp_path))
    opt = tieroffload.optimizer(model, torch.optim.SGD, lr=0.1)
    model(batch(0, 0)).float().square().mean().backward()
    with pytest.raises(RuntimeError, match="loss scaling is on.*opt.scale_loss"):
        opt.step()
    opt.zero_grad()
    opt.scale_loss(model(batch(0, 0)).float().square().mean()).backward()
    opt.step()
    opt.close()
    tieroffload.close(model)
    _, model, _, opt = adamw_pair("nvme-nvme-grads", 0.0, "backward", tmp_path)
    model(batch(0, 0)).float().square().mean().backward()
    with pytest.raises(RuntimeError, match="cannot be skipped; call step"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()
    opt.close()
    tieroffload.close(model)


def masters_pair(dtype: torch.dtype, config: str, tmp_path, **opt_kw):
    """(a TinyGPT in ``dtype``, its offloaded copy, fp32 masters of the first, a fused AdamW
    over them, the paged AdamW over the copy with ``opt_kw``): lr 1e-2 both."""
    torch.manual_seed(0)
    ref = TinyGPT().to(dtype)
    model = tieroffload.offload(copy.deepcopy(ref), policy(config, tmp_path))
    masters = [torch.nn.Parameter(p.detach().float()) for p in ref.parameters()]
    opt_ref = torch.optim.AdamW(masters, lr=1e-2, fused=True)
    return ref, model, masters, opt_ref, tieroffload.optimizer(model, torch.optim.AdamW,
                                                                lr=1e-2, **opt_kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_closing_the_optimizer_applies_its_deferred_update(dtype, tmp_path):
    """overlap=True leaves each chunk's update for the next use of its parameters: close()
    applies it (the step was taken), and the model goes on without the optimizer."""
    ref, model, masters, opt_ref, opt = masters_pair(dtype, "nvme-nvme-grads", tmp_path)
    ref(batch(0, 0)).float().square().mean().backward()
    manual_master_step(ref, masters, opt_ref, None)
    model(batch(0, 0)).float().square().mean().backward()
    opt.step()
    assert opt._pending
    opt.close()
    assert_same_params(ref, model)
    tieroffload.close(model)


def test_an_optimizer_dropped_with_a_deferred_update_makes_way_once_it_is_applied(tmp_path):
    """Dropped (not closed) after a step() whose update was deferred, the old optimizer is
    held by the model until that update is applied: a new one over the same parameters is
    refused until then, naming how (materialize applies it); then it trains on."""
    ref, model, opt_ref, opt = adamw_pair("nvme-nvme-grads", 0.0, True, tmp_path)
    ref(batch(0, 0)).float().square().mean().backward()
    opt_ref.step()
    opt_ref.zero_grad()
    model(batch(0, 0)).float().square().mean().backward()
    opt.step()
    del opt  # dropped with its update deferred
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=1e-3)
    with pytest.raises(ValueError, match="another open paged optimizer.*materialize"):
        model(batch(1, 0))
    with tieroffload.materialize(model):
        pass
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    for m, o in ((ref, opt_ref), (model, opt)):
        m(batch(1, 0)).float().square().mean().backward()
        o.step()
        o.zero_grad()
    assert_same_params(ref, model)
    opt.close()
    tieroffload.close(model)


def test_a_second_backward_through_one_graph_before_step_is_named(tmp_path):
    _, model, _, opt = adamw_pair("nvme-nvme-grads", 0.0, "backward", tmp_path)
    loss = model(batch(0, 0)).float().square().mean()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second gradient.*retain_graph=True.*before step"):
        loss.backward()
    opt.close()
    tieroffload.close(model)


@pytest.mark.parametrize("overlap", [True, False])
def test_frozen_units_are_not_written_home_by_the_step(overlap, tmp_path):
    """Fine-tuning with the base frozen and the optimizer over all of the model's parameters
    (the default): the step writes home only the units it changes, and the weights are those
    of an optimizer over the trainable parameters alone."""
    weights = []
    for only_trainable in (False, True):
        torch.manual_seed(0)
        model = TinyGPT()
        for p in model.parameters():
            p.requires_grad_(False)
        model.blocks[-1].requires_grad_(True)
        sub = tmp_path / str(only_trainable)
        sub.mkdir()
        tieroffload.offload(model, policy("nvme-nvme", sub))
        mover = model._tieroffload.mover
        stored, store = [], mover.store
        mover.store = lambda u, stored=stored, store=store: stored.append(u.name) or store(u)
        params = [p for p in model.parameters() if p.requires_grad] if only_trainable else None
        opt = tieroffload.optimizer(model, torch.optim.AdamW, params, lr=1e-2, overlap=overlap)
        for step in range(3):
            model(batch(step, 0)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        weights.append(model.state_dict())
        params_stored = [n for n in stored if not n.startswith("optimizer state")]
        assert params_stored and all(n.startswith("blocks.2") for n in params_stored), stored
        opt.close()
        tieroffload.close(model)
    for k, v in weights[1].items():
        assert torch.equal(weights[0][k], v), k


def test_opt_state_is_refused_rather_than_read_empty(tmp_path):
    """The state lives chunk by chunk in its tier: opt.state would read empty and drop
    writes (a moment reset), so any use of it raises and names state_dict instead."""
    model = tieroffload.offload(TinyGPT(), policy("nvme-nvme", tmp_path))
    opt = tieroffload.optimizer(model, torch.optim.AdamW)
    model(batch(0, 0)).float().square().mean().backward()
    opt.step()
    p = next(model.parameters())
    for use in (lambda: opt.state[p], lambda: len(opt.state), lambda: opt.state.clear(),
                lambda: setattr(opt, "state", {})):
        with pytest.raises(RuntimeError, match="not in opt.state.*state_dict"):
            use()
    assert opt.state_dict()["state"][0]["exp_avg"].shape == p.shape
    opt.close()
    tieroffload.close(model)


@pytest.mark.parametrize("close_model", [False, True])
@pytest.mark.parametrize("config", ["cpu-cpu", "nvme-nvme"])
def test_a_closed_optimizer_refuses_every_use_and_names_state_dict(config, close_model,
                                                                    tmp_path):
    """After opt.close() or tieroffload.close(model) the state is gone (with the swap space,
    where it was on NVMe): a step, zero_grad, clipping, state_dict or load_state_dict raises
    one error that says so, rather than a closed-file error, or a step of the restored model
    on state the optimizer no longer keeps. A second close does nothing."""
    model = tieroffload.offload(TinyGPT(), policy(config, tmp_path))
    opt = tieroffload.optimizer(model, torch.optim.AdamW)
    model(batch(0, 0)).float().square().mean().backward()
    opt.step()
    saved = opt.state_dict()
    if close_model:
        tieroffload.close(model)
    else:
        opt.close()
    opt.close()
    model(batch(0, 0)).float().square().mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    for use in (opt.step, opt.zero_grad, opt.state_dict, lambda: opt.load_state_dict(saved),
                lambda: opt.clip_grad_norm_(1.0)):
        with pytest.raises(RuntimeError, match="optimizer is closed.*state_dict"):
            use()
    if close_model:
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    else:
        tieroffload.close(model)


def test_generic_optimizer_and_param_groups(tmp_path):
    torch.manual_seed(0)
    ref = mlp()
    model = tieroffload.offload(copy.deepcopy(ref), policy("nvme-nvme", tmp_path))

    def groups(m):
        ps = list(m.parameters())
        return [{"params": ps[::2]}, {"params": ps[1::2], "lr": 0.05}]

    opt_ref = torch.optim.SGD(groups(ref), lr=0.1, momentum=0.9)
    opt = tieroffload.optimizer(model, torch.optim.SGD, groups(model), lr=0.1, momentum=0.9)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.05]
    for _ in range(5):
        x = torch.randn(4, 64)
        for m, o in ((ref, opt_ref), (model, opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    x = torch.randn(4, 64)
    assert torch.equal(ref(x), model(x))
    # state_dict / load_state_dict round trip into a fresh paged optimizer
    sd = opt.state_dict()
    opt2 = tieroffload.optimizer(model, torch.optim.SGD, groups(model), lr=0.1, momentum=0.9)
    opt2.load_state_dict(sd)
    for i, st in opt2.state_dict()["state"].items():
        assert torch.equal(st["momentum_buffer"], sd["state"][i]["momentum_buffer"])
    opt.close()
    opt2.close()
    tieroffload.close(model)


RESUME_CHILD = r"""
import sys, torch, tieroffload
sys.path.insert(0, sys.argv[1])
from models import TinyGPT
from test_optimizer import policy, train, warmup
import pathlib
torch.manual_seed(0)
model = tieroffload.offload(TinyGPT(), policy(sys.argv[3], pathlib.Path(sys.argv[2])))
opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=3e-3, weight_decay=0.1)
sched = warmup(opt)
extra = tieroffload.load_checkpoint(sys.argv[2] + "/ckpt", model, opt)
sched.load_state_dict(extra["sched"])
print(repr(train(model, opt, sched, 10, start=extra["step"])))
"""


@pytest.mark.parametrize("resume_config", ["nvme-nvme-grads", "cpu-cpu"])
def test_checkpoint_resume_in_new_process(tmp_path, resume_config):
    torch.manual_seed(0)
    model = tieroffload.offload(TinyGPT(), policy("nvme-nvme-grads", tmp_path))
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=3e-3, weight_decay=0.1)
    sched = warmup(opt)
    train(model, opt, sched, 5)
    tieroffload.save_checkpoint(tmp_path / "ckpt", model, opt,
                                extra={"sched": sched.state_dict(), "step": 5})
    uninterrupted = train(model, opt, sched, 10, start=5)
    opt.close()
    tieroffload.close(model)
    del model, opt  # destroy everything; a new process resumes (with another policy too)
    tests = os.path.dirname(__file__)
    r = subprocess.run([sys.executable, "-c", RESUME_CHILD, tests, str(tmp_path), resume_config],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": tests})
    assert r.returncode == 0, r.stderr
    assert eval(r.stdout.strip().splitlines()[-1]) == uninterrupted


@pytest.mark.parametrize("config", ["cpu-cpu", "nvme-nvme"])
def test_a_factored_optimizer_s_checkpoint_resumes_exactly(config, tmp_path):
    """transformers' Adafactor keeps row and column statistics, not of the parameter's shape:
    its checkpoint loads, and the run goes on as one never stopped."""
    optimization = pytest.importorskip("transformers.optimization")

    def build(where):
        torch.manual_seed(0)
        model = tieroffload.offload(TinyGPT(), policy(config, tmp_path / where))
        return model, tieroffload.optimizer(model, optimization.Adafactor, lr=1e-2,
                                            scale_parameter=False, relative_step=False)

    def steps(model, opt, first, n):
        for i in range(first, first + n):
            model(batch(i, 0)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        with tieroffload.materialize(model):
            return [p.detach().clone() for p in model.parameters()]

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    model, opt = build("a")
    steps(model, opt, 0, 3)
    tieroffload.save_checkpoint(tmp_path / "ck", model, opt)
    want = steps(model, opt, 3, 2)
    model2, opt2 = build("b")
    tieroffload.load_checkpoint(tmp_path / "ck", model2, opt2)
    assert all(torch.equal(a, b) for a, b in zip(steps(model2, opt2, 3, 2), want))
    for o, m in ((opt, model), (opt2, model2)):
        o.close()
        tieroffload.close(m)


def test_corrupt_and_truncated_checkpoints_are_refused(tmp_path):
    torch.manual_seed(0)
    model = tieroffload.offload(TinyGPT(), policy("nvme-nvme", tmp_path))
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=1e-3)
    train(model, opt, warmup(opt), 2)
    tieroffload.save_checkpoint(tmp_path / "good", model, opt, extra={"step": 2})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "good", bad)
    data = bad / "tensors.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(tieroffload.CheckpointError, match="fails its checksum"):
        tieroffload.load_checkpoint(bad, model, opt)
    data.write_bytes(bytes(raw[: len(raw) // 3]))
    with pytest.raises(tieroffload.CheckpointError, match="truncated"):
        tieroffload.load_checkpoint(bad, model, opt)
    with pytest.raises(tieroffload.CheckpointError, match="no checkpoint"):
        tieroffload.load_checkpoint(tmp_path / "nothing", model, opt)
    for k, v in model.state_dict().items():  # nothing was changed by the refusals
        assert torch.equal(v, before[k]), k
    assert tieroffload.load_checkpoint(tmp_path / "good", model, opt) == {"step": 2}
    opt.close()
    tieroffload.close(model)


def test_full_disk_keeps_previous_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = tieroffload.offload(mlp(width=256, depth=4), Policy(device="cpu"))
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=1e-3)
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    with mounted("tmpfs", "size=5m") as where:  # one checkpoint (~3.2 MB) fits, two do not
        path = os.path.join(where, "ckpt")
        tieroffload.save_checkpoint(path, model, opt, extra={"step": 1})
        opt.step()
        with pytest.raises(OSError) as ei:
            tieroffload.save_checkpoint(path, model, opt, extra={"step": 2})
        assert ei.value.errno == errno.ENOSPC
        assert os.listdir(where) == ["ckpt"]  # the partial one is gone
        assert tieroffload.load_checkpoint(path, model, opt) == {"step": 1}
    opt.close()


MEMORY_CHILD = r"""
import sys, torch, tieroffload
from torch import nn
from tieroffload.utils.memory import peak_rss, reset_peak_rss, rss
torch.manual_seed(0)
with torch.device("meta"):
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)])  # 64 MiB of params
tieroffload.offload(model, tieroffload.Policy(params="nvme", optimizer="nvme", grads="nvme",
                    nvme_dir=sys.argv[1], device="cpu", cpu_budget="16MiB"))
tieroffload.load_weights(model, nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)])
                         .state_dict())
backward = sys.argv[2] == "backward"
opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=1e-3, overlap="backward" if backward
                            else True, **({"accumulation_steps": 2} if backward else {}))
xs = torch.randn(2, 8, 1024)
def step():  # two micro-batches: the first one's gradients wait on NVMe
    for x in xs:
        loss = model(x).square().mean()
        loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()
step()
assert reset_peak_rss()
base = rss()
losses = [step() for _ in range(3)]
st = tieroffload.stats(model)
print(base, peak_rss(), st["budget"], st["overhead"], int(losses[-1] < losses[0]))
"""


@pytest.mark.parametrize("overlap", ["next-forward", "backward"])
def test_training_memory_stays_under_budget(overlap, tmp_path):
    """Parameters 64 MiB, Adam state 128 MiB (8x the 16 MiB budget), gradients 64 MiB;
    gradient accumulation 2."""
    r = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(tmp_path), overlap],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    base, peak, budget, overhead, learns = map(int, r.stdout.split())
    mib = 1 << 20
    assert learns == 1
    # The stated bound: budget + staging overhead + one optimizer chunk in flight (its state,
    # the next one's state and its gradients: 4 x budget / 4) + 16 MiB of activations and slack.
    assert peak - base <= 2 * budget + overhead + 16 * mib, (peak - base) / mib


def manual_master_step(ref, masters, opt_ref, scale):
    """The reference: fp32 masters stepped by plain torch AdamW, copied back rounded."""
    for q, p in zip(masters, ref.parameters()):
        q.grad = p.grad.float()
        if scale:
            q.grad.mul_(1.0 / scale)
    opt_ref.step()
    with torch.no_grad():
        for q, p in zip(masters, ref.parameters()):
            p.copy_(q)
    ref.zero_grad()
    opt_ref.zero_grad()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", ["cpu-cpu", "nvme-nvme-grads"])
def test_mixed_precision_fp32_masters(dtype, config, tmp_path):
    scale = 256.0 if dtype == torch.float16 else None
    ref, model, masters, opt_ref, opt = masters_pair(dtype, config, tmp_path, loss_scale=scale)
    assert opt.loss_scale == scale
    for step in range(6):
        x = batch(step, 0)
        loss_ref = ref(x).float().square().mean()
        (loss_ref * scale if scale else loss_ref).backward()
        manual_master_step(ref, masters, opt_ref, scale)
        loss = model(x).float().square().mean()
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
        assert loss.item() == loss_ref.item(), step
    with tieroffload.materialize(model):
        for a, b in zip(ref.parameters(), model.parameters()):
            assert b.dtype == dtype and torch.equal(a, b)
    sd = opt.state_dict()
    for i, q in enumerate(masters):  # the masters are fp32 and kept in the optimizer state
        assert sd["state"][i]["master"].dtype == torch.float32
        assert torch.equal(sd["state"][i]["master"], q)
    opt.close()
    tieroffload.close(model)


def write_weights(how: str, m: nn.Module, offloaded: bool) -> None:
    """One way of writing a model's weights from outside training (the same for both)."""
    g = torch.Generator().manual_seed(7)
    if how in ("load_state_dict", "load_weights"):
        sd = {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in m.state_dict().items()}
        if how == "load_weights" and offloaded:
            tieroffload.load_weights(m, sd)
        else:
            m.load_state_dict(sd)
    elif how == "init":
        torch.nn.init.normal_(m.blocks[0].mlp[0].weight, generator=g)
    elif how == "assign":  # p.data = a new tensor
        for p in m.blocks[0].parameters():
            p.data = p.detach() * 0.5
    elif how == "vector":
        vec = torch.nn.utils.parameters_to_vector(m.parameters())
        torch.nn.utils.vector_to_parameters(vec * 0.5, m.parameters())
    else:  # through p.data, inside materialize (no writeback asked)
        with tieroffload.materialize(m) if offloaded else contextlib.nullcontext():
            for p in m.blocks[1].parameters():
                p.data.mul_(0.5)


@pytest.mark.parametrize("how", ["load_state_dict", "load_weights", "init", "assign", "vector",
                                 "data"])
@pytest.mark.parametrize("config", ["cpu-cpu", "nvme-nvme-grads"])
def test_weights_written_after_the_optimizer_is_built_are_stepped(how, config, tmp_path):
    """bf16 parameters with fp32 masters: weights written after the optimizer was built are
    what the next step updates (a master follows its parameter where they differ), as
    PyTorch steps the parameter itself; a parameter only viewed (``p.detach()``) keeps its
    master's extra bits."""
    ref, model, masters, opt_ref, opt = masters_pair(torch.bfloat16, config, tmp_path)
    for step in range(4):
        if step in (1, 2):  # twice: each write must be seen
            write_weights(how, ref, False)
            write_weights(how, model, True)
            with torch.no_grad():
                for q, p in zip(masters, ref.parameters()):
                    if not torch.equal(p, q.to(p.dtype)):
                        q.copy_(p)
            norms = [p.detach().float().norm() for p in model.parameters()]  # views only
            assert all(torch.isfinite(n) for n in norms)
        x = batch(step, 0)
        loss_ref = ref(x).float().square().mean()
        loss_ref.backward()
        manual_master_step(ref, masters, opt_ref, None)
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert loss.item() == loss_ref.item(), step
    with tieroffload.materialize(model):
        for a, b in zip(ref.parameters(), model.parameters()):
            assert torch.equal(a, b)
    sd = opt.state_dict()
    for i, q in enumerate(masters):
        assert torch.equal(sd["state"][i]["master"], q), i
    opt.close()
    tieroffload.close(model)


def master_step(ref: nn.Module, masters: list[torch.Tensor], opt_ref: torch.optim.Optimizer,
                max_norm: float, scale: float = 1.0) -> torch.Tensor:
    """A step of ``ref`` (fp16 or bf16) over fp32 ``masters`` as DeepSpeed takes it: the
    gradients unscaled into the masters in fp32, clipped there by torch's clip, stepped and
    copied back; returns the norm."""
    for q, p in zip(masters, ref.parameters()):
        q.grad = p.grad.float().mul_(1.0 / scale)  # unscaled (exactly: a power of two), fp32
    norm = torch.nn.utils.clip_grad_norm_(masters, max_norm)
    opt_ref.step()
    with torch.no_grad():
        for q, p in zip(masters, ref.parameters()):
            p.copy_(q)
            p.grad = q.grad = None
    return norm


@pytest.mark.parametrize("how", ["method", "torch"])
@pytest.mark.parametrize("config", ["cpu-cpu", "nvme-nvme-grads"])
def test_fp16_clipping_takes_the_norm_of_the_unscaled_gradients_in_fp32(how, config, tmp_path):
    """Under the dynamic loss scale (2**16) the scaled gradients' norm is past fp16's range:
    the norm is DeepSpeed's, over the unscaled gradients in fp32, and the clip multiplies
    their fp32 copies, as a hand-written fp32-master loop does, bit for bit; and an overflow
    skips the step and halves the scale instead of clipping to zero gradients."""
    ref, model, masters, opt_ref, opt = masters_pair(torch.float16, config, tmp_path,
                                                     loss_scale="dynamic")
    scale, max_norm = opt.loss_scale, 0.5
    clip = (opt.clip_grad_norm_ if how == "method"
            else lambda m: torch.nn.utils.clip_grad_norm_(model.parameters(), m))
    for step in range(4):
        x = batch(step, 0)
        loss_ref = ref(x).float().square().mean() * 10
        (loss_ref * scale).backward()
        norm_ref = master_step(ref, masters, opt_ref, max_norm, scale)
        loss = model(x).float().square().mean() * 10
        opt.scale_loss(loss).backward()
        norm = clip(max_norm)
        opt.step()
        opt.zero_grad()
        assert loss.item() == loss_ref.item(), step
        assert norm.dtype == torch.float32 and torch.equal(norm, norm_ref), (step, norm)
        assert norm_ref * scale > 65504 and norm_ref > max_norm  # past fp16, and clipped
    with tieroffload.materialize(model):
        for a, b in zip(ref.parameters(), model.parameters()):
            assert torch.equal(a, b)
        before = [p.detach().clone() for p in model.parameters()]
    opt.scale_loss(model(batch(9, 0)).float().square().mean() * float("inf")).backward()
    assert not torch.isfinite(clip(max_norm))  # an overflow: the step is skipped
    opt.step()
    opt.zero_grad()
    assert opt.skipped_steps == 1 and opt.loss_scale == scale / 2
    with tieroffload.materialize(model):
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.close()
    tieroffload.close(model)


@pytest.mark.parametrize("config", ["cpu-cpu", "nvme-nvme-grads"])
def test_bf16_clipping_with_fp32_is_deepspeed_s_and_without_it_torch_s(config, tmp_path):
    """bf16 with no loss scale: ``clip_grad_norm_(m, fp32=True)`` (the DeepSpeed drop-in's)
    takes the norm in fp32 over the bf16 gradients and clips their fp32 copies, as an fp32-master
    loop that clips the masters by torch's clip_grad_norm_ does, bit for bit; plain
    ``clip_grad_norm_`` stays torch's over the bf16 gradients (a bf16 norm)."""
    ref, model, masters, opt_ref, opt = masters_pair(torch.bfloat16, config, tmp_path)
    max_norm, rounded = 0.5, False
    for step in range(4):
        x = batch(step, 0)
        loss_ref = ref(x).float().square().mean() * 10
        loss_ref.backward()
        bf16_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
        norm_ref = master_step(ref, masters, opt_ref, max_norm)
        loss = model(x).float().square().mean() * 10
        loss.backward()
        norm = opt.clip_grad_norm_(max_norm, fp32=True)
        opt.step()
        opt.zero_grad()
        assert loss.item() == loss_ref.item(), step
        assert norm.dtype == torch.float32 and torch.equal(norm, norm_ref), (step, norm)
        assert norm_ref > max_norm  # clipped
        rounded = rounded or not torch.equal(bf16_norm.float(), norm_ref)
    assert rounded  # torch's bf16 norm is not this one
    with tieroffload.materialize(model):
        for a, b in zip(ref.parameters(), model.parameters()):
            assert torch.equal(a, b)
    model(batch(9, 0)).float().square().mean().backward()
    assert opt.clip_grad_norm_(max_norm).dtype == torch.bfloat16  # torch's, as before
    opt.close()
    tieroffload.close(model)


@pytest.mark.parametrize("config", ["cpu-cpu", "nvme-nvme-grads"])
def test_fp16_overflow_skips_the_step(config, tmp_path):
    torch.manual_seed(0)
    model = tieroffload.offload(TinyGPT().half(), policy(config, tmp_path))
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=1e-2, loss_scale="dynamic")
    scale0 = opt.loss_scale
    assert scale0 == 2.0**16
    with tieroffload.materialize(model):
        before = [p.detach().clone() for p in model.parameters()]
    loss = model(batch(0, 0)).float().square().mean() * float("inf")
    opt.scale_loss(loss).backward()
    opt.step()
    opt.zero_grad()
    assert opt.skipped_steps == 1 and opt.loss_scale == scale0 / 2
    with tieroffload.materialize(model):
        for a, b in zip(before, model.parameters()):
            assert torch.equal(a, b)  # nothing was applied
    for step in range(1, 8):  # then it trains on, halving until the scale fits
        opt.scale_loss(model(batch(step, 0)).float().square().mean()).backward()
        opt.step()
        opt.zero_grad()
    assert opt.skipped_steps < 8
    with tieroffload.materialize(model):
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    opt.close()
    tieroffload.close(model)


@pytest.mark.parametrize("overlap", [True, "backward"])
def test_two_paged_optimizers_step_their_own_parameters_only(tmp_path, overlap):
    """AdamW over the first layer and SGD over the rest equal plain PyTorch; two open paged
    optimizers over the same parameters (each would use up the other's gradients) are refused
    at the next training forward."""
    torch.manual_seed(0)
    ref = mlp()
    model = tieroffload.offload(copy.deepcopy(ref), policy("nvme-nvme-grads", tmp_path))

    def split(m):
        ps = list(m.parameters())
        return ps[:2], ps[2:]

    a, b = split(ref)
    refs = (torch.optim.AdamW(a, lr=1e-2, fused=True), torch.optim.SGD(b, lr=0.05))
    a, b = split(model)
    opts = (tieroffload.optimizer(model, torch.optim.AdamW, a, lr=1e-2, overlap=overlap),
            tieroffload.optimizer(model, torch.optim.SGD, b, lr=0.05, overlap=overlap))
    for step in range(3):
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(step))
        for m, os_ in ((ref, refs), (model, opts)):
            m(x).square().mean().backward()
            for o in os_:
                o.step()
                o.zero_grad()
    with tieroffload.materialize(model):
        assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters()))
    both = tieroffload.optimizer(model, torch.optim.SGD, list(model.parameters()), lr=0.1,
                                 overlap=overlap)
    with pytest.raises(ValueError, match="stepped by another open paged optimizer"):
        model(torch.randn(4, 64)).square().mean().backward()
    both.close()
    for o in opts:
        o.close()
    tieroffload.close(model)


class SometimesB(nn.Module):
    """``b`` runs only when asked; 72 wide, so that each layer is a chunk of its own."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(72, 72) for _ in range(3))

    def forward(self, x, use_b=True):
        h = self.a(x)
        return self.c(h + self.b(h) if use_b else h)


@pytest.mark.parametrize("by", ["optimizer", "model"])
@pytest.mark.parametrize("overlap", [False, True, "backward"])
@pytest.mark.parametrize("config", ["nvme-nvme", "nvme-nvme-grads"])
def test_zero_grad_keeping_zeros_steps_a_module_left_without_gradients(config, overlap, by,
                                                                       tmp_path):
    """After zero_grad(set_to_none=False) plain PyTorch keeps a zero p.grad for every parameter
    that had one and steps it in a step where it gets none (weight decay, the moments' decay):
    so does the paged optimizer, whose p.grad is None after a step, whether the optimizer's
    zero_grad or the model's ran; set_to_none=True drops that again."""
    micro = 2
    ref, model, opt_ref, opt = adamw_pair(
        config, 0.0, overlap, tmp_path, make=SometimesB,
        **({"accumulation_steps": micro} if overlap == "backward" else {}))
    for step, (use_b, keep) in enumerate([(True, True), (False, True), (False, False),
                                          (False, True), (True, True), (False, True)]):
        for m in (ref, model):
            for k in range(micro):
                x = torch.randn(4, 72, generator=torch.Generator().manual_seed(10 * step + k))
                (m(x, use_b).square().mean() / micro).backward()
        for m, o in ((ref, opt_ref), (model, opt)):
            o.step()
            (o if by == "optimizer" else m).zero_grad(set_to_none=not keep)
        with tieroffload.materialize(model):
            for (n, a), b in zip(ref.named_parameters(), model.parameters()):
                assert torch.equal(a, b), (step, n)
    assert_same_state(ref, model, opt_ref, opt)
    opt.close()
    tieroffload.close(model)


@pytest.mark.parametrize("config", ["cpu-cpu", "cpu-nvme", "nvme-nvme"])
def test_the_model_s_zero_grad_after_the_optimizer_s_keeping_zeros_drops_them(config,
                                                                              tmp_path):
    """opt.zero_grad(set_to_none=False), a step, then model.zero_grad(): plain PyTorch's
    p.grad is None again, so a module left without gradients is not stepped; nor here,
    whether the parameters are paged or resident."""
    ref, model, opt_ref, opt = adamw_pair(config, 0.0, False, tmp_path, make=SometimesB)
    for step, use_b in enumerate([True, True, False, False]):
        for m in (ref, model):
            x = torch.randn(4, 72, generator=torch.Generator().manual_seed(step))
            m(x, use_b).square().mean().backward()
        for m, o in ((ref, opt_ref), (model, opt)):
            o.step()
            if step == 0:
                o.zero_grad(set_to_none=False)
            else:
                m.zero_grad()
        with tieroffload.materialize(model):
            for (n, a), b in zip(ref.named_parameters(), model.parameters()):
                assert torch.equal(a, b), (step, n)
    opt.close()
    tieroffload.close(model)


def test_paged_gradients_need_one_paged_optimizer_per_module(tmp_path):
    """Paged gradients are stored and used up a module at a time: an optimizer over a module's
    weights and not its trainable bias is refused at once, naming both (a second optimizer
    over the biases found none left); with gradients in RAM the split trains as usual."""
    model = tieroffload.offload(nn.Sequential(nn.Linear(72, 72), nn.Linear(72, 72)),
                                policy("nvme-nvme-grads", tmp_path))
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    with pytest.raises(ValueError, match=r"module '0' has parameters this optimizer steps and "
                                         r"1 trainable one\(s\) it does not \('0.bias'\)"):
        tieroffload.optimizer(model, torch.optim.AdamW, weights, lr=1e-2)
    tieroffload.close(model)


def test_a_parameter_made_trainable_after_offload_is_refused_where_gradients_are_paged(
        tmp_path):
    """Gradient paging is set up at offload for the parameters that require grad then: one
    unfrozen later would never be stepped (or be stepped with part of its gradient), so its
    first training forward refuses, naming it; freezing later is followed."""
    ref = nn.Sequential(nn.Linear(72, 72), nn.Linear(72, 72))
    ref[1].weight.requires_grad_(False)
    model = tieroffload.offload(ref, policy("nvme-nvme-grads", tmp_path))
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=1e-2)
    model(torch.randn(2, 72)).square().mean().backward()
    opt.step()
    model[1].weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"parameter '1.weight' requires grad but did not at "
                                           r"offload\(\)"):
        model(torch.randn(2, 72))
    with torch.no_grad():  # inference is not refused
        model(torch.randn(2, 72))
    opt.close()
    tieroffload.close(model)

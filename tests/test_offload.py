"""offload(): the offloaded model computes exactly what the plain one does, inside its budget."""

import copy
import errno
import functools
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from helpers import cpu_policy, nvme_policy, offloaded_pair, square_loss
from models import Branchy, TinyGPT, mlp
from torch import nn

import tieroffload
from tieroffload import Policy
from tieroffload.core.threads import CoreLender
from tieroffload.core.units import State

MODELS = {
    "mlp": (lambda: mlp(), lambda g: torch.randn(4, 64, generator=g)),
    "gpt": (lambda: TinyGPT(), lambda g: torch.randint(0, 97, (2, 16), generator=g)),
    "branchy": (lambda: Branchy(), lambda g: torch.randn(5, 48, generator=g) + 0.3),
}


def policy_for(tier: str, tmp_path, **kw) -> Policy:
    return nvme_policy(tmp_path, **kw) if tier == "nvme" else cpu_policy(params=tier, **kw)


def pair(name: str, tier: str, tmp_path, **kw):
    return offloaded_pair(MODELS[name][0], policy_for(tier, tmp_path, **kw))


loss_of = square_loss


def budget_of(model: nn.Module) -> int:
    """A budget of twice the largest module: most units must be evicted and refetched."""
    return 2 * max(u.nbytes for u in model._tieroffload.units)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("name", list(MODELS))
def test_outputs_and_gradients_match(name, tier, tmp_path):
    ref, model = pair(name, tier, tmp_path)
    if tier == "nvme":  # a tight budget, so that units really come and go
        tieroffload.close(model)
        model = tieroffload.offload(copy.deepcopy(ref), policy_for(
            tier, tmp_path, cpu_budget=2 * max(p.numel() * 4 for p in ref.parameters())))
    g = torch.Generator().manual_seed(1)
    for it in range(3):
        x = MODELS[name][1](g)
        if name == "branchy" and it == 1:
            x = -x.abs() - 0.1  # the other branch: the recorded order no longer holds
        ref.zero_grad()
        model.zero_grad()
        out_ref, out = ref(x), model(x)
        assert torch.equal(out_ref, out), f"iteration {it}"
        loss_of(out_ref).backward()
        loss_of(out).backward()
        for (n, a), b in zip(ref.named_parameters(), model.parameters()):
            if a.grad is None:  # a branch not taken
                assert b.grad is None, n
            else:
                assert torch.equal(a.grad, b.grad), f"{n} iteration {it}"
    if tier == "nvme":
        st = tieroffload.stats(model)
        assert st["bytes_read"]["nvme"] > 0 and st["evictions"] > 0
        assert st["peak_resident"] <= st["budget"]
        if name == "branchy":
            assert st["reorders"] >= 1
    tieroffload.close(model)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("name", list(MODELS))
def test_ten_adamw_steps_same_losses(name, tier, tmp_path, caplog):
    ref, model = pair(name, tier, tmp_path)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(2)
    losses_ref, losses = [], []
    for _ in range(10):
        x = MODELS[name][1](g)
        for m, o, acc in ((ref, opt_ref, losses_ref), (model, opt, losses)):
            o.zero_grad()
            loss = loss_of(m(x))
            loss.backward()
            o.step()
            acc.append(loss.item())
    assert losses == losses_ref
    sd_ref, sd = ref.state_dict(), model.state_dict()
    assert sd.keys() == sd_ref.keys()
    for k in sd:
        assert torch.equal(sd[k], sd_ref[k]), k
    tieroffload.close(model)


def test_in_place_write_inside_forward_reaches_the_home(tmp_path):
    """nn.Embedding(max_norm=...) renormalises the rows it looks up, in place, inside forward:
    under a budget that evicts it, the rows come back renormalised and training matches."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Embedding(200, 32, max_norm=1.0), nn.Linear(32, 64), nn.ReLU(),
                        nn.Linear(64, 200))
    model = tieroffload.offload(copy.deepcopy(ref), policy_for(
        "nvme", tmp_path, cpu_budget=60_000))  # the largest unit: 52 kB
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        ids = torch.arange(20 * step, 20 * step + 40).view(4, 10) % 200
        for m, o in ((ref, opt_ref), (model, opt)):
            loss_of(m(ids)).backward()
            o.step()
            o.zero_grad()
    assert model._tieroffload.stats.evictions > 0
    assert torch.equal(model[0].weight, ref[0].weight)
    with torch.no_grad():
        assert torch.equal(model(torch.arange(200).view(20, 10)),
                           ref(torch.arange(200).view(20, 10)))
    tieroffload.close(model)


def test_writes_inside_materialize_reach_the_home_through_p_data_too(tmp_path):
    """Inside materialize (no writeback asked), a write through the parameter bumps its
    version counter and one through ``p.data`` bumps none: both reach the home when a budget
    smaller than the model evicts the units (WGAN-style weight clipping), and so do writes
    through views taken inside the block and used after it."""
    torch.manual_seed(0)
    ref = mlp(width=16, depth=6)
    model = tieroffload.offload(copy.deepcopy(ref), policy_for("nvme", tmp_path,
                                                               cpu_budget="2KiB"))

    def clip(m):
        with torch.no_grad():
            for i, layer in enumerate(m[::2]):
                for p in layer.parameters():
                    (p.data if i % 2 else p).clamp_(-0.01, 0.01)
    with tieroffload.materialize(model):
        clip(model)
        views = [p.data for p in model[-1].parameters()] + [model[-3].weight.detach()]
    clip(ref)
    for v in views + [p.data for p in ref[-1].parameters()] + [ref[-3].weight.detach()]:
        with torch.no_grad():
            v.mul_(0.5)  # after the block: the views hold their units until the next forward
    x = torch.randn(4, 16)
    with torch.no_grad():
        for _ in range(2):  # the units go home and come back
            assert torch.equal(model(x), ref(x))
    assert model._tieroffload.stats.evictions > 0
    sd_ref, sd = ref.state_dict(), model.state_dict()
    for k in sd_ref:
        assert torch.equal(sd[k], sd_ref[k]), k
    tieroffload.close(model)


def test_plain_optimizer_gets_gradients_paged_to_nvme(tmp_path):
    """With grads="nvme", p.grad is None outside a step: a plain torch optimizer's step brings
    them in (the sum of two micro-batches) and uses them up, as the paged optimizer does."""
    torch.manual_seed(0)
    ref = TinyGPT()
    model = tieroffload.offload(copy.deepcopy(ref), Policy(
        params="nvme", grads="nvme", nvme_dir=str(tmp_path), device="cpu", cpu_budget="80KiB"))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(2)
    for _ in range(4):
        xs = [MODELS["gpt"][1](g) for _ in range(2)]
        losses = []
        for m, o in ((ref, opt_ref), (model, opt)):
            for x in xs:
                loss = loss_of(m(x)) / 2
                loss.backward()
                losses.append(loss.item())
            if m is model:
                assert all(p.grad is None for p in model.parameters())  # on NVMe
            o.step()
            o.zero_grad()
        assert losses[:2] == losses[2:]
    assert all(p.grad is None for p in model.parameters())
    with tieroffload.materialize(model):
        for (n, a), b in zip(ref.named_parameters(), model.parameters()):
            assert torch.equal(a, b), n
    tieroffload.close(model)


def test_autobatch_redo_drops_gradients_stored_on_nvme(tmp_path):
    """An out-of-memory error in backward leaves gradients of the failed step on NVMe, which a
    plain optimizer's zero_grad cannot reach: AutoBatch drops them before it redoes the step
    in smaller micro-batches, and training matches plain PyTorch doing the same."""
    torch.manual_seed(0)
    ref = TinyGPT()
    model = tieroffload.offload(copy.deepcopy(ref), Policy(
        params="nvme", grads="nvme", nvme_dir=str(tmp_path), device="cpu", cpu_budget="80KiB"))
    g = torch.Generator().manual_seed(2)
    batches = [torch.cat([MODELS["gpt"][1](g) for _ in range(2)]) for _ in range(3)]
    runs = []
    for m in (ref, model):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        calls = []

        def fail_in_second_backward(grad, calls=calls):
            calls.append(1)
            if len(calls) == 2:  # the first step's second micro-batch: the first is stored
                raise torch.OutOfMemoryError("injected")
        next(m.parameters()).register_hook(fail_in_second_backward)
        auto = tieroffload.AutoBatch(4, "1TiB", start=2, model=m, optimizer=opt, device="cpu")
        losses = []
        for x in batches:
            losses.append(auto.backward(lambda part, m=m: loss_of(m(part)), x).item())
            opt.step()
            opt.zero_grad()
        assert auto.ooms == 1
        runs.append(losses)
    assert runs[0] == runs[1]
    with tieroffload.materialize(model):
        for (n, a), b in zip(ref.named_parameters(), model.parameters()):
            assert torch.equal(a, b), n
    tieroffload.close(model)


@pytest.mark.parametrize("delay", [0.0, 0.003])
def test_injected_io_delays_do_not_change_results(tmp_path, delay):
    """Thin layers and a batch of one: compute is far quicker than the (delayed) I/O, so a
    missing wait would read weights that have not arrived."""
    torch.manual_seed(0)
    ref = mlp(width=256, depth=12)
    model = tieroffload.offload(
        copy.deepcopy(ref),
        Policy(params="nvme", nvme_dir=str(tmp_path), device="cpu", cpu_budget=4 * 257 * 256 * 4,
               prefetch=3),
        _io_delay=lambda: time.sleep(delay))
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        x = torch.randn(1, 256)
        for m, o in ((ref, opt_ref), (model, opt)):
            o.zero_grad()
            loss_of(m(x)).backward()
            o.step()
        assert torch.equal(ref(x), model(x))
    st = tieroffload.stats(model)
    assert st["hits"] + st["late"] > st["misses"]  # the prefetch along the trace was used
    tieroffload.close(model)


@pytest.mark.parametrize("lend", [True, False])
def test_compute_lends_a_core_to_reads_only_while_behind_them(tmp_path, lend):
    """Reads slowed far below compute: after most acquires the next unit is still being read,
    and compute runs on one thread fewer, with results equal but for rounding; the user's
    thread count is back once forward or backward ends. With room for every unit, nothing is
    read after the first pass, compute is never behind, and it keeps every thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        ref = mlp(width=256, depth=12)
        seen: list[int] = []
        for m in ref:
            m.register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))
        x = torch.randn(1, 256)
        want = ref(x)
        want_grads = torch.autograd.grad(loss_of(want), list(ref.parameters()))
        for budget, behind in ((4 * 257 * 256 * 4, True), ("64MiB", False)):
            model = tieroffload.offload(
                copy.deepcopy(ref),
                Policy(params="nvme", nvme_dir=str(tmp_path), device="cpu", cpu_budget=budget,
                       prefetch=1, adapt=False, lend_core=lend),
                _io_delay=functools.partial(time.sleep, 0.01))
            for _ in range(3):
                seen.clear()
                out = model(x)
                assert torch.get_num_threads() == 2
                grads = torch.autograd.grad(loss_of(out), list(model.parameters()))
                assert torch.get_num_threads() == 2
                # Fewer threads may add in another order: equal but for the last bits.
                same = torch.equal if not lend else functools.partial(torch.allclose, rtol=1e-5)
                assert same(out, want)
                assert all(same(a, b) for a, b in zip(grads, want_grads))
            lent = tieroffload.stats(model)["lent"]
            tieroffload.close(model)
            if lend and behind:
                assert seen.count(1) >= len(seen) // 2, seen  # in the last forward
                assert lent > 0
            else:
                assert seen == [2] * len(seen) and lent == 0, (budget, seen)
    finally:
        torch.set_num_threads(threads)


def test_core_is_lent_after_a_wait_and_kept_while_behind():
    """A unit still on its way is not enough to lend (it may arrive in time); a wait for it is.
    Once lent, the core stays lent while the next unit is being read."""
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        cores = CoreLender(enabled=True)
        steps = [((False, True), 3), ((True, False), 3), ((True, True), 2), ((False, True), 2),
                 ((True, True), 2), ((False, False), 3)]
        for (waited, behind), want in steps:
            cores.lend(waited, behind)
            assert torch.get_num_threads() == want, (waited, behind)
        off = CoreLender(enabled=False)
        off.lend(True, True)
        assert torch.get_num_threads() == 3 and not off.lent
    finally:
        torch.set_num_threads(threads)


def test_state_dict_round_trip_and_torch_save(tmp_path):
    ref, model = pair("gpt", "nvme", tmp_path)
    path = tmp_path / "sd.pt"
    torch.save(model.state_dict(), path)
    loaded = torch.load(path)
    for k, v in ref.state_dict().items():
        assert torch.equal(loaded[k], v), k
    # load_state_dict into the offloaded model, from another model's weights
    torch.manual_seed(5)
    other = TinyGPT()
    model.load_state_dict(other.state_dict())
    for k, v in other.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    idx = torch.randint(0, 97, (2, 16))
    assert torch.equal(model(idx), other(idx))
    # named_parameters: the same Parameter objects, their values readable when materialized
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in other.named_parameters()]
    with tieroffload.materialize(model):
        for (n, p), q in zip(model.named_parameters(), other.parameters()):
            assert torch.equal(p, q), n
    tieroffload.close(model)


def test_optimizer_built_before_offload_sees_same_parameters(tmp_path):
    torch.manual_seed(0)
    ref = mlp()
    model = copy.deepcopy(ref)
    params_before = list(model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tieroffload.offload(model, Policy(params="nvme", nvme_dir=str(tmp_path), device="cpu"))
    assert [id(p) for p in model.parameters()] == [id(p) for p in params_before]
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = torch.randn(3, 64)
    for m, o in ((ref, opt_ref), (model, opt)):
        loss_of(m(x)).backward()
        o.step()
    assert torch.equal(ref(x), model(x))
    tieroffload.close(model)


def test_meta_model_streamed_from_safetensors(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    ref = TinyGPT()
    sd = {k: v.clone() for k, v in ref.state_dict().items() if k != "head.weight"}
    save_file(sd, tmp_path / "w.safetensors")
    with torch.device("meta"):
        model = TinyGPT()
    tieroffload.offload(model, Policy(params="nvme", nvme_dir=str(tmp_path), device="cpu"))
    tieroffload.load_weights(model, tmp_path / "w.safetensors")
    idx = torch.randint(0, 97, (2, 16))
    assert torch.equal(model(idx), ref(idx))
    with pytest.raises(KeyError, match="missing"):
        tieroffload.load_weights(model, {"wte.weight": sd["wte.weight"]})
    tieroffload.close(model)


class Lazy(dict):
    """A state dict that makes each tensor as it is asked for (stored: its shape)."""

    def __getitem__(self, name):
        return torch.full(super().__getitem__(name), 0.5)


def test_load_weights_from_a_mapping_that_makes_tensors_on_demand(tmp_path):
    with torch.device("meta"):
        model = TinyGPT()
    tieroffload.offload(model, Policy(params="nvme", nvme_dir=str(tmp_path), device="cpu"))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    tieroffload.load_weights(model, Lazy(shapes))
    with tieroffload.materialize(model):
        assert all(bool((p == 0.5).all()) for p in model.parameters())
    wrong = Lazy(shapes, **{"blocks.0.ln1.bias": (1,)})  # copy_ would broadcast it
    with pytest.raises(ValueError, match=r"blocks.0.ln1.bias: weights have shape \(1,\)"):
        tieroffload.load_weights(model, wrong)
    tieroffload.close(model)


def test_swap_file_named_stably_and_removed(tmp_path):
    def swap_files():  # each rank keeps its files in a folder of its own
        where = tmp_path / "rank0"
        return sorted(f for f in os.listdir(where) if f.endswith(".swap")) \
            if where.exists() else []

    torch.manual_seed(0)
    a = tieroffload.offload(mlp(), Policy(params="nvme", nvme_dir=str(tmp_path), device="cpu"))
    b = tieroffload.offload(mlp(), Policy(params="nvme", nvme_dir=str(tmp_path), device="cpu"))
    names = swap_files()
    first = a._tieroffload.swap.path
    assert os.path.basename(first) in names and len(names) == 2
    assert os.path.basename(first.replace(".swap", "-1.swap")) in names  # no collision
    tieroffload.close(a)
    tieroffload.close(b)
    assert swap_files() == []
    code = textwrap.dedent(f"""
        import os, torch, tieroffload
        from torch import nn
        m = tieroffload.offload(nn.Sequential(nn.Linear(64, 64)), tieroffload.Policy(
            params="nvme", nvme_dir={str(tmp_path)!r}, device="cpu"))
        print(sorted(os.listdir({str(tmp_path / "rank0")!r})))
    """)
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr
    assert runs[0].stdout == runs[1].stdout  # the same name in every run
    assert swap_files() == []  # removed at exit
    assert not (tmp_path / "rank0").exists()  # with the folder it made


def test_bad_policies_get_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="nvme_dir"):
        Policy(params="nvme")
    with pytest.raises(ValueError, match="params must be"):
        Policy(params="disk")
    with pytest.raises(ValueError, match="cpu_budget: not a size"):
        Policy(cpu_budget="lots")
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'.*'meta'"):
        Policy(device="meta")
    with pytest.raises(ValueError, match="nvme_dir names .* twice"):
        Policy(params="nvme", nvme_dir=[str(tmp_path), str(tmp_path) + "/"])
    assert Policy(params="nvme", nvme_dir="~/x").nvme_dir == os.path.expanduser("~/x")
    with pytest.raises(ValueError, match="CUDA"):
        tieroffload.offload(mlp(), Policy(params="gpu", device="cpu"))
    big = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 4))
    with pytest.raises(ValueError, match=r"'0'.*263168 bytes"):
        tieroffload.offload(big, policy_for("nvme", tmp_path, cpu_budget="100KiB"))
    assert not big[0].weight.untyped_storage().nbytes() == 0  # the model is untouched
    with pytest.raises(FileNotFoundError, match="nvme_dir"):
        tieroffload.offload(mlp(), Policy(params="nvme", nvme_dir=str(tmp_path / "nope"),
                                          device="cpu"))

    class Sparse(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.eye(4).to_sparse())

    with pytest.raises(TypeError, match=r"'w'.*64 bytes.*layout"):
        tieroffload.offload(Sparse(), policy_for("nvme", tmp_path))


def test_nvme_dir_without_room_is_refused_before_writing(tmp_path):
    from conftest import mounted

    with mounted("tmpfs", "size=1m") as where:
        with open(os.path.join(where, "keep"), "wb") as f:
            f.write(b"precious")
        model = nn.Sequential(nn.Linear(1024, 1024))  # 4 MiB
        threads = threading.active_count()
        with pytest.raises(OSError) as ei:
            tieroffload.offload(model, Policy(params="nvme", nvme_dir=where, device="cpu"))
        assert ei.value.errno == errno.ENOSPC
        assert "needs 4198400 bytes" in str(ei.value) and where in str(ei.value)
        assert os.listdir(where) == ["keep"]
        assert threading.active_count() == threads  # its mover thread was stopped
        with open(os.path.join(where, "keep"), "rb") as f:
            assert f.read() == b"precious"
    assert model[0].weight.abs().sum() > 0  # still usable


RSS_CHILD = r"""
import resource, sys, torch, tieroffload
from torch import nn
from tieroffload.utils.memory import peak_rss, reset_peak_rss, rss

torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(16)])  # 16 MiB a unit, 256 MiB
x = torch.randn(4, 2048)
with torch.no_grad():
    want = model(x)
before = rss()
tieroffload.offload(model, tieroffload.Policy(params="nvme", nvme_dir=sys.argv[1], device="cpu",
                                              cpu_budget="48MiB"))
after = rss()
assert reset_peak_rss()
base = rss()
with torch.no_grad():
    for _ in range(3):
        out = model(x)
st = tieroffload.stats(model)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
with torch.no_grad():
    model(x)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
read = tieroffload.stats(model)["bytes_read"]["nvme"] - st["bytes_read"]["nvme"]
print(before, after, base, peak_rss(), st["budget"], st["overhead"], st["peak_resident"],
      int(torch.equal(out, want)), faults, read,
      int(model._tieroffload.scheduler.pool.supported))
"""


def test_resident_memory_stays_under_budget(tmp_path):
    r = subprocess.run([sys.executable, "-c", RSS_CHILD, str(tmp_path)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (before, after, base, peak, budget, overhead, peak_resident, same, faults, read,
     pooled) = map(int, r.stdout.split())
    mib = 1 << 20
    assert same == 1
    assert before - after > 200 * mib, "offloaded weights were not returned to the OS"
    assert peak_resident <= budget == 48 * mib
    # Measured: the peak RSS over the forward passes stays within budget + staging + 16 MiB.
    assert peak - base <= budget + overhead + 16 * mib, (peak - base) / mib
    # Refetched units reuse the pages of evicted ones: no fault (and zeroing) per page read.
    assert read >= 200 * mib
    if pooled:
        assert faults * 4096 < read // 8, (faults, read)


def test_prefetch_reads_past_resident_units(tmp_path):
    """Backward starts on the units forward left resident. The reads of the units below them
    start as soon as the first unit's backward frees room, while compute is still on resident
    units, not when compute comes within the prefetch window of them (the disk idled for a
    third of a balanced training step before)."""
    torch.manual_seed(0)
    ref = mlp(width=128, depth=12)
    model = tieroffload.offload(copy.deepcopy(ref), Policy(
        params="nvme", nvme_dir=str(tmp_path), device="cpu", cpu_budget=5 * 129 * 128 * 4,
        prefetch=1, adapt=False))
    sched = model._tieroffload.scheduler
    started: list[tuple[int, int]] = []  # (trace position of compute, unit fetched)
    start_fetch = sched._start_fetch
    sched._start_fetch = lambda u: (started.append((sched.cursor, u.id)), start_fetch(u))
    x = torch.randn(4, 128)
    for _ in range(3):
        started.clear()
        model.zero_grad(set_to_none=True)
        out = model(x)
        backward_at = sched.cursor
        out.square().mean().backward()
    first_read = min(c for c, _ in started if c > backward_at)
    # Five units are resident when backward starts; the first read starts by its second unit.
    assert first_read <= backward_at + 2, (backward_at, started)
    ref(x).square().mean().backward()
    for (_, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    tieroffload.close(model)


def test_window_reads_queue_before_the_wait(tmp_path):
    """An acquire starts the window's reads before it waits for its own unit, so the disk has
    the next unit queued while it reads this one (after the wait, it had only this one)."""
    torch.manual_seed(0)
    ref = mlp(width=128, depth=12)
    model = tieroffload.offload(copy.deepcopy(ref), Policy(
        params="nvme", nvme_dir=str(tmp_path), device="cpu", cpu_budget=5 * 129 * 128 * 4,
        prefetch=1, adapt=False), _io_delay=functools.partial(time.sleep, 0.005))
    sched = model._tieroffload.scheduler
    waits: list[int] = []  # units also being read during each wait that was not over
    finish = sched._finish

    def recording_finish(u):
        if u.ticket is not None and not u.ticket.done():
            waits.append(sum(v is not u and v.state is State.FETCHING for v in sched.units))
        finish(u)
    sched._finish = recording_finish
    x = torch.randn(4, 128)
    for _ in range(3):
        waits.clear()
        with torch.no_grad():
            out = model(x)
    assert len(waits) >= 5 and sum(n >= 1 for n in waits) >= len(waits) - 1, waits
    assert torch.equal(out, ref(x))
    tieroffload.close(model)


def test_page_pool_moves_pages_without_copying():
    """Pages parked from one buffer land in another with their bytes; the first reads zeros
    and keeps its address; a unit filled from pieces parks them again one by one."""
    from tieroffload import _native, aio
    from tieroffload.aio.pages import PagePool

    pool = PagePool(cap=3 << 20)
    a, b = aio.aligned_empty(1 << 20, pin=False), aio.aligned_empty(2 << 20, pin=False)
    a.fill_(7)
    b.fill_(9)
    if not pool.park(a.data_ptr(), a.numel()):
        pytest.skip("this kernel has no MREMAP_DONTUNMAP: units are discarded instead")
    assert int(a.sum()) == 0 and pool.nbytes == 1 << 20
    assert pool.park(b.data_ptr(), b.numel())
    assert not pool.park(a.data_ptr(), 1 << 20), "over the cap: the caller discards"
    c = aio.aligned_empty(3 << 20, pin=False)
    pieces = pool.fill(c.data_ptr(), c.numel())
    assert pieces == [2 << 20, 1 << 20] and pool.nbytes == 0  # the largest range first
    assert torch.equal(c[:2 << 20], torch.full((2 << 20,), 9, dtype=torch.uint8))
    assert torch.equal(c[2 << 20:], torch.full((1 << 20,), 7, dtype=torch.uint8))
    addr = c.data_ptr()
    for n in pieces:  # each piece is its own mapping
        assert pool.park(addr, n)
        addr += n
    d = aio.aligned_empty(2 << 20, pin=False)
    assert pool.fill(d.data_ptr(), d.numel()) == [2 << 20]  # the range of that size
    assert int(d[0]) == 9 and pool.nbytes == 1 << 20
    pool.clear()
    assert pool.nbytes == 0 and pool.ranges == []
    _native.discard(d.data_ptr(), d.numel())
    assert int(d.sum()) == 0


def _huge_bytes(addr: int) -> int:
    """Bytes of transparent huge pages in the mapping that holds ``addr``."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1]) << 10
    return 0


def _need_huge_pages() -> None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                pytest.skip("transparent huge pages are off here")
    except FileNotFoundError:
        pytest.skip("this kernel has no transparent huge pages")


def test_unit_buffers_are_backed_by_huge_pages():
    """A unit's buffer starts on a 2 MiB boundary and is faulted in as huge pages, also after
    it is freed and mapped afresh: O_DIRECT reads into 4 KiB pages scattered in memory ran
    at 1.25 GB/s beside compute where huge pages took 1.77 GB/s, as a device takes at most
    so many segments per request."""
    from tieroffload.core.units import Unit

    _need_huge_pages()
    mib = 1 << 20
    u = Unit(0, "u", [("w", torch.nn.Parameter(torch.ones(8 * mib // 4)))])
    u.adopt_flat(4096)
    addr = u.flat.data_ptr()
    assert addr % (2 * mib) == 0
    assert _huge_bytes(addr) >= 4 * mib, "adopt_flat wrote every byte: most should be huge"
    u.free()  # no pool: the pages go back to the OS
    assert _huge_bytes(addr) == 0
    u.allocate()  # mapped afresh, which drops the advice unless it is given again
    u.flat.fill_(1)
    assert u.flat.data_ptr() == addr and _huge_bytes(addr) >= 4 * mib


def test_parked_pages_keep_their_offset_within_a_huge_page():
    """Pages parked keep their offset within a huge page, whatever moves they went through
    before, so that whole huge pages move as one page-table entry each, bytes included.
    Parked where the kernel chose, after a fill that split a range off a 2 MiB boundary,
    they landed off it: each huge page was split into 512 (a 32 MiB park and place took
    0.7 ms instead of 10 us beside compute, and the unit lost its huge pages for good)."""
    from tieroffload.aio.pages import PagePool
    from tieroffload.core.units import Unit

    _need_huge_pages()
    mib = 1 << 20

    def unit(nbytes: int, value: float) -> Unit:
        u = Unit(0, "u", [("w", torch.nn.Parameter(torch.full((nbytes // 4,), value)))])
        u.adopt_flat(4096)
        return u

    big, odd, even = unit(8 * mib, 1.0), unit(4 * mib + 8192, 2.0), unit(6 * mib, 3.0)
    huge = _huge_bytes(big.flat.data_ptr()) >= 4 * mib
    pool = PagePool(cap=16 * mib)
    odd.free()
    even.free()
    big.free(pool)
    if not pool.nbytes:
        pytest.skip("this kernel has no MREMAP_DONTUNMAP: units are discarded instead")
    (parked, _), = pool.ranges
    assert parked % (2 * mib) == 0
    assert _huge_bytes(parked) >= 4 * mib or not huge, "the huge pages moved whole"
    odd.allocate(pool)  # takes 4 MiB + 8 KiB: the rest of the range starts off a boundary
    even.allocate(pool)  # its first 4 MiB - 8 KiB are that rest, the others fresh
    even.flat.fill_(5)
    addr = even.flat.data_ptr()
    even.free(pool)
    starts = sorted(a % (2 * mib) for a, _ in pool.ranges)
    assert starts == sorted({addr % (2 * mib), (addr + 4 * mib - 8192) % (2 * mib)}), starts
    odd.free()
    even.allocate(pool)
    assert bool((even.params[0].view(torch.uint8) == 5).all())


HEAP_CHILD = r"""
import sys, torch, tieroffload
from torch import nn
from tieroffload.utils.memory import return_freed_memory, rss
budget, first, second = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
tieroffload.offload(nn.Linear(64, 64), tieroffload.Policy(
    params="nvme", nvme_dir=sys.argv[1], device="cpu", cpu_budget=budget))
def returned(mib):  # MiB that freeing a temporary of `mib` MiB gives back to the OS
    t = torch.ones(mib << 18)
    before = rss()
    del t
    return (before - rss()) >> 20
kept = returned(first)
return_freed_memory()
print(kept, returned(second))  # larger than the free block the heap kept, which it may hand out
"""


@pytest.mark.parametrize("budget,first,second", [("256MiB", 16, 24), ("1GiB", 64, 96)])
def test_heap_reuses_temporaries_below_an_eighth_of_the_budget(tmp_path, budget, first, second):
    """Under a 256 MiB budget a freed 16 MiB temporary stays in the heap for the next one
    (no page faults), and under 1 GiB a 64 MiB one (past glibc's 32 MiB ceiling: no block is
    mapped); after return_freed_memory() a larger one, which the heap would also have kept,
    goes back to the OS."""
    r = subprocess.run([sys.executable, "-c", HEAP_CHILD, str(tmp_path), budget, str(first),
                        str(second)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    kept, returned = map(int, r.stdout.split())
    assert kept < 4 and returned >= second - 1, (kept, returned)


def test_unit_parks_every_page_after_partial_fills():
    """A unit filled in part from the pool parks all its pages when freed, however earlier
    moves split its mapping (it discarded most of them, to fault them in again, when they
    did), and as many as the cap leaves room for when the pool is nearly full."""
    from tieroffload import aio
    from tieroffload.aio.pages import PagePool
    from tieroffload.core.units import Unit

    mib = 1 << 20
    u = Unit(0, "u", [("w", torch.nn.Parameter(torch.zeros(3 * mib // 4)))])
    u.adopt_flat(4096)
    pool = PagePool(cap=8 * mib)
    a = aio.aligned_empty(mib, pin=False)
    if not pool.park(a.data_ptr(), mib):
        pytest.skip("this kernel has no MREMAP_DONTUNMAP: units are discarded instead")
    u.allocate(pool)  # 1 MiB placed: the unit's range is now two mappings
    u.free(pool)
    assert pool.nbytes == 3 * mib
    pool.clear()
    c = aio.aligned_empty(mib // 2, pin=False)
    assert pool.park(c.data_ptr(), mib // 2) == mib // 2
    u.allocate(pool)  # half a MiB placed: the rest spans the earlier split
    u.flat.fill_(5)
    u.free(pool)
    assert pool.nbytes == 3 * mib and int(u.flat.sum()) == 0
    d = aio.aligned_empty(3 * mib, pin=False)
    assert sum(pool.fill(d.data_ptr(), d.numel())) == 3 * mib
    assert bool((d == 5).all())
    pool.cap = 2 * mib
    u.allocate()
    u.flat.fill_(6)
    u.free(pool)  # room for two of its three MiB
    assert pool.nbytes == 2 * mib and int(u.flat.sum()) == 0
    pool.clear()


def test_plain_optimizer_step_warns_once(tmp_path, caplog):
    torch.manual_seed(0)
    model = tieroffload.offload(mlp(), policy_for("nvme", tmp_path, cpu_budget="40KiB"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sys.modules["tieroffload.hooks.steps"]._warned_step = False
    with caplog.at_level(logging.WARNING, logger="tieroffload"):
        for _ in range(2):
            loss_of(model(torch.randn(2, 64))).backward()
            opt.step()
    msgs = [r.getMessage() for r in caplog.records if "paged optimizer" in r.getMessage()]
    assert len(msgs) == 1
    assert tieroffload.stats(model)["resident"] <= tieroffload.stats(model)["budget"]
    tieroffload.close(model)


def test_close_restores_a_plain_model(tmp_path):
    ref, model = pair("mlp", "nvme", tmp_path)
    tieroffload.close(model)
    x = torch.randn(3, 64)
    assert torch.equal(ref(x), model(x))
    assert model._tieroffload is None
    assert os.listdir(tmp_path) == []  # no swap file, no rank folder

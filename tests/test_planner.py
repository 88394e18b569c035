"""Policy.auto and its cost model, and the prefetch depth that adapts at run time."""

import copy
import functools
import time

import pytest
import torch
from models import mlp
from torch import nn

import tieroffload
from tieroffload import Policy
from tieroffload.planner import Machine, Profile, measure, predict
from tieroffload.testing.models import gpt_task
from tieroffload.utils import memory

# Three shapes: deep and narrow, wide and shallow, long sequence (activation heavy).
SHAPES = {
    "deep": dict(vocab=2048, d=512, layers=4, heads=8, seq=128, batch=4),
    "wide": dict(vocab=4096, d=768, layers=2, heads=8, seq=64, batch=4),
    "long": dict(vocab=512, d=256, layers=3, heads=4, seq=1024, batch=2),
}
OVERHEAD = 48 << 20  # what a measured peak may exceed the budget by: allocator and interpreter


def shape(name: str):
    return gpt_task(**SHAPES[name])


@pytest.fixture(scope="module")
def machine(tmp_path_factory):
    if not memory.reset_peak_rss():
        pytest.skip("cannot measure peak RSS here")
    return Machine.measure(tmp_path_factory.mktemp("disk"), size=128 << 20)


@pytest.fixture(scope="module")
def profiles():
    out = {}
    for name in SHAPES:
        build, sample = shape(name)
        out[name] = Profile.measure(build(), sample)
    return out


@pytest.mark.parametrize("name", list(SHAPES))
def test_auto_stays_within_its_budgets(name, machine, profiles, tmp_path):
    build, sample = shape(name)
    prof = profiles[name]
    resident = predict(Policy(device="cpu"), prof, machine).peak["cpu"]
    least = predict(Policy(device="cpu", params="nvme", optimizer="nvme", grads="nvme",
                           activations="nvme", nvme_dir=str(tmp_path), prefetch=1,
                           cpu_budget=2 * prof.largest_unit), prof, machine).peak["cpu"]
    assert least < resident
    # Room for everything; half way; barely more than the least any placement needs.
    for fraction, budget in ((1.0, int(1.5 * resident)), (0.5, (resident + least) // 2),
                             (0.0, int(1.1 * least))):
        pol = Policy.auto(build(), sample=sample, cpu_budget=budget, nvme_dir=str(tmp_path),
                          machine=machine, profile=prof, device="cpu")
        assert pol.plan.prediction.peak["cpu"] <= budget
        got = measure(build, sample, pol, steps=2)
        assert got.peak <= budget + OVERHEAD, (name, fraction, pol.explain(), got)
        if fraction < 1:  # something had to move to NVMe
            assert "nvme" in (pol.params, pol.optimizer, pol.grads, pol.activations)


def test_auto_is_faster_than_all_on_nvme_where_the_budget_allows(machine, profiles, tmp_path):
    build, sample = shape("deep")
    prof = profiles["deep"]
    pol = Policy.auto(build(), sample=sample, cpu_budget="4GiB", nvme_dir=str(tmp_path),
                      machine=machine, profile=prof, device="cpu")
    naive = Policy(device="cpu", params="nvme", optimizer="nvme", grads="nvme",
                   activations="nvme", nvme_dir=str(tmp_path), cpu_budget=4 * prof.largest_unit)
    # The prediction only: the measured comparison, interleaved rounds and their medians, is
    # bench/planner_vs_naive.py (wall time on a shared machine belongs in bench/).
    assert pol.plan.prediction.step_s < predict(naive, prof, machine).step_s
    text = pol.explain()
    assert "predicted step" in text and "bottleneck" in text and "all on NVMe" in text


def test_auto_measures_its_best_predicted_placements(machine, profiles, tmp_path):
    """With build=, the best-predicted placements are measured; the fastest that fits wins."""
    build, sample = shape("deep")
    prof = profiles["deep"]
    resident = predict(Policy(device="cpu"), prof, machine).peak["cpu"]
    budget = resident // 2
    pol = Policy.auto(build(), sample=sample, cpu_budget=budget, nvme_dir=str(tmp_path),
                      machine=machine, profile=prof, device="cpu", build=build, trials=2)
    trials = pol.plan.trials
    assert 2 <= len(trials) <= 4
    placements = {(q.params, q.optimizer, q.grads, q.activations) for q, _ in trials}
    assert len(placements) == len(trials)  # distinct placements, not prefetch variants
    fits = [(m.step_s, q) for q, m in trials if m.peak <= budget]
    assert fits and min(fits, key=lambda t: t[0])[1] is pol
    assert "<- chosen" in pol.explain()
    assert measure(build, sample, pol, steps=1).peak <= budget + OVERHEAD


@pytest.mark.parametrize("overlap", [True, "backward"])
def test_predicted_bytes_match_the_moved_ones(overlap, machine, profiles, tmp_path):
    build, sample = shape("deep")
    prof = profiles["deep"]
    p = Policy(device="cpu", params="nvme", optimizer="nvme", grads="nvme",
               activations="nvme", nvme_dir=str(tmp_path), cpu_budget=4 * prof.largest_unit,
               activation_threshold="1MiB")
    pred = predict(p, prof, machine, overlap)
    got = measure(build, sample, p, steps=1, overlap=overlap)
    assert got.bytes_read == pytest.approx(pred.bytes_read, rel=0.15)
    assert got.bytes_written == pytest.approx(pred.bytes_written, rel=0.15)
    if overlap == "backward":
        # the gradients wait for their chunk's step instead of a round trip to NVMe, and the
        # step's work joins backward's
        default = predict(p, prof, machine)
        assert default.bytes_read - pred.bytes_read == prof.param_bytes
        assert default.bytes_written - pred.bytes_written == prof.param_bytes
        assert pred.phases["step"] == 0 and pred.step_s < default.step_s


def test_profiling_leaves_gradients_and_random_streams_as_they_were():
    """Policy.auto's sample steps (Profile.measure) once left every parameter's gradient set
    and the random streams advanced: training after it was not the training without it."""
    build, sample = shape("deep")
    model = build()
    lm = model.head.weight
    lm.grad = torch.ones_like(lm)  # the user's own, before
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    Profile.measure(model, lambda m: sample(m) + torch.rand(()) * 0, repeats=1)
    assert torch.equal(torch.rand(3), want)
    assert torch.equal(lm.grad, torch.ones_like(lm))
    assert all(p.grad is None for p in model.parameters() if p is not lm)


def test_profile_counts_a_record_per_saved_activation_not_per_parameter_view():
    """The cost model sizes the pager's window by the mean record: views of parameters that
    autograd saves (a Linear's weight) are neither paged nor records."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                          nn.Linear(512, 512))
    x = torch.randn(512, 512)  # each saved activation is 1 MiB, as is each weight
    prof = Profile.measure(model, lambda m: m(x).square().mean())
    assert prof.activation_records == 6 and prof.activation_bytes == 6 << 20


@pytest.mark.parametrize("bench", [{"foo": 1}, "not json", {"recommended_figures": {}}])
def test_a_bench_result_that_is_not_one_is_refused_naming_it(tmp_path, bench):
    if isinstance(bench, str):
        path = tmp_path / "nvme.json"
        path.write_text("{" + bench)
        bench = str(path)
    with pytest.raises(ValueError, match="is not a result of tieroffload-bench nvme --json"):
        Machine.measure(str(tmp_path), bench)
    with pytest.raises(FileNotFoundError, match="nvme_dir does not exist or is not a directory"):
        Machine.measure(str(tmp_path / "nvme.json") if isinstance(bench, str) else __file__)


def test_auto_refuses_with_the_numbers(machine, profiles, tmp_path):
    build, sample = shape("deep")
    with pytest.raises(MemoryError, match=r"no placement fits: the smallest needs cpu \d+ bytes"):
        Policy.auto(build(), sample=sample, cpu_budget="1MiB", nvme_dir=str(tmp_path),
                    machine=machine, profile=profiles["deep"], device="cpu")
    with pytest.raises(MemoryError, match="no nvme_dir"):
        Policy.auto(build(), sample=sample, cpu_budget="8MiB", machine=machine,
                    profile=profiles["deep"], device="cpu")
    assert "set by hand" in Policy().explain()


class Pause(nn.Module):
    """Compute that takes ``seconds`` and owns no parameters: the disk idles through it once
    the window's reads are done."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


@pytest.mark.parametrize("prefetch,delay,pause,deepens",
                         [(1, 0.004, 0.03, True), (2, 0.02, 0.0, False)])
def test_prefetch_deepens_only_where_late_units_waited_for_the_window(tmp_path, prefetch, delay,
                                                                       pause, deepens):
    """Depth 1, short reads, a pause before every fourth layer: the disk idles through the
    pause with the window full, and the reads of the fast layers after it start on an idle
    disk and arrive late, so the window deepens. Depth 2, long reads, no pause: each read
    queues behind the one before (the disk is slower than compute); depth adds no bandwidth,
    and each unit of it is a unit the budget no longer keeps from one pass to the next, so it
    stays."""
    torch.manual_seed(0)
    ref = mlp(width=256, depth=12)
    layers = list(ref)
    if pause:
        layers = [m for i, m in enumerate(layers) for m in ((Pause(pause), m) if i % 8 == 0
                                                            else (m,))]
    ref = nn.Sequential(*layers)
    unit = 257 * 256 * 4
    model = tieroffload.offload(copy.deepcopy(ref), Policy(
        params="nvme", nvme_dir=str(tmp_path), device="cpu", cpu_budget=10 * unit,
        prefetch=prefetch), _io_delay=functools.partial(time.sleep, delay))
    x = torch.randn(1, 256)
    for _ in range(6):
        assert torch.equal(model(x), ref(x))
    st = tieroffload.stats(model)
    if deepens:
        assert st["prefetch"] > 1 and st["adaptations"], st
        assert all("late" in a["why"] for a in st["adaptations"])
    else:
        assert st["late"] >= 10, st  # measured 16 to 27 over the five passes after the first
        assert st["prefetch"] == 2 and not st["adaptations"], st
    assert st["peak_resident"] <= 10 * unit
    tieroffload.close(model)


def test_fixed_prefetch_does_not_adapt(tmp_path):
    torch.manual_seed(0)
    model = tieroffload.offload(mlp(width=256, depth=12), Policy(
        params="nvme", nvme_dir=str(tmp_path), device="cpu", cpu_budget=10 * 257 * 256 * 4,
        prefetch=1, adapt=False), _io_delay=functools.partial(time.sleep, 0.004))
    for _ in range(4):
        model(torch.randn(1, 256))
    st = tieroffload.stats(model)
    assert st["prefetch"] == 1 and not st["adaptations"]
    tieroffload.close(model)

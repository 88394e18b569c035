"""A unit's states: every change goes through ``Unit.move_to``, which makes the moves that
``TRANSITIONS`` lists and refuses any other, naming the unit and the move; offloaded training
drives its units through those moves only, and trains as plain PyTorch does."""

import collections
import copy

import pytest
import torch
from models import TinyGPT

import tieroffload
from tieroffload import Policy
from tieroffload.aio.swap import SwapSpace
from tieroffload.core.homes import NvmeHome
from tieroffload.core.mover import Mover, timed_wait
from tieroffload.core.stats import Stats
from tieroffload.core.units import TRANSITIONS, State, Unit

# How a new unit (resident) gets to each state through listed moves.
PATH = {State.RESIDENT: [], State.AWAY: [State.AWAY], State.FETCHING: [State.AWAY, State.FETCHING],
        State.FLUSHING: [State.FLUSHING], State.WRITING: [State.WRITING]}
LEGAL = [(a, b) for a in State for b in State if b in TRANSITIONS[a]]
ILLEGAL = [(a, b) for a in State for b in State if b not in TRANSITIONS[a]]


def ids(pair: tuple[State, State]) -> str:
    return f"{pair[0].name}-{pair[1].name}"


def unit_in(state: State) -> Unit:
    u = Unit(0, "u", [("w", torch.nn.Parameter(torch.zeros(4)))])
    for s in PATH[state]:
        u.move_to(s)
    assert u.state is state
    return u


def test_every_state_is_reached_and_left():
    assert set(TRANSITIONS) == set(State)
    assert {b for tos in TRANSITIONS.values() for b in tos} == set(State)
    assert all(TRANSITIONS[s] for s in State)
    assert Unit(0, "u", []).state is State.RESIDENT


@pytest.mark.parametrize("move", LEGAL, ids=ids)
def test_every_listed_transition_is_made(move):
    src, dst = move
    u = unit_in(src)
    u.move_to(dst)
    assert u.state is dst


@pytest.mark.parametrize("move", ILLEGAL, ids=ids)
def test_any_other_move_is_refused_naming_the_unit_and_the_move(move):
    src, dst = move
    u = unit_in(src)
    with pytest.raises(RuntimeError, match=rf"^tieroffload: unit 'u': {src.name} -> "
                       rf"{dst.name} is not a transition \(from {src.name}: "):
        u.move_to(dst)
    assert u.state is src


def test_the_state_is_changed_only_by_a_checked_move():
    """``unit.state`` is read-only: ``move_to`` is the one way a state changes."""
    u = unit_in(State.RESIDENT)
    with pytest.raises(AttributeError):
        u.state = State.AWAY
    assert u.state is State.RESIDENT


def test_a_unit_of_separate_storages_round_trips_through_nvme_in_staging_chunks(tmp_path):
    """A unit whose parameters are not one aligned buffer (a GPU's, there the only kind)
    goes to and from NVMe through the staging buffers, chunk by chunk, reads of the next
    chunks in flight and buffers reused round robin: its bytes come back exactly, and the
    staging memory is at most ``chunk * nbuf``."""
    g = torch.Generator().manual_seed(0)
    shapes = [(3000,), (17, 33), (5,), (4096 + 7,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    saved = [p.detach().clone() for p in params]
    u = Unit(0, "u", [(f"p{i}", p) for i, p in enumerate(params)])
    stats = Stats()
    swap = SwapSpace(str(tmp_path), u.nbytes + (1 << 20), "units-test")
    mover = Mover(torch.device("cpu"), 4096, 3, stats)
    try:
        u.home = NvmeHome(swap, u.nbytes)
        assert len(mover.staging.chunks(u.nbytes)) > 3  # every buffer used more than once
        timed_wait(mover.store(u), stats)
        u.free()
        u.move_to(State.AWAY)
        u.allocate()
        u.move_to(State.FETCHING)
        timed_wait(mover.load(u), stats)
        u.move_to(State.RESIDENT)
        for p, s in zip(params, saved):
            assert torch.equal(p.detach(), s)
        assert sum(n for _, n in mover.held()) <= mover.overhead == 3 * 4096
        assert stats.bytes_written["nvme"] == stats.bytes_read["nvme"] == u.nbytes
    finally:
        mover.close()
        swap.close()


def train_both(tmp_path, overlap) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Three AdamW steps of a TinyGPT, plain and offloaded (parameters and optimizer state on
    NVMe under a budget of a few units); losses and parameters are PyTorch's bit for bit."""
    torch.manual_seed(0)
    ref = TinyGPT()
    model = tieroffload.offload(copy.deepcopy(ref), Policy(
        params="nvme", optimizer="nvme", nvme_dir=str(tmp_path), device="cpu",
        cpu_budget="80KiB"))
    kw = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    opt_ref = torch.optim.AdamW(ref.parameters(), fused=True, **kw)
    opt = tieroffload.optimizer(model, torch.optim.AdamW, overlap=overlap, **kw)
    losses = {}
    for m, o in ((model, opt), (ref, opt_ref)):
        out = []
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            loss = m(torch.randint(0, 97, (2, 16), generator=g)).float().square().mean()
            loss.backward()
            out.append(loss.item())
            o.step()
            o.zero_grad()
        losses[m] = out
    assert losses[model] == losses[ref]
    with tieroffload.materialize(model):
        for (n, a), b in zip(ref.named_parameters(), model.parameters()):
            assert torch.equal(a, b), n
    units = list(model._tieroffload.units)
    opt.close()
    tieroffload.close(model)
    return units


def test_offloaded_training_moves_units_only_through_listed_transitions(tmp_path, monkeypatch):
    """Updates deferred to the next forward (evictions write changed units) and updates in
    backward (written behind): every state change of every unit goes through ``move_to`` (its
    state is the last move's), and the scheduler's units make the reads, the evictions with
    and without a write, and the writes behind that TRANSITIONS lists."""
    moves: collections.Counter = collections.Counter()
    last: dict[int, State] = {}
    move_to = Unit.move_to

    def recorded(self: Unit, to: State) -> None:
        src = self.state
        move_to(self, to)
        moves[(self.kind, src, to)] += 1
        last[id(self)] = to

    monkeypatch.setattr(Unit, "move_to", recorded)
    for overlap in (True, "backward"):
        (tmp_path / str(overlap)).mkdir()
        for u in train_both(tmp_path / str(overlap), overlap):
            assert u.state is last[id(u)], u
    made = {(src, dst) for kind, src, dst in moves if kind == "params"}
    assert made <= set(LEGAL)
    assert {(State.AWAY, State.FETCHING), (State.FETCHING, State.RESIDENT),
            (State.RESIDENT, State.AWAY), (State.RESIDENT, State.WRITING),
            (State.WRITING, State.RESIDENT), (State.RESIDENT, State.FLUSHING)} <= made, made
    assert any(src is State.FLUSHING for src, _ in made), made
    assert {(src, dst) for kind, src, dst in moves if kind == "optimizer"} >= {
        (State.AWAY, State.FETCHING), (State.FETCHING, State.RESIDENT)}

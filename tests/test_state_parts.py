"""The parts of an offloaded model's state, each on its own: the paged optimizer meets the
contract the hooks declare (``hooks.contract.PagedOptimizer``), and the pass tracker's phase
follows forward and backward with checked transitions."""

from __future__ import annotations

import inspect

import pytest
import torch

import tieroffload
from tieroffload.hooks import registry
from tieroffload.hooks.contract import PagedOptimizer
from tieroffload.hooks.passes import Phase
from tieroffload.optim.paged import PagedOptimizer as Paged


def small(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return tieroffload.offload(model, tieroffload.Policy(params="nvme", nvme_dir=tmp_path,
                                                         device="cpu"))


def test_paged_optimizer_meets_the_hooks_contract(tmp_path):
    model = small(tmp_path)
    opt = tieroffload.optimizer(model, torch.optim.AdamW, lr=1e-2)
    assert isinstance(opt, PagedOptimizer)
    assert set(registry.state_of(model).optimizers) == {opt}
    for name, want in vars(PagedOptimizer).items():
        if callable(want) and not name.startswith("_"):
            have = getattr(Paged, name)
            assert list(inspect.signature(have).parameters) == \
                list(inspect.signature(want).parameters), name
    tieroffload.close(model)


def test_training_phase_follows_forward_and_backward(tmp_path):
    model = small(tmp_path)
    state = registry.state_of(model)
    x = torch.randn(4, 16)
    assert state.phase is Phase.IDLE
    with torch.no_grad():
        model(x)  # no training forward
    assert state.phase is Phase.IDLE
    seen = []  # the phase while backward reaches the first layer's weight
    model[0].weight.register_hook(lambda g: seen.append(state.phase))
    loss = model(x).square().sum()
    assert state.phase is Phase.FORWARD
    loss.backward(retain_graph=True)
    assert state.phase is Phase.IDLE
    loss.backward()  # a second backward with no forward before it: no micro-batch
    assert state.phase is Phase.IDLE
    assert seen == [Phase.BACKWARD, Phase.EXTRA_BACKWARD]
    with pytest.raises(RuntimeError, match="training phase idle cannot go to backward"):
        state.passes._enter(Phase.BACKWARD)
    tieroffload.close(model)


def test_a_backward_that_raised_leaves_the_phase_idle(tmp_path):
    model = small(tmp_path)
    state = registry.state_of(model)
    out = model(torch.randn(4, 16))

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")

    out.register_hook(lambda g: g)
    h = model[0].weight.register_hook(fail)
    with pytest.raises(ValueError, match="boom"):
        out.sum().backward()
    h.remove()
    assert state.phase is Phase.BACKWARD and state.backward_raised()
    state.settle_failed_backward()
    assert state.phase is Phase.IDLE and not state.backward_raised()
    tieroffload.close(model)

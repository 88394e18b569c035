"""A way out after every failure: a refused hyperparameter, a checksum error, a torn step.

Each case is compared bit for bit with a run that never met the failure (or, for a plain torch
optimizer, with plain PyTorch meeting the same one), and ends with ``close()`` releasing
everything. Helpers come from test_faults.py.
"""

import copy

import pytest
import torch
from models import TinyGPT
from test_faults import KW, assert_same, batch, nvme_policy, optim_state_of, params_of, train_step

import tieroffload


def loss_of(model, step: int) -> torch.Tensor:
    return model(batch(step)).float().square().mean()



@pytest.mark.parametrize("bad", [None, "3e-3"])
@pytest.mark.parametrize("overlap", [True, False])
def test_a_bad_lr_is_refused_by_step_and_a_fixed_retry_matches_a_clean_run(tmp_path, bad,
                                                                           overlap):
    """lr set to None or a string after construction: the paged optimizer's step() refuses it
    (a TypeError naming lr and the group), before it takes anything; with the value fixed,
    step() again equals a run that never had it, and state_dict() and close() work."""
    torch.manual_seed(0)
    ref = TinyGPT()
    (tmp_path / "clean").mkdir()
    (tmp_path / "bad").mkdir()
    runs = {}
    for name in ("clean", "bad"):
        model = tieroffload.offload(copy.deepcopy(ref), nvme_policy(tmp_path / name,
                                                                    optimizer="nvme"))
        opt = tieroffload.optimizer(model, torch.optim.AdamW, overlap=overlap, **KW)
        train_step(model, opt, 0)
        opt.zero_grad()
        loss_of(model, 1).backward()
        if name == "bad":
            opt.param_groups[0]["lr"] = bad
            with pytest.raises(TypeError, match=r"param group 0: AdamW.step\(\) refuses lr="):
                opt.step()
            opt.param_groups[0]["lr"] = KW["lr"]
        opt.step()
        for s in (2, 3):
            train_step(model, opt, s)
        runs[name] = (params_of(model), optim_state_of(opt))
        opt.close()
        tieroffload.close(model)
    assert_same(runs["clean"][0], runs["bad"][0], "parameters")
    assert_same(runs["clean"][1], runs["bad"][1], "optimizer state")


def test_a_bad_lr_with_overlap_backward_is_refused_before_any_chunk_steps(tmp_path):
    """overlap="backward" steps in backward: lr=None is refused there, before the first chunk
    steps, so nothing is torn; fixed, the step redone equals a clean run."""
    torch.manual_seed(0)
    ref = TinyGPT()
    runs = {}
    for name in ("clean", "bad"):
        (tmp_path / name).mkdir()
        model = tieroffload.offload(copy.deepcopy(ref), nvme_policy(tmp_path / name,
                                                                    optimizer="nvme"))
        opt = tieroffload.optimizer(model, torch.optim.AdamW, overlap="backward", **KW)
        train_step(model, opt, 0)
        if name == "bad":
            opt.param_groups[0]["lr"] = None
            opt.zero_grad()
            with pytest.raises(TypeError, match="refuses lr=None"):
                loss_of(model, 1).backward()
            assert not opt.stepped_in_backward
            opt.param_groups[0]["lr"] = KW["lr"]
        for s in (1, 2):
            train_step(model, opt, s)
        runs[name] = (params_of(model), optim_state_of(opt))
        opt.close()
        tieroffload.close(model)
    assert_same(runs["clean"][0], runs["bad"][0], "parameters")
    assert_same(runs["clean"][1], runs["bad"][1], "optimizer state")


def test_a_plain_optimizer_step_that_raises_leaves_no_unit_pinned(tmp_path):
    """torch's AdamW over an offloaded model refuses lr=None at step(), after offload's step
    hook pinned every unit: the retry with lr fixed unpins them (they can leave again), and
    the result equals plain PyTorch meeting the same refusal."""
    torch.manual_seed(0)
    ref = TinyGPT()
    model = tieroffload.offload(copy.deepcopy(ref), nvme_policy(tmp_path))
    opts = [torch.optim.AdamW(m.parameters(), fused=True, **KW) for m in (ref, model)]
    for m, o in zip((ref, model), opts):
        train_step(m, o, 0)
        o.zero_grad()
        loss_of(m, 1).backward()
        o.param_groups[0]["lr"] = None
        with pytest.raises(TypeError):
            o.step()
        o.param_groups[0]["lr"] = KW["lr"]
        o.step()
    assert sum(u.pins for u in model._tieroffload.units) == 0
    for s in (2, 3):
        for m, o in zip((ref, model), opts):
            train_step(m, o, s)
    assert_same(params_of(ref), params_of(model), "parameters")
    tieroffload.close(model)

"""``tieroffload.initialize`` and its engine given bad input: each mistake is refused with one
line naming the key (or argument) and the value, before anything stored changes; a refused
``initialize`` leaves the model bit for bit as it was; ``initialize`` and the engine's
checkpoint methods take ``deepspeed.initialize``'s keywords."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re

import pytest
import torch
import torch.nn.functional as F

import tieroffload
from tieroffload.checkpoint import CheckpointError
from tieroffload.dropin import engine as engine_module

GOOD = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))


def with_(section: str, **params) -> dict:
    """GOOD with ``params`` merged into ``section``'s params."""
    cfg = json.loads(json.dumps(GOOD))
    cfg[section]["params"].update(params)
    return cfg


def snapshot(m: torch.nn.Module) -> list:
    return [(p, p.data.clone()) for p in m.parameters()]


def assert_untouched(m: torch.nn.Module, before: list) -> None:
    assert getattr(m, "_tieroffload", None) is None  # not offloaded
    assert [p for p, _ in before] == list(m.parameters())  # the user's own Parameter objects
    for p, data in before:
        assert p.dtype == torch.float32 and p.device == data.device
        assert torch.equal(p.data.view(torch.int32), data.view(torch.int32))  # bit for bit


def one_step(engine) -> None:
    out = engine(torch.ones(2, 4, dtype=engine.plan.dtype)).float()
    engine.backward(F.mse_loss(out, torch.zeros(2, 1)))
    engine.step()


@pytest.mark.parametrize("cfg, words", [
    (with_("optimizer", lr=-1e-3), "optimizer.params.lr must be a number >= 0, not -0.001"),
    (with_("optimizer", lr="3e-3"), "optimizer.params.lr must be a number >= 0, not '3e-3'"),
    (with_("optimizer", betas="0.9,0.99"), "optimizer.params.betas must be two numbers"),
    (with_("optimizer", weight_decay=-0.1), "optimizer.params.weight_decay must be a number"),
    (with_("optimizer", amsgrad="yes"), "optimizer.params.amsgrad must be true or false"),
    (with_("scheduler", warmup_num_steps=-4), "scheduler.params.warmup_num_steps must be"),
    ({**GOOD, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "nesterov": True}}},
     "optimizer.params: torch.optim.SGD refuses"),
])
def test_a_refused_initialize_leaves_the_model_as_it_was_and_a_fixed_retry_works(cfg, words):
    m = model()
    before = snapshot(m)
    with pytest.raises(ValueError, match=f"^DeepSpeed {words}"):
        tieroffload.initialize(model=m, config=cfg)
    assert_untouched(m, before)
    engine, *_ = tieroffload.initialize(model=m, config=GOOD)  # not "offloaded already"
    one_step(engine)
    tieroffload.close(engine.module)


@pytest.mark.parametrize("bf16", [True, False])
def test_a_failure_after_the_model_was_cast_and_offloaded_puts_it_back(monkeypatch, bf16):
    def broken(*args, **kwargs):
        raise RuntimeError("out of pinned memory")

    m = model()
    m(torch.ones(2, 4)).sum().backward()  # gradients the user has: given back as they were
    grads = [p.grad.clone() for p in m.parameters()]
    before = snapshot(m)
    cfg = {**GOOD, "bf16": {"enabled": bf16}}
    monkeypatch.setattr(engine_module, "paged_optimizer", broken)
    with pytest.raises(RuntimeError, match="out of pinned memory"):
        tieroffload.initialize(model=m, config=cfg)
    assert_untouched(m, before)
    assert all(p.grad.dtype == torch.float32 and torch.equal(p.grad, g)
               for p, g in zip(m.parameters(), grads))
    m.zero_grad()
    monkeypatch.undo()
    engine, *_ = tieroffload.initialize(model=m, config=cfg)
    one_step(engine)
    tieroffload.close(engine.module)


@pytest.mark.parametrize("change, words", [
    ({"bf16": {"enabled": "false"}}, "bf16.enabled must be true or false (a JSON bool), not "
                                     "'false'"),
    ({"bf16": {"enabled": "true"}}, "bf16.enabled must be true or false"),
    ({"bf16": {"enabled": False}, "fp16": {"enabled": 1}}, "fp16.enabled must be true or false"),
    ({"wall_clock_breakdown": "false"}, "wall_clock_breakdown must be true or false"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": True}}},
     "optimizer.params.lr must be a number >= 0, not True"),
    ({"gradient_accumulation_steps": 2.0},
     "gradient_accumulation_steps must be a whole number >= 1, not 2.0"),
    ({"optimizer": []}, "optimizer must be a dict of settings, not []"),
    ({"fp16": False}, "fp16 must be a dict of settings, not False"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "."}},
      "aio": {"queue_depth": "8"}}, "aio.queue_depth must be a whole number >= 0, not '8'"),
    ({"bf16": {"enabled": False}, "fp16": {"enabled": True, "initial_scale_power": 1100}},
     "fp16.initial_scale_power must be at most 64"),
    ({"csv_monitor": {"enabled": True, "output_path": 5}},
     "csv_monitor.output_path must be a string (a path or a name), not 5"),
])
def test_bools_must_be_json_bools_and_numbers_must_be_numbers(change, words):
    m = model()
    before = snapshot(m)
    with pytest.raises(ValueError, match="^" + re.escape(f"DeepSpeed {words}")):
        tieroffload.initialize(model=m, config={**GOOD, **change})
    assert_untouched(m, before)


def test_saving_between_micro_batches_is_refused_naming_the_micro_step(tmp_path):
    engine, *_ = tieroffload.initialize(model=model(), config={**GOOD,
                                                               "gradient_accumulation_steps": 2})
    one_step(engine)  # 1 of 2 micro-batches: the partial gradient lives only in memory
    with pytest.raises(RuntimeError, match="^engine.save_checkpoint at micro-step 1, inside an "
                                           "accumulation of 2 .*is_gradient_accumulation_bound"):
        engine.save_checkpoint(tmp_path / "ck")
    assert not (tmp_path / "ck").exists()
    one_step(engine)  # the boundary: now it saves
    assert engine.save_checkpoint(tmp_path / "ck")
    assert (tmp_path / "ck" / "latest").read_text() == "global_step1"
    tieroffload.close(engine.module)


def test_a_load_between_micro_batches_drops_their_gradients(tmp_path):
    """A checkpoint is saved at an accumulation boundary: loaded after a micro-batch's
    backward, the run goes on as from a fresh load, without that micro-batch's gradient."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}

    def run(junk: bool) -> torch.Tensor:
        engine, *_ = tieroffload.initialize(model=model(), config=cfg)
        if junk:
            one_step(engine)  # half an accumulation, then the load
        engine.load_checkpoint(tmp_path / "ck")
        one_step(engine)
        one_step(engine)
        with tieroffload.materialize(engine.module):
            w = [p.detach().clone() for p in engine.module.parameters()]
        tieroffload.close(engine.module)
        return w

    engine, *_ = tieroffload.initialize(model=model(), config=cfg)
    one_step(engine)
    one_step(engine)
    engine.save_checkpoint(tmp_path / "ck")
    tieroffload.close(engine.module)
    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))


def test_engine_checkpoint_paths_are_checked_before_anything_is_written(tmp_path):
    engine, *_ = tieroffload.initialize(model=model(), config=GOOD)
    one_step(engine)
    (tmp_path / "file").write_text("x")
    save = tmp_path / "nest" / "save"
    with pytest.raises(CheckpointError, match="needs a save_dir"):
        engine.save_checkpoint("")
    with pytest.raises(CheckpointError, match="file is a file, not a directory"):
        engine.save_checkpoint(tmp_path / "file")
    for tag in ("../../escape", "..", "a/b", "a\\b", "", ".hidden", "latest", "x\0y", "a" * 300):
        with pytest.raises(CheckpointError, match="is not a plain folder name"):
            engine.save_checkpoint(save, tag=tag)
    assert sorted(os.listdir(tmp_path)) == ["file"]  # nothing written, nothing escaped
    os.makedirs(save / "latest")
    with pytest.raises(CheckpointError, match="latest is not a regular file"):
        engine.save_checkpoint(save)
    assert os.listdir(save) == ["latest"]  # no tag folder, no latest.tmp
    tieroffload.close(engine.module)


def test_a_latest_file_the_engine_did_not_write_is_left_alone_and_not_followed(tmp_path):
    """save_dir/latest is overwritten only where it names a checkpoint beside it (a save
    wrote it): a user's file of that name is refused and kept; a latest naming '../x' is not
    followed by a load."""
    engine, *_ = tieroffload.initialize(model=model(), config=GOOD)
    one_step(engine)
    save = tmp_path / "save"
    save.mkdir()
    (save / "latest").write_text("my notes")
    with pytest.raises(CheckpointError, match="latest is not a regular file naming a "
                                              "checkpoint folder"):
        engine.save_checkpoint(save)
    assert os.listdir(save) == ["latest"] and (save / "latest").read_text() == "my notes"
    os.remove(save / "latest")
    engine.save_checkpoint(save)
    one_step(engine)
    engine.save_checkpoint(save)  # over its own latest
    assert (save / "latest").read_text() == "global_step2"
    (save / "latest").write_text("../outside")
    with pytest.raises(CheckpointError, match="tag '../outside' is not a plain folder name"):
        engine.load_checkpoint(save)
    tieroffload.close(engine.module)


def test_load_checkpoint_takes_deepspeed_s_keywords(tmp_path):
    engine, opt, *_ = tieroffload.initialize(model=model(), config=GOOD)
    one_step(engine)
    engine.save_checkpoint(tmp_path)
    saved = [p.detach().clone() for p in engine.module.parameters()]
    one_step(engine)
    one_step(engine)
    path, state = engine.load_checkpoint(tmp_path, load_optimizer_states=False,
                                         load_lr_scheduler_states=False)
    assert path.endswith("global_step1") and state == {}
    assert all(torch.equal(p, q) for p, q in zip(engine.module.parameters(), saved))
    assert engine.global_steps == 1
    one_step(engine)
    one_step(engine)
    engine.load_checkpoint(tmp_path, load_module_only=True)  # the counters stay
    assert engine.global_steps == 3
    assert all(torch.equal(p, q) for p, q in zip(engine.module.parameters(), saved))
    with pytest.raises(ValueError, match="load_module_strict=False and custom_load_fn are not"):
        engine.load_checkpoint(tmp_path, load_module_strict=False)
    tieroffload.close(engine.module)


def test_initialize_takes_deepspeed_s_keywords(tmp_path):
    deepspeed_names = ["args", "model", "optimizer", "model_parameters", "training_data",
                       "lr_scheduler", "distributed_port", "mpu", "dist_init_required",
                       "collate_fn", "config", "mesh_param", "config_params"]
    assert list(inspect.signature(tieroffload.initialize).parameters)[:13] == deepspeed_names
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(GOOD))
    for kw in ({"args": argparse.Namespace(deepspeed_config=str(path), local_rank=0)},
               {"args": argparse.Namespace(deepscale_config=str(path))},
               {"args": None, "config_params": GOOD, "dist_init_required": False, "mpu": None}):
        engine, *_ = tieroffload.initialize(model=model(), **kw)
        one_step(engine)
        tieroffload.close(engine.module)
    m = model()
    before = snapshot(m)
    for kw, words in [
        ({"optimizer": torch.optim.SGD, "config": GOOD}, "client optimizer= is not supported: "
                                                         "put it in the config's optimizer"),
        ({"lr_scheduler": lambda o: None, "config": GOOD}, "client lr_scheduler= is not "
                                                           "supported: put it in the config's"),
        ({"config": GOOD, "config_params": GOOD}, "config and config_params"),
        ({"args": argparse.Namespace(deepspeed_config=str(path)), "config": GOOD},
         "both as config= and in args.deepspeed_config"),
        ({"args": argparse.Namespace(deepspeed_config=None)}, "needs a DeepSpeed config"),
    ]:
        with pytest.raises(ValueError, match=f"^tieroffload.initialize.*{words}"):
            tieroffload.initialize(model=m, **kw)
    assert_untouched(m, before)

"""``tieroffload.initialize``: a DeepSpeed config run as DeepSpeed runs it on one process. The
DeepSpeedExamples article's config (ZeRO-3 with parameters and optimizer on NVMe, CPU
activation checkpointing, WarmupLR, bf16, accumulation 2, clipping 1.0) equals, bit for bit, a
plain PyTorch loop that implements those semantics by hand (DeepSpeed's clip: the norm in fp32
over the bf16 gradients, the fp32 masters' gradients clipped), also resumed in a new process; each
schedule follows DeepSpeed's formula; batch sizes are checked as DeepSpeed checks them; unused
keys are warned about, or refused with ``strict=True``."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import tieroffload
from tieroffload.dropin import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR
from tieroffload.dropin.scaler import DeepSpeedLossScale
from tieroffload.testing.deepspeed import article_config as deepspeed_article
from tieroffload.testing.models import GPT, token_batch

ROOT = pathlib.Path(__file__).resolve().parent.parent
VOCAB, SEQ, MICRO, ACCUM, STEPS = 64, 16, 2, 2, 4
MAX_LR, WARMUP = 1e-2, 4


def article_config(nvme: str) -> dict:
    """The article's config at this file's sizes (micro batch, accumulation: MICRO, ACCUM)."""
    return deepspeed_article(nvme, lr=MAX_LR, weight_decay=0.1, warmup_steps=WARMUP,
                             max_live=40000, prefetch=10000, steps_per_print=1,
                             wall_clock_breakdown=False)


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab=VOCAB, d=32, layers=2, heads=2, seq=SEQ)


def loss_of(model, step: int, micro: int) -> torch.Tensor:
    x, y = token_batch(1000 * step + micro, MICRO, SEQ, VOCAB)
    return F.cross_entropy(model(x).float().view(-1, VOCAB), y.reshape(-1))


def warmup_lr(k: int) -> float:
    """DeepSpeed's WarmupLR (log) for optimizer step k: built at iteration -1, stepped after
    each optimizer step, so step k runs at iteration k - 1."""
    i = k - 1
    if i < 0:
        return 0.0
    if i >= WARMUP:
        return MAX_LR
    return 0.0 + MAX_LR * (1.0 / math.log(WARMUP) * math.log(i + 1))


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


@functools.cache
def reference(steps: int) -> tuple[list[float], list[float], list[float], dict]:
    """The same semantics by hand: bf16 weights, fp32 masters stepped by AdamW(fused=True), each
    micro-batch's loss divided by the accumulation steps, the warm-up lr set before each step,
    and DeepSpeed's clip (ZeRO-3, fp32 masters): the bf16 gradients go to the masters in fp32,
    where torch's clip_grad_norm_ takes the norm (the 2-norm of each gradient in fp32, then the
    2-norm of those) and multiplies them by min(1, 1.0 / (norm + 1e-6)). Returns the losses,
    lrs, norms and the model's state dict."""
    ref = gpt().to(torch.bfloat16)
    masters = [torch.nn.Parameter(p.detach().float()) for p in ref.parameters()]
    opt = torch.optim.AdamW(masters, lr=MAX_LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            fused=True)
    losses, lrs, norms = [], [], []
    for k in range(steps):
        for micro in range(ACCUM):
            loss = loss_of(ref, k, micro)
            (loss / ACCUM).backward()
            losses.append(loss.item())
        for g in opt.param_groups:
            g["lr"] = warmup_lr(k)
        lrs.append(warmup_lr(k))
        for q, p in zip(masters, ref.parameters()):
            q.grad = p.grad.float()
        norms.append(torch.nn.utils.clip_grad_norm_(masters, 1.0).item())
        opt.step()
        with torch.no_grad():
            for q, p in zip(masters, ref.parameters()):
                p.copy_(q)
        ref.zero_grad()
        opt.zero_grad()
    return losses, lrs, norms, ref.state_dict()


def train(engine, start: int, stop: int) -> tuple[list[float], list[float], list[float]]:
    losses, lrs, norms = [], [], []
    for k in range(start, stop):
        for micro in range(ACCUM):
            loss = loss_of(engine, k, micro)
            engine.backward(loss)
            losses.append(loss.item())
            if micro == ACCUM - 1:
                lrs.append(engine.get_lr()[0])
                assert engine.is_gradient_accumulation_boundary()
            else:
                assert not engine.is_gradient_accumulation_boundary()
            engine.step()
        norms.append(engine.get_global_grad_norm())
    return losses, lrs, norms


def test_the_article_config_equals_a_hand_written_deepspeed_loop_bit_for_bit(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="tieroffload"):
        engine, opt, loader, sched = tieroffload.initialize(
            model=gpt(), config=article_config(str(tmp_path)))
    assert loader is None and isinstance(sched, WarmupLR) and engine.optimizer is opt
    st = engine.module._tieroffload
    assert (st.policy.params, st.policy.optimizer, st.policy.activations) == (
        "nvme", "nvme", "cpu")
    assert "partition_activations" in caplog.text and "no-op" in caplog.text
    assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps()) == (MICRO * ACCUM, MICRO, ACCUM)
    want_losses, want_lrs, want_norms, want_sd = reference(STEPS)
    losses, lrs, norms = train(engine, 0, STEPS)
    assert losses == want_losses and lrs == want_lrs
    assert norms == want_norms  # DeepSpeed's fp32 norm, not torch's over bf16 (bf16-rounded)
    assert engine.global_steps == STEPS and all(n > 1.0 for n in norms)  # each step clipped
    sd = engine.module.state_dict()
    for k, v in want_sd.items():
        assert torch.equal(sd[k], v), k
    tieroffload.close(engine.module)


RESUME = """
import json, sys
sys.path.insert(0, {tests!r})
import test_initialize as t
import tieroffload
engine, *_ = tieroffload.initialize(model=t.gpt(), config=t.article_config({nvme!r}))
path, client = engine.load_checkpoint({ckpt!r})
losses, lrs, norms = t.train(engine, engine.global_steps, t.STEPS)
sd = engine.module.state_dict()
print(json.dumps({{"path": path, "client": client, "losses": losses, "lrs": lrs, "norms": norms,
                  "steps": engine.global_steps,
                  "digests": {{k: t.digest(v) for k, v in sd.items()}}}}))
"""


def test_a_checkpoint_resumed_in_a_new_process_continues_the_run_exactly(tmp_path):
    want_losses, want_lrs, want_norms, want_sd = reference(STEPS)
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    engine, *_ = tieroffload.initialize(model=gpt(), config=article_config(str(tmp_path / "a")))
    train(engine, 0, 2)
    assert engine.save_checkpoint(tmp_path / "ckpt", client_state={"epoch": 3}) is True
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step2"
    tieroffload.close(engine.module)
    script = RESUME.format(tests=str(ROOT / "tests"), nvme=str(tmp_path / "b"),
                           ckpt=str(tmp_path / "ckpt"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, cwd=str(tmp_path), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["path"] == str(tmp_path / "ckpt" / "global_step2")
    assert got["client"] == {"epoch": 3} and got["steps"] == STEPS
    assert got["losses"] == want_losses[2 * ACCUM:] and got["lrs"] == want_lrs[2:]
    assert got["norms"] == want_norms[2:]
    assert got["digests"] == {k: digest(v) for k, v in want_sd.items()}  # bit for bit


def schedule(cls, base_lr=1.0, opt_cls=torch.optim.AdamW, **params):
    opt = opt_cls([torch.nn.Parameter(torch.zeros(1))], lr=base_lr)
    sched = cls(opt, **params)
    lrs, betas = [opt.param_groups[0]["lr"]], [opt.param_groups[0].get("betas")]
    for _ in range(12):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        betas.append(opt.param_groups[0].get("betas"))
    return lrs, betas  # the lr at iterations -1, 0, ..., 11


def test_each_schedule_follows_deepspeed_s_formula():
    its = range(-1, 12)
    lin, _ = schedule(WarmupLR, warmup_min_lr=0.1, warmup_max_lr=1.0, warmup_num_steps=4,
                      warmup_type="linear")
    assert lin == pytest.approx([0.1] + [0.1 + 0.9 * min(i, 4) / 4 for i in its if i >= 0])
    log, _ = schedule(WarmupLR, base_lr=0.5, warmup_num_steps=4)  # max: the optimizer's lr
    assert log == pytest.approx([0.0] + [0.5 * min(1.0, math.log(i + 1) / math.log(4))
                                         for i in its if i >= 0])
    decay, _ = schedule(WarmupDecayLR, total_num_steps=10, warmup_max_lr=1.0,
                        warmup_num_steps=4, warmup_type="linear")
    assert decay == pytest.approx([0.0] + [i / 4 if i < 4 else max(0.0, (10 - i) / 6)
                                           for i in its if i >= 0])
    cos, _ = schedule(WarmupCosineLR, base_lr=2.0, total_num_steps=10, warmup_min_ratio=0.2,
                      warmup_num_steps=4, cos_min_ratio=0.1, warmup_type="linear")
    want = [0.0] + [2 * (0.2 + 0.8 * i / 4) if i < 4 else
                    2 * (0.1 + 0.9 * (1 + math.cos(math.pi * min(1, (i - 3) / 6))) / 2)
                    for i in its if i >= 0]
    assert cos == pytest.approx(want)
    one, betas = schedule(OneCycle, cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=4,
                          decay_lr_rate=0.5, decay_step_size=2)

    def tri(i):  # the share of the way up: 0 at j = 0, 1 at j = 4, 0 again at j = 8
        j = i + 1
        return j / 4 if j <= 4 else (8 - j) / 4

    assert one == pytest.approx([0.1 + 0.9 * tri(i) if i < 8 else 0.1 / (1 + 0.5 * (i - 7) / 2)
                                 for i in its])
    assert betas[0] == (0.8, 0.99)  # built: cycle_min_mom
    assert [b[0] for b in betas[1:]] == pytest.approx([0.9 - 0.1 * tri(i) if i < 8 else 0.9
                                                       for i in its if i >= 0])
    rng, _ = schedule(LRRangeTest, opt_cls=torch.optim.SGD, lr_range_test_min_lr=0.01,
                      lr_range_test_step_size=3, lr_range_test_step_rate=2.0)
    assert rng == pytest.approx([0.01 * (1 + 2 * (i + 1) / 3) for i in its])
    stairs, _ = schedule(LRRangeTest, opt_cls=torch.optim.SGD, lr_range_test_min_lr=0.01,
                         lr_range_test_step_size=3, lr_range_test_staircase=True)
    assert stairs == pytest.approx([0.01 * (1 + (i + 1) // 3) for i in its])


def test_the_fp16_loss_scale_follows_deepspeed_s_hysteresis_window_and_minimum():
    s = DeepSpeedLossScale(scale=8.0, window=2, min_scale=2.0, hysteresis=2, consecutive=False)
    seen = []
    for overflow in (True, True, False, False, False, True, True, True):
        s.update(overflow)
        seen.append(s.scale)
    # the first overflow uses up the hysteresis, the second halves; the third good step after
    # it is the window's second: doubled, hysteresis back; then one overflow is let pass and
    # each further one halves
    assert seen == [8, 4, 4, 4, 8, 8, 4, 2]
    with pytest.raises(FloatingPointError, match="minimum loss scale 2"):
        s.update(True)
    assert s.skipped == 5


def tiny(config: dict, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    cfg = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **config}
    return tieroffload.initialize(model=model, config=cfg, **kw)


@pytest.mark.parametrize("sizes, want", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, (32, 4, 8)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, (32, 16, 2)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, (8, 4, 2)),
    ({"train_batch_size": 6}, (6, 6, 1)),
    ({"train_micro_batch_size_per_gpu": 3}, (3, 3, 1)),
])
def test_any_two_batch_sizes_give_the_third(sizes, want):
    data = torch.utils.data.TensorDataset(torch.arange(40.0))
    engine, _, loader, _ = tiny(sizes, training_data=data)
    assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps()) == want
    assert len(next(iter(loader))[0]) == want[1]
    tieroffload.close(engine.module)


@pytest.mark.parametrize("sizes, words", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 2},
     "train_batch_size 32 != train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps 2"),
    ({"gradient_accumulation_steps": 2}, "neither train_batch_size nor"),
    ({"train_batch_size": 0}, "train_batch_size must be a whole number >= 1, not 0"),
    ({"train_batch_size": 2, "bf16": {"enabled": True}, "fp16": {"enabled": True}},
     "both true"),
    ({"train_batch_size": 2, "optimizer": {"type": "Lamb"}}, "optimizer.type 'Lamb'"),
    ({"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lrr": 1}}},
     "optimizer.params.lrr is not a setting of Adam"),
    ({"train_batch_size": 2, "scheduler": {"type": "Cyclic"}}, "scheduler.type 'Cyclic'"),
    ({"train_batch_size": 2, "zero_optimization": {"stage": 0, "offload_optimizer": {
        "device": "cpu"}}}, "offload_optimizer needs stage 1, 2 or 3, not stage 0"),
    ({"train_batch_size": 2, "zero_optimization": {"stage": 2, "offload_param": {
        "device": "nvme", "nvme_path": "."}}}, "offload_param needs stage 3, not stage 2"),
    ({"train_batch_size": 2, "scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 3}}},
     "scheduler WarmupLR: got an unexpected keyword argument 'warmup_steps'; it takes"),
])
def test_inconsistent_settings_are_refused_at_the_call_naming_them(sizes, words):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=words.replace("*", r"\*")):
        tieroffload.initialize(model=model, config={"optimizer": {"type": "SGD"}, **sizes})
    assert getattr(model, "_tieroffload", None) is None  # refused before anything changed


def test_unused_keys_are_warned_about_and_refused_when_strict(caplog):
    cfg = {"train_batch_size": 2, "flops_profiler": {"enabled": True},
           "bf16": {"enabled": False, "immediate_grad_update": True}}
    with caplog.at_level(logging.WARNING, logger="tieroffload"):
        engine, *_ = tiny(cfg)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("flops_profiler" in m and "bf16.immediate_grad_update" in m for m in warned)
    tieroffload.close(engine.module)
    with pytest.raises(ValueError, match=r"^DeepSpeed config key bf16\.immediate_grad_update "
                                         r"is not used .*strict=True"):
        tiny(cfg, strict=True)


def test_policy_from_deepspeed_warns_of_each_training_setting_and_names_initialize(caplog):
    keys = ["activation_checkpointing", "bf16", "fp16", "gradient_accumulation_steps",
            "gradient_clipping", "lr_scheduler", "optimizer", "train_micro_batch_size_per_gpu"]
    cfg = {k: {} if k in ("activation_checkpointing", "bf16", "fp16", "lr_scheduler",
                          "optimizer") else 1 for k in keys}
    with caplog.at_level(logging.WARNING, logger="tieroffload"):
        tieroffload.Policy.from_deepspeed({**cfg, "zero_optimization": {"stage": 3}})
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert all(k in warned for k in keys) and "tieroffload.initialize" in warned


def test_the_csv_monitor_section_writes_one_record_per_optimizer_step(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "run"}}
    engine, *_ = tiny(cfg)
    for _ in range(4):
        engine.backward(engine(torch.randn(2, 4)).square().mean())
        engine.step()
    engine.monitor.close()
    rows = (tmp_path / "run" / "run.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 and engine.global_steps == 2
    tieroffload.close(engine.module)


def test_an_engine_is_called_like_its_model(tmp_path):
    engine, *_ = tiny({"train_batch_size": 2})
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    x = torch.randn(3, 4)
    assert torch.equal(engine(x), plain(x))
    assert [n for n, _ in engine.named_parameters()][0].startswith("module.")
    tieroffload.close(engine.module)


def test_an_fp16_overflow_skips_the_step_and_the_schedule_and_halves_the_scale():
    cfg = {"train_batch_size": 2, "fp16": {"enabled": True, "initial_scale_power": 30,
                                           "hysteresis": 1, "loss_scale_window": 1000},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.01,
                                                        "warmup_max_lr": 0.1,
                                                        "warmup_num_steps": 10,
                                                        "warmup_type": "linear"}}}
    engine, opt, _, sched = tiny(cfg)
    assert next(engine.module.parameters()).dtype == torch.float16
    x = torch.randn(2, 4).half()
    scales, lrs = [], []
    while engine.skipped_steps == engine.global_steps:  # overflowing: nothing stepped yet
        before = [p.detach().clone() for p in engine.module.parameters()]
        engine.backward(engine(x).float().square().mean())
        engine.step()
        scales.append(opt.loss_scale)
        lrs.append(engine.get_lr()[0])
        if engine.skipped_steps == engine.global_steps:
            after = engine.module.parameters()
            assert all(torch.equal(a, b) for a, b in zip(before, after))
    skipped = engine.skipped_steps
    assert 0 < skipped < 30 and opt.skipped_steps == skipped
    assert scales == [2.0 ** (30 - i) for i in range(1, skipped + 1)] + [2.0 ** (30 - skipped)]
    assert lrs == [0.01] * skipped + [0.01]  # the first applied step: iteration 0, still min
    engine.backward(engine(x).float().square().mean())
    engine.step()
    assert engine.get_lr()[0] == pytest.approx(0.01 + 0.09 * 1 / 10)
    assert sched.last_batch_iteration == 1
    tieroffload.close(engine.module)


def fp16_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 10)).half()


def fp16_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 64, generator=g).half(), torch.randint(0, 10, (8,), generator=g)


@pytest.mark.parametrize("clip", [1.0, 1e9])
def test_fp16_clipping_is_deepspeed_s_over_the_unscaled_gradients_in_fp32(clip):
    """fp16 at the dynamic scale 2**16 with gradient_clipping: DeepSpeed unscales the fp16
    gradients into fp32, takes their norm there, clips and steps the fp32 masters; a
    plain-PyTorch loop doing that by hand gives the same losses, norms and weights, bit for
    bit (the scaled gradients' norm is past fp16's range: no step may see zero gradients)."""
    cfg = {"train_micro_batch_size_per_gpu": 8, "fp16": {"enabled": True},
           "gradient_clipping": clip,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}}
    engine, opt, *_ = tieroffload.initialize(model=fp16_mlp(), config=cfg)
    ref = fp16_mlp()
    masters = [torch.nn.Parameter(p.detach().float()) for p in ref.parameters()]
    opt_ref = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.0, fused=True)
    scale = 2.0**16
    x, y = fp16_batch(0)
    for step in range(5):
        loss_ref = F.cross_entropy(ref(x).float(), y)
        (loss_ref * scale).backward()
        for q, p in zip(masters, ref.parameters()):
            q.grad = p.grad.float().mul_(1.0 / scale)
            p.grad = None
        norm_ref = torch.nn.utils.clip_grad_norm_(masters, clip)
        opt_ref.step()
        with torch.no_grad():
            for q, p in zip(masters, ref.parameters()):
                p.copy_(q)
                q.grad = None
        loss = F.cross_entropy(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        assert loss.item() == loss_ref.item(), step
        assert engine.get_global_grad_norm() == norm_ref.item(), step
        # the first scaled gradients' norm is past fp16's range
        assert step or (norm_ref * scale > 65504 and norm_ref > 1)
    assert engine.skipped_steps == 0 and opt.loss_scale == scale
    assert loss.item() < 0.1  # it trained
    sd = engine.module.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(sd[k], v), k
    tieroffload.close(engine.module)


def test_bf16_clipping_is_deepspeed_s_in_fp32_over_the_bf16_gradients():
    """bf16 with gradient_clipping: DeepSpeed takes the norm of the bf16 gradients in fp32 and
    clips the fp32 masters' gradients; torch's clip over the bf16 gradients would return a
    bf16-rounded norm and clip in bf16. A loop doing DeepSpeed's by hand gives the same losses,
    norms (get_global_grad_norm) and weights, bit for bit."""
    cfg = {"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True},
           "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}}
    engine, *_ = tieroffload.initialize(model=fp16_mlp().bfloat16(), config=cfg)
    ref = fp16_mlp().bfloat16()
    masters = [torch.nn.Parameter(p.detach().float()) for p in ref.parameters()]
    opt_ref = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.0, fused=True)
    rounded = False
    for step in range(5):
        x, y = fp16_batch(step)
        loss_ref = F.cross_entropy(ref(x.bfloat16()).float(), y)
        loss_ref.backward()
        bf16_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
        for q, p in zip(masters, ref.parameters()):
            q.grad = p.grad.float()
            p.grad = None
        norm_ref = torch.nn.utils.clip_grad_norm_(masters, 1.0)
        opt_ref.step()
        with torch.no_grad():
            for q, p in zip(masters, ref.parameters()):
                p.copy_(q)
                q.grad = None
        loss = F.cross_entropy(engine(x.bfloat16()).float(), y)
        engine.backward(loss)
        engine.step()
        assert loss.item() == loss_ref.item(), step
        assert engine.get_global_grad_norm() == norm_ref.item(), step
        rounded = rounded or bf16_norm.item() != norm_ref.item()
    assert rounded  # torch's norm over the bf16 gradients differs
    sd = engine.module.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(sd[k], v), k
    tieroffload.close(engine.module)


def test_the_fp16_loss_scale_is_the_optimizer_s_one_scaler_and_resumes_exactly(tmp_path):
    """The DeepSpeed loss scale is the one object the optimizer steps and its state dicts
    and checkpoints save: a checkpoint resumes its scale and counters (window, hysteresis),
    and the run goes on as if uninterrupted, bit for bit. A state dict saved before the
    counters were (a plain LossScale's) still loads: its scale, the counters afresh."""
    cfg = {"train_micro_batch_size_per_gpu": 8,
           "fp16": {"enabled": True, "loss_scale_window": 2, "hysteresis": 2},
           "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}}

    def step(engine, i):
        x, y = fp16_batch(i)
        loss = F.cross_entropy(engine(x).float(), y) * (1e4 if i == 3 else 1)  # overflows
        engine.backward(loss)
        engine.step()
        return loss.item(), engine.optimizer.loss_scale

    a, oa, *_ = tieroffload.initialize(model=fp16_mlp(), config=cfg)
    assert oa.scaler is oa.states.scaler and isinstance(oa.scaler, DeepSpeedLossScale)
    for i in range(5):
        step(a, i)
    assert oa.loss_scale != 2.0**16 and oa.scaler.left != oa.scaler.hysteresis
    a.save_checkpoint(tmp_path / "ckpt")
    b, ob, *_ = tieroffload.initialize(model=fp16_mlp(), config=cfg)
    b.load_checkpoint(tmp_path / "ckpt")
    assert ob.scaler.state_dict() == oa.scaler.state_dict()
    assert [step(a, i) for i in range(5, 12)] == [step(b, i) for i in range(5, 12)]
    sb = b.module.state_dict()
    for k, v in a.module.state_dict().items():
        assert torch.equal(sb[k], v), k
    sd = ob.state_dict()
    sd["loss_scale"] = tieroffload.optim.LossScale(1024.0).state_dict()
    ob.load_state_dict(sd)
    assert ob.scaler is ob.states.scaler and ob.loss_scale == 1024.0
    assert (ob.scaler.iteration, ob.scaler.last_overflow, ob.scaler.left,
            ob.scaler.interval) == (0, -1, 2, 2)
    for e in (a, b):
        tieroffload.close(e.module)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_zero_stage_keeps_parameters_where_compute_runs_unless_stage_3_pages_them(
        stage, tmp_path):
    offload = {"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}} if stage else {}
    if stage == 3:
        offload["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    engine, *_ = tiny({"train_batch_size": 2, "zero_optimization": {"stage": stage, **offload}})
    policy = engine.module._tieroffload.policy
    compute = "gpu" if policy.compute_device().type == "cuda" else "cpu"
    assert policy.params == ("nvme" if stage == 3 else compute)
    assert policy.optimizer == ("nvme" if stage else compute)
    assert engine.plan.stage == stage
    tieroffload.close(engine.module)


def test_stage3_max_live_parameters_below_a_module_is_raised_to_its_need_as_deepspeed_does(
        tmp_path, caplog):
    """DeepSpeed fetches a module larger than ``stage3_max_live_parameters`` anyway: the
    budget it gives is raised to the smallest the model runs under, with a warning, and the
    run equals one under a budget that was large enough from the start."""
    def run(max_live: float, where: str) -> tuple[list[float], int]:
        (tmp_path / where).mkdir()
        config = deepspeed_article(str(tmp_path / where), lr=MAX_LR, max_live=max_live)
        engine, *_ = tieroffload.initialize(model=gpt(), config=config)
        losses = []
        for step in range(2 * ACCUM):
            x, y = token_batch(step, MICRO, SEQ, VOCAB)
            loss = F.cross_entropy(engine(x).flatten(0, 1).float(), y.flatten())
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        budget = tieroffload.stats(engine.module)["budget"]
        tieroffload.close(engine.module)
        return losses, budget

    with caplog.at_level(logging.WARNING, logger="tieroffload"):
        losses, budget = run(100, "small")
    assert "stage3_max_live_parameters gives cpu_budget=200 bytes" in caplog.text
    assert "budget is raised to" in caplog.text and budget > 200
    want, _ = run(budget / 2, "enough")  # 2 bytes an element
    assert losses == want

"""Specifications: a Hugging Face setup brought unchanged to an offloaded model: model.to and
the Trainer's and accelerate's calls of it, the Trainer (its own optimizer groups, scheduler,
clipping, accumulation, saves, a resume in a new process, report_to), accelerate's prepare and
backward, and PEFT's LoRA (get_peft_model, PeftModel.from_pretrained, merge_and_unload). Each
is compared, bit for bit, with the same code over the same model not offloaded, under a budget
smaller than the model, with the peak resident bytes under the budget throughout."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import TokenDataset
from torch import nn

import tieroffload
from tieroffload import Policy

transformers = pytest.importorskip("transformers")

VOCAB = 100
HERE = os.path.dirname(os.path.abspath(__file__))


def llama(seed=0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        attn_implementation="eager"))


def model_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def budget_of(model: nn.Module) -> int:
    """About twice the largest module's own parameters: a fraction of the model."""
    largest = max(sum(p.numel() * p.element_size() + 64 for p in m.parameters(recurse=False))
                  for m in model.modules())
    return 2 * largest


def offloaded(ref: nn.Module, tmp_path, **kw) -> nn.Module:
    """An offloaded deepcopy of ``ref`` on NVMe, under a budget smaller than it."""
    budget = budget_of(ref)
    assert budget < model_bytes(ref) / 2
    (tmp_path / "swap").mkdir(exist_ok=True)
    policy = Policy(params="nvme", nvme_dir=str(tmp_path / "swap"), device="cpu",
                    cpu_budget=budget, **kw)
    return tieroffload.offload(copy.deepcopy(ref), policy)


def tokens(seed=1, batch=2, seq=12):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


def params_written(model) -> int:
    return tieroffload.stats(model)["written_by_kind"]["nvme"]["params"]


def within_budget(model) -> bool:
    s = tieroffload.stats(model)
    return s["peak_resident"] <= s["budget"]


def same_params(ref, model):
    with tieroffload.materialize(model):
        for (n, a), b in zip(ref.named_parameters(), model.parameters()):
            assert torch.equal(a, b), n


# -- model.to / cpu() / float() ----------------------------------------------------------------

@pytest.mark.parametrize("move", [lambda m: m.to("cpu"), lambda m: m.cpu(),
                                  lambda m: m.to(torch.device("cpu")), lambda m: m.float(),
                                  lambda m: m.to("cpu", torch.float32)],
                         ids=["to_str", "cpu", "to_device", "float", "to_both"])
def test_to_the_device_it_computes_on_moves_nothing(move, tmp_path):
    ref = llama()
    model = offloaded(ref, tmp_path)
    ids = tokens()
    with torch.no_grad():
        model(ids)  # every unit has been in and gone
    written = params_written(model)
    assert move(model) is model
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    assert within_budget(model)
    assert params_written(model) == written, "an unchanged model was written to NVMe again"
    tieroffload.close(model)


def test_to_another_device_is_refused_with_the_fix(tmp_path):
    ref = llama()
    model = offloaded(ref, tmp_path)
    with pytest.raises(ValueError, match=r"from cpu to meta.*Policy\(device=\.\.\.\)"):
        model.to("meta")
    assert all(p.device.type == "cpu" for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(model(tokens()).logits, ref(tokens()).logits)
    tieroffload.close(model)


# -- load_weights(strict=False) ----------------------------------------------------------------

def test_load_weights_not_strict_returns_missing_and_unexpected_keys(tmp_path):
    ref = llama()
    model = offloaded(llama(1), tmp_path)
    sd = {k: v.clone() for k, v in ref.state_dict().items()}
    del sd["lm_head.weight"]
    sd["extra.weight"] = torch.zeros(3)
    want = llama(1).load_state_dict(sd, strict=False)
    got = tieroffload.load_weights(model, sd, strict=False)
    assert got.missing_keys == want.missing_keys == ["lm_head.weight"]
    assert got.unexpected_keys == want.unexpected_keys == ["extra.weight"]
    missing, unexpected = tieroffload.load_weights(model, ref.state_dict())
    assert missing == [] and unexpected == []
    tieroffload.close(model)


# -- the Hugging Face Trainer -------------------------------------------------------------------

class _Recording(transformers.Trainer):
    """Records every micro-batch's loss exactly (the logs average them)."""

    losses: list

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        self.losses.append(loss.detach().clone())
        return loss


def trainer_args(out_dir, report_to=(), **kw):
    return transformers.TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_grad_norm=0.5, max_steps=4, learning_rate=1e-2, weight_decay=0.1,
        lr_scheduler_type="linear", warmup_steps=1, logging_steps=1, report_to=list(report_to),
        use_cpu=True, save_strategy="steps", save_steps=2, seed=0, dataloader_num_workers=0,
        disable_tqdm=True, **kw)


def trainer(model, args, offload: bool):
    """The user's Trainer; with ``offload`` the one added argument."""
    opts = (tieroffload.hf.trainer_optimizer(model, args), None) if offload else (None, None)
    t = _Recording(model=model, args=args, train_dataset=TokenDataset(VOCAB), optimizers=opts)
    t.losses = []
    return t


def logged(t):
    return [(h.get("loss"), h.get("grad_norm"), h.get("learning_rate"))
            for h in t.state.log_history if "loss" in h]


def test_trainer_optimizer_keeps_the_trainers_decay_groups(tmp_path):
    ref = llama()
    model = offloaded(ref, tmp_path)
    args = trainer_args(tmp_path / "o")
    opt = tieroffload.hf.trainer_optimizer(model, args)
    want = transformers.Trainer(model=ref, args=args).create_optimizer()
    names = {id(p): n for n, p in model.named_parameters()}
    ref_names = {id(p): n for n, p in ref.named_parameters()}
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    for g, w in zip(opt.param_groups, want.param_groups):
        assert [names[id(p)] for p in g["params"]] == [ref_names[id(p)] for p in w["params"]]
        assert {k: v for k, v in g.items() if k != "params"} == \
            {k: v for k, v in w.items() if k != "params"}
    assert any("norm" in names[id(p)] for p in opt.param_groups[1]["params"])
    tieroffload.close(model)


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused", "sgd", "rmsprop"])
def test_trainer_optimizer_steps_as_the_trainers_own_optimizer(optim, tmp_path):
    """Each ``optim`` keeps the Trainer's kernel (``adamw_torch`` is torch's default AdamW,
    not the fused one): three steps give the weights the Trainer's own optimizer gives."""
    ref = llama()
    model = offloaded(ref, tmp_path)
    args = trainer_args(tmp_path / "o", optim=optim)
    opts = [tieroffload.hf.trainer_optimizer(model, args),
            transformers.Trainer(model=ref, args=args).create_optimizer()]
    x = tokens()
    for _ in range(3):
        for m, o in zip((model, ref), opts):
            m(input_ids=x, labels=x).loss.backward()
            o.step()
            o.zero_grad()
    same_params(ref, model)
    tieroffload.close(model)


def test_trainer_equals_the_plain_trainer_bit_for_bit(tmp_path):
    """The Trainer's groups, linear schedule with warm-up, clipping, accumulation, saves and
    tensorboard logs: losses, logged norms and learning rates and the weights equal, within
    the budget from Trainer(...) on."""
    ref = llama()
    model = offloaded(ref, tmp_path)
    t_ref = trainer(ref, trainer_args(tmp_path / "ref", ["tensorboard"]), offload=False)
    t_ref.train()
    written = params_written(model)
    t = trainer(model, trainer_args(tmp_path / "off", ["tensorboard"]), offload=True)
    assert within_budget(model) and params_written(model) == written, "Trainer(...) moved it"
    t.train()
    assert len(t_ref.losses) == 8 and len(t.losses) == 8
    for i, (a, b) in enumerate(zip(t_ref.losses, t.losses)):
        assert torch.equal(a, b), f"micro-batch {i}"
    assert logged(t) == logged(t_ref)
    assert any(n > 0.5 for _, n, _ in logged(t_ref)), "clipping acts"
    assert within_budget(model)  # materialize below brings it all in
    same_params(ref, model)
    assert (tmp_path / "off" / "checkpoint-2" / "optimizer.pt").exists()
    assert list((tmp_path / "off" / "runs").glob("*/events.out.tfevents.*"))
    tieroffload.close(model)


_RESUME = """
import json, pathlib, sys, torch
sys.path.insert(0, {here!r})
import test_integrations_hf as t
import tieroffload
model = t.offloaded(t.llama(5), pathlib.Path({tmp!r}))  # other values: all from the save
tr = t.trainer(model, t.trainer_args({out!r}), offload=True)
tr.train(resume_from_checkpoint={ckpt!r})
json.dump({{"losses": [x.item() for x in tr.losses], "logged": t.logged(tr),
           "within": t.within_budget(model)}}, open({res!r} + ".json", "w"))
with tieroffload.materialize(model):
    torch.save({{n: p.detach().clone() for n, p in model.named_parameters()}}, {res!r})
"""


def test_trainer_resumes_in_a_new_process_as_the_plain_trainer(tmp_path):
    ref = llama()
    model = offloaded(ref, tmp_path)
    trainer(ref, trainer_args(tmp_path / "ref"), offload=False).train()
    t = trainer(model, trainer_args(tmp_path / "off"), offload=True)
    t.train()
    tieroffload.close(model)
    resumed = llama(5)
    t_ref = trainer(resumed, trainer_args(tmp_path / "ref"), offload=False)
    t_ref.train(resume_from_checkpoint=str(tmp_path / "ref" / "checkpoint-2"))
    res = str(tmp_path / "result.pt")
    code = _RESUME.format(here=HERE, tmp=str(tmp_path / "new"), out=str(tmp_path / "off"),
                          ckpt=str(tmp_path / "off" / "checkpoint-2"), res=res)
    (tmp_path / "new").mkdir()
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300,
                   env={**os.environ, "PYTHONPATH": os.getcwd()})
    got = json.load(open(res + ".json"))
    assert got["within"]
    assert got["losses"] == [x.item() for x in t_ref.losses] and len(got["losses"]) == 4
    assert [list(x) for x in logged(t_ref)] == got["logged"]
    weights = torch.load(res)
    for n, p in resumed.named_parameters():
        assert torch.equal(weights[n], p), n


# -- accelerate -----------------------------------------------------------------------------------

def accelerate_run(model, opt, steps=4):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
    data = torch.utils.data.DataLoader(TokenDataset(VOCAB), batch_size=2)
    model, opt, data, sched = acc.prepare(model, opt, data, sched)
    losses = []
    for i, batch in enumerate(data):
        if i == 2 * steps:
            break
        with acc.accumulate(model):
            loss = model(**batch).loss
            acc.backward(loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def test_accelerator_prepare_moves_nothing(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    ref = llama()
    model = offloaded(ref, tmp_path)
    ids = tokens()
    with torch.no_grad():
        model(ids)
    written = params_written(model)
    assert accelerate.Accelerator(cpu=True).prepare(model) is model
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    assert within_budget(model) and params_written(model) == written
    tieroffload.close(model)


def test_accelerate_prepare_and_backward_equal_plain(tmp_path):
    ref = llama()
    model = offloaded(ref, tmp_path)
    kw = dict(lr=1e-2, weight_decay=0.1, fused=True)
    losses_ref = accelerate_run(ref, torch.optim.AdamW(ref.parameters(), **kw))
    written = params_written(model)
    losses = accelerate_run(model, tieroffload.optimizer(model, torch.optim.AdamW, **kw))
    assert len(losses) == 8
    for i, (a, b) in enumerate(zip(losses_ref, losses)):
        assert torch.equal(a, b), f"micro-batch {i}"
    assert within_budget(model) and params_written(model) > written
    same_params(ref, model)
    tieroffload.close(model)


# -- PEFT (LoRA) ----------------------------------------------------------------------------------

def lora(model):
    peft = pytest.importorskip("peft")
    torch.manual_seed(3)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return peft.get_peft_model(model, cfg)


def lora_train(pm, steps=3):
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    losses, written = [], []
    for step in range(steps):
        before = params_written(pm) if hasattr(pm, "_tieroffload") else 0
        ids = tokens(step)
        loss = pm(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
        written.append((params_written(pm) if hasattr(pm, "_tieroffload") else 0) - before)
    return losses, written


def test_lora_on_an_offloaded_model_trains_merges_and_saves_as_plain(tmp_path):
    peft = pytest.importorskip("peft")
    ref = llama()
    model = offloaded(ref, tmp_path)
    pm_ref, pm = lora(ref), lora(model)
    losses_ref, _ = lora_train(pm_ref)
    losses, written = lora_train(pm)
    for i, (a, b) in enumerate(zip(losses_ref, losses)):
        assert torch.equal(a, b), f"step {i}"
    assert written == [0, 0, 0], "the frozen base was written to NVMe"
    assert within_budget(model)
    pm_ref.save_pretrained(tmp_path / "a_ref")
    pm.save_pretrained(tmp_path / "a")
    from safetensors.torch import load_file
    a, b = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("a_ref", "a"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    merged_ref, merged = pm_ref.merge_and_unload(), pm.merge_and_unload()
    assert merged is model
    s = tieroffload.stats(model)
    assert all(u.pins == 0 for u in model._tieroffload.units), "merge left units pinned"
    assert s["resident"] <= s["budget"] and within_budget(model)
    ids = tokens(9)
    with torch.no_grad():
        for _ in range(2):  # the second reads the merged weights back from NVMe
            assert torch.equal(merged(ids).logits, merged_ref(ids).logits)
    out_ref = merged_ref.generate(ids[:1, :4], max_new_tokens=5, do_sample=False)
    assert torch.equal(merged.generate(ids[:1, :4], max_new_tokens=5, do_sample=False), out_ref)
    assert within_budget(model)
    same_params(merged_ref, merged)
    # the adapter loads onto a base tieroffload.from_pretrained streamed from shards
    ref.save_pretrained(tmp_path / "base", max_shard_size="20KB")
    base = tieroffload.from_pretrained(tmp_path / "base", Policy(
        params="nvme", nvme_dir=str(tmp_path / "swap"), device="cpu",
        cpu_budget=budget_of(ref)))
    written = params_written(base)
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "a")
    want = peft.PeftModel.from_pretrained(
        transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "a_ref")
    assert params_written(base) == written, "loading the adapter rewrote the base"
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want(ids).logits)
    assert within_budget(base)
    tieroffload.close(base)
    tieroffload.close(model)


def test_replacing_an_offloaded_layer_without_wrapping_it_is_refused(tmp_path):
    model = offloaded(llama(), tmp_path)
    attn = model.model.layers[0].self_attn
    with pytest.raises(ValueError, match=r"'q_proj'.*drop 1 offloaded.*wrap the layer"):
        attn.q_proj = nn.Linear(32, 32, bias=False)
    with pytest.raises(ValueError, match=r"'extra'.*brings 1 parameter.*wrap the layer"):
        attn.extra = nn.Linear(2, 2, bias=False)
    attn.act = nn.Identity()  # brings nothing, drops nothing
    tieroffload.close(model)


def test_modules_to_save_is_refused_naming_it(tmp_path):
    """PEFT's modules_to_save deep-copies the layers it names, which an offloaded model
    refuses: the error says so and how to go on."""
    peft = pytest.importorskip("peft")
    model = offloaded(llama(), tmp_path)
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    with pytest.raises(TypeError, match=r"modules_to_save copies the modules it names: train "
                                        r"them as part of the base"):
        peft.get_peft_model(model, cfg)
    tieroffload.close(model)


def test_trainer_with_lora_on_an_offloaded_base_equals_plain(tmp_path):
    """The adapters train under the Trainer with its own (plain) AdamW, which
    trainer_optimizer returns for them; the base is never written back."""
    ref = llama()
    model = offloaded(ref, tmp_path)
    pm_ref, pm = lora(ref), lora(model)
    args = trainer_args(tmp_path / "o")
    assert not getattr(tieroffload.hf.trainer_optimizer(pm, args), "_tieroffload_paged", False)
    t_ref = trainer(pm_ref, trainer_args(tmp_path / "ref"), offload=False)
    t_ref.train()
    written = params_written(model)
    t = trainer(pm, trainer_args(tmp_path / "off"), offload=True)
    t.train()
    assert params_written(model) == written, "the frozen base was written to NVMe"
    assert within_budget(model)
    for i, (a, b) in enumerate(zip(t_ref.losses, t.losses)):
        assert torch.equal(a, b), f"micro-batch {i}"
    assert logged(t) == logged(t_ref) and len(t.losses) == 8
    tieroffload.close(model)

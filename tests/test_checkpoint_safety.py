"""Checkpoints that touch only their own, and loads that are all or nothing (issue 37, items 2
to 5): save_checkpoint writes only where nothing is or a checkpoint is; a crafted or malformed
checkpoint is a CheckpointError naming the entry with the model and optimizer bit-identical to
before; a load replaces the optimizer's state as torch's load_state_dict does."""

from __future__ import annotations

import copy
import errno
import io
import json
import os
import re
import zlib

import pytest
import torch
from conftest import mounted
from helpers import assert_same, cached, optim_state_of, params_of, square_step
from models import TinyGPT, mlp
from test_faults import KW, THREADS, batch

import tieroffload
from tieroffload import CheckpointError, Policy

# -- helpers ----------------------------------------------------------------------------------


def tree(folder) -> dict[str, bytes | None]:
    """Every entry under ``folder``: a file's bytes, a directory as None, a link's target."""
    out: dict[str, bytes | str | None] = {}
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            p = os.path.join(root, d)
            out[os.path.relpath(p, folder)] = os.readlink(p) if os.path.islink(p) else None
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, folder)] = (os.readlink(p) if os.path.islink(p)
                                               else open(p, "rb").read())
    return out


def craft(path, manifest=None, extra=None) -> None:
    """Rewrites the checkpoint at ``path`` as a crafter would, keeping every checksum true:
    ``extra(saved)`` changes extra.pt's dict in place (its size and CRC are recomputed), then
    ``manifest(meta, data)`` changes the manifest in place (``data``: tensors.bin's bytes)."""
    mpath = os.path.join(path, "manifest.json")
    meta = json.loads(open(mpath).read())
    if extra is not None:
        saved = torch.load(os.path.join(path, "extra.pt"), weights_only=True)
        extra(saved)
        buf = io.BytesIO()
        torch.save(saved, buf)
        data = buf.getvalue()
        with open(os.path.join(path, "extra.pt"), "wb") as f:
            f.write(data)
        meta["extra"] = {"nbytes": len(data), "crc32": zlib.crc32(data)}
    if manifest is not None:
        manifest(meta, open(os.path.join(path, "tensors.bin"), "rb").read())
    with open(mpath, "w") as f:
        f.write(json.dumps(meta))


def as_scalar(meta, data, suffix: str) -> None:
    """Every ``.../<suffix>`` entry becomes a 0-dim tensor of its first element, its CRC
    recomputed: what fused AdamW would read past."""
    for e in meta["tensors"]:
        if e["key"].endswith("/" + suffix):
            n = torch.empty((), dtype=getattr(torch, e["dtype"])).element_size()
            e.update(shape=[], nbytes=n, crc32=zlib.crc32(data[e["offset"]:e["offset"] + n]))


def plain_pair():
    torch.manual_seed(0)
    model = TinyGPT()
    return model, torch.optim.AdamW(model.parameters(), **KW)


def paged_pair(tmp_path, tier: str):
    torch.manual_seed(0)
    kw = dict(nvme_dir=str(tmp_path / "swap"), io=THREADS) if tier == "nvme" else {}
    if tier == "nvme":
        (tmp_path / "swap").mkdir(exist_ok=True)
    model = tieroffload.offload(TinyGPT(), Policy(device="cpu", optimizer=tier, **kw))
    return model, tieroffload.optimizer(model, torch.optim.AdamW, **KW)


def pair(tmp_path, kind: str):
    return plain_pair() if kind == "plain" else paged_pair(tmp_path, kind)


def close(model, opt) -> None:
    if getattr(model, "_tieroffload", None) is not None:
        opt.close()
        tieroffload.close(model)


def loss_step(model, opt, step: int) -> float:
    return square_step(model, opt, batch(step))


def save_small(tmp_path, name="ckpt", extra=None):
    torch.manual_seed(0)
    model = mlp(width=16, depth=2)
    path = tmp_path / name
    tieroffload.save_checkpoint(path, model, extra=extra)
    return path, model


# -- item 2: save_checkpoint writes only where nothing is, or a checkpoint is ---------------


@pytest.mark.parametrize("path", ["", None, b""])
def test_save_checkpoint_refuses_an_empty_path(tmp_path, monkeypatch, path):
    (tmp_path / "train.py").write_text("print('mine')\n")
    monkeypatch.chdir(tmp_path)
    before = tree(tmp_path)
    with pytest.raises(CheckpointError, match="needs a path") as ei:
        tieroffload.save_checkpoint(path, mlp(width=16, depth=2))
    assert "\n" not in str(ei.value)
    assert tree(tmp_path) == before


@pytest.mark.parametrize("path", [".", "..", "sub/.."])
def test_save_checkpoint_refuses_the_working_directory(tmp_path, monkeypatch, path):
    project = tmp_path / "project"
    (project / "sub").mkdir(parents=True)
    (project / "train.py").write_text("print('mine')\n")
    monkeypatch.chdir(project)
    before = tree(tmp_path)
    with pytest.raises(CheckpointError, match="working directory") as ei:
        tieroffload.save_checkpoint(path, mlp(width=16, depth=2))
    assert "\n" not in str(ei.value)
    assert tree(tmp_path) == before


def test_save_checkpoint_refuses_a_folder_that_is_not_a_checkpoint(tmp_path):
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "train.py").write_text("print('mine')\n")
    (project / "data" / "x.bin").write_bytes(b"\x01\x02" * 100)
    before = tree(tmp_path)
    words = re.escape(f"{project} is a directory of 2 entries")
    with pytest.raises(CheckpointError, match=words) as ei:
        tieroffload.save_checkpoint(project, mlp(width=16, depth=2))
    assert "\n" not in str(ei.value)
    assert tree(tmp_path) == before  # and nothing beside it: no <path>.tmp-<pid>


def test_save_checkpoint_refuses_an_empty_directory(tmp_path):
    """Only a path that does not exist or a checkpoint: an empty folder (perhaps a mount
    point) is refused too, with nothing written."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="empty directory"):
        tieroffload.save_checkpoint(tmp_path / "empty", mlp(width=16, depth=2))
    assert tree(tmp_path) == {"empty": None}


def test_save_checkpoint_refuses_a_regular_file(tmp_path):
    (tmp_path / "notes.txt").write_bytes(b"my notes\n")
    with pytest.raises(CheckpointError, match="notes.txt is a file, not a checkpoint"):
        tieroffload.save_checkpoint(tmp_path / "notes.txt", mlp(width=16, depth=2))
    assert tree(tmp_path) == {"notes.txt": b"my notes\n"}


def test_save_checkpoint_refuses_a_foreign_manifest(tmp_path):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "manifest.json").write_text('{"format": "something else"}')
    before = tree(tmp_path)
    with pytest.raises(CheckpointError, match="manifest.json that is not a tieroffload"):
        tieroffload.save_checkpoint(tmp_path / "other", mlp(width=16, depth=2))
    assert tree(tmp_path) == before


@pytest.mark.parametrize("to", ["folder", "file", "nothing"])
def test_save_checkpoint_refuses_a_symlink_to_a_non_checkpoint(tmp_path, to):
    target = tmp_path / "target"
    if to == "folder":
        target.mkdir()
        (target / "train.py").write_text("print('mine')\n")
    elif to == "file":
        target.write_bytes(b"mine")
    os.symlink(target, tmp_path / "link")
    before = tree(tmp_path)
    with pytest.raises(CheckpointError, match=r"/target\b") as ei:
        tieroffload.save_checkpoint(tmp_path / "link", mlp(width=16, depth=2))
    assert "\n" not in str(ei.value)
    assert tree(tmp_path) == before


def test_replacing_a_checkpoint_with_a_file_of_the_users_in_it_is_refused(tmp_path):
    """A checkpoint folder holding something a save did not write is not emptied: the save is
    refused, naming the file, and the checkpoint and the file stay as they were."""
    path, model = save_small(tmp_path, extra={"v": 1})
    (path / "notes.txt").write_text("results of run 7\n")
    before = tree(tmp_path)
    with pytest.raises(CheckpointError, match="holds 'notes.txt'.*move it out"):
        tieroffload.save_checkpoint(path, model, extra={"v": 2})
    assert tree(tmp_path) == before
    assert tieroffload.load_checkpoint(path, model) == {"v": 1}


def test_save_over_a_symlink_to_a_checkpoint_replaces_the_checkpoint_and_keeps_the_link(
        tmp_path):
    """``latest -> step-1``: the checkpoint the link names is replaced, the link stays, and
    nothing is left beside either (no ``latest.tmp-<pid>``)."""
    path, model = save_small(tmp_path, "step-1", extra={"v": 1})
    os.symlink("step-1", tmp_path / "latest")
    tieroffload.save_checkpoint(tmp_path / "latest", model, extra={"v": 2})
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-1"]
    assert os.readlink(tmp_path / "latest") == "step-1"
    assert sorted(os.listdir(path)) == ["extra.pt", "manifest.json", "tensors.bin"]
    assert tieroffload.load_checkpoint(tmp_path / "latest", model) == {"v": 2}


def test_replacing_a_checkpoint_leaves_only_the_new_one(tmp_path):
    path, model = save_small(tmp_path, extra={"v": 1})
    tieroffload.save_checkpoint(path, model, extra={"v": 2})
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert tieroffload.load_checkpoint(path, model) == {"v": 2}


def test_a_full_disk_during_save_names_the_path_and_keeps_the_previous(tmp_path):
    torch.manual_seed(0)
    model = mlp(width=256, depth=4)  # ~1.05 MB of fp32: one checkpoint fits, two do not
    with mounted("tmpfs", "size=1600k") as where:
        path = os.path.join(where, "ckpt")
        tieroffload.save_checkpoint(path, model, extra={"step": 1})
        with pytest.raises(OSError) as ei:
            tieroffload.save_checkpoint(path, model, extra={"step": 2})
        assert ei.value.errno == errno.ENOSPC
        assert path in str(ei.value) and "\n" not in str(ei.value)
        assert os.listdir(where) == ["ckpt"]
        assert tieroffload.load_checkpoint(path, model) == {"step": 1}


# -- item 3: crafted optimizer state ----------------------------------------------------------


def assert_refused(tmp_path, kind, damage, words, trained=True):
    """Saves a checkpoint of ``kind`` after a step, trains on, applies ``damage`` (a ``craft``
    call), and checks that loading is a one-line CheckpointError matching ``words`` with the
    model and optimizer bit-identical to before; then that training still runs."""
    model, opt = pair(tmp_path, kind)
    if trained:
        loss_step(model, opt, 0)
    path = tmp_path / "ckpt"
    tieroffload.save_checkpoint(path, model, opt)
    loss_step(model, opt, 1)  # the model and state now differ from the checkpoint
    damage(path)
    p_before, o_before = params_of(model), optim_state_of(opt)
    with pytest.raises(CheckpointError, match=words) as ei:
        tieroffload.load_checkpoint(path, model, opt)
    assert "\n" not in str(ei.value)
    assert_same(p_before, params_of(model), "parameters after a refused load")
    assert_same(o_before, optim_state_of(opt), "optimizer state after a refused load")
    assert torch.isfinite(torch.tensor(loss_step(model, opt, 2)))
    close(model, opt)


@pytest.mark.parametrize("kind", ["plain", "cpu", "nvme"])
def test_an_exp_avg_stored_as_a_scalar_is_refused_before_anything_changes(tmp_path, kind):
    """Every exp_avg as a 0-dim tensor, CRCs recomputed: fused AdamW would read past it."""
    assert_refused(tmp_path, kind, lambda p: craft(p, manifest=lambda m, d: as_scalar(
        m, d, "exp_avg")), r"optim/\d+/exp_avg is float32\[\]; this optimizer keeps float32\[")


def rename(old: str, new: str):
    def change(meta, data):
        for e in meta["tensors"]:
            if e["key"].endswith("/" + old):
                e["key"] = e["key"][:-len(old)] + new
    return change


def drop(name: str):
    def change(meta, data):
        meta["tensors"] = [e for e in meta["tensors"] if not e["key"].endswith("/" + name)]
    return change


@pytest.mark.parametrize("kind", ["plain", "cpu"])
@pytest.mark.parametrize("damage,words", [
    (rename("exp_avg_sq", "exp_avg_sqq"), "exp_avg_sqq: AdamW keeps no such state"),
    (rename("exp_avg_sq", "max_exp_avg_sq"), "max_exp_avg_sq: AdamW keeps no such state"),
    (drop("exp_avg_sq"), r"has \['exp_avg', 'step'\]; AdamW keeps"),
    (lambda m, d: as_scalar(m, d, "step") or [e.update(dtype="int32", nbytes=4)
                                              for e in m["tensors"]
                                              if e["key"].endswith("/step")],
     "step is int32"),
], ids=["renamed", "amsgrad-name", "missing", "step-int32"])
def test_state_names_and_kinds_the_optimizer_does_not_keep_are_refused(tmp_path, kind, damage,
                                                                       words):
    assert_refused(tmp_path, kind, lambda p: craft(p, manifest=damage), words)


def test_paged_load_state_dict_refuses_a_renamed_state_entry(tmp_path):
    model, opt = paged_pair(tmp_path, "cpu")
    loss_step(model, opt, 0)
    sd = opt.state_dict()
    st = sd["state"][0]
    st["exp_avg_2"] = st.pop("exp_avg_sq")
    loss_step(model, opt, 1)
    before = optim_state_of(opt)
    with pytest.raises(ValueError, match=r"state\[0\]\['exp_avg_2'\]: AdamW keeps no such"):
        opt.load_state_dict(sd)
    assert_same(before, optim_state_of(opt), "optimizer state after a refused load")
    close(model, opt)


def test_sgd_state_names_are_checked(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_step(model, opt, 0)
    path = tmp_path / "ckpt"
    tieroffload.save_checkpoint(path, model, opt)
    assert tieroffload.load_checkpoint(path, model, opt) is None
    craft(path, manifest=rename("momentum_buffer", "exp_avg"))
    before = params_of(model), optim_state_of(opt)
    with pytest.raises(CheckpointError, match="exp_avg: SGD keeps no such state"):
        tieroffload.load_checkpoint(path, model, opt)
    assert_same(before[0], params_of(model), "parameters")
    assert_same(before[1], optim_state_of(opt), "optimizer state")


# -- item 4: a load resets what torch's load_state_dict resets ---------------------------------


@cached
def torch_losses(steps: range, kind: str) -> list[float]:
    """A fresh plain torch run; fused AdamW where the paged optimizer uses it (its default).
    Computed once per (steps, kind)."""
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), **KW, fused=kind != "plain")
    return [loss_step(model, opt, s) for s in steps]


@pytest.mark.parametrize("kind", ["plain", "cpu", "nvme"])
def test_loading_a_checkpoint_from_before_the_first_step_resets_state_as_torch_does(
        tmp_path, kind):
    """Saved before any step (no state), loaded into an optimizer that has state: the next
    steps start from step 0 with fresh moments, as in a fresh torch run, bit for bit."""
    model, opt = pair(tmp_path, kind)
    path = tmp_path / "ckpt"
    tieroffload.save_checkpoint(path, model, opt)
    for s in range(3):
        loss_step(model, opt, 100 + s)
    tieroffload.load_checkpoint(path, model, opt)
    assert opt.state_dict()["state"] == {}
    got = [loss_step(model, opt, s) for s in range(4)]
    assert got == torch_losses(range(4), kind)
    close(model, opt)


def test_paged_load_state_dict_without_state_resets_as_torch_does(tmp_path):
    model, opt = paged_pair(tmp_path, "cpu")
    initial = params_of(model)
    sd = copy.deepcopy(opt.state_dict())  # before the first step: no state
    for s in range(3):
        loss_step(model, opt, 100 + s)
    with torch.no_grad(), tieroffload.materialize(model):
        for n, p in model.named_parameters():
            p.copy_(initial[n])
    opt.load_state_dict(sd)
    assert opt.state_dict()["state"] == {}
    got = [loss_step(model, opt, s) for s in range(4)]
    assert got == torch_losses(range(4), "cpu")
    close(model, opt)


# -- item 5: all-or-nothing loads of malformed checkpoints -----------------------------------


def groups(**change):
    def apply(saved):
        for g in saved["param_groups"]:
            for k, v in change.items():
                if v is KeyError:
                    del g[k]
                else:
                    g[k] = v
    return apply


def pop(key):
    return lambda saved: saved.pop(key)


def set_manifest(**change):
    def apply(meta, data):
        for k, v in change.items():
            if v is KeyError:
                del meta[k]
            else:
                meta[k] = v
    return apply


def first_entry(**change):
    def apply(meta, data):
        meta["tensors"][0].update(change)
    return apply


MALFORMED = {
    # extra.pt
    "extra.pt-no-scalars": (dict(extra=pop("scalars")), "extra.pt holds"),
    "extra.pt-no-extra": (dict(extra=pop("extra")), "extra.pt holds"),
    "extra.pt-no-param_groups": (dict(extra=pop("param_groups")), "extra.pt holds"),
    "extra.pt-a-list": (dict(extra=lambda s: (s.clear(), s.update(x=1))), "extra.pt holds"),
    "scalars-a-list": (dict(extra=lambda s: s.update(scalars=[1])), "scalars is a list"),
    "scalar-key-dotdot": (dict(extra=lambda s: s["scalars"].update({"optim/0/../x": 1.0})),
                          "scalar 'optim/0/../x' is not"),
    "scalar-a-tensor-name": (dict(extra=lambda s: s["scalars"].update({"optim/0/exp_avg": 1.0})),
                             "optim/0/exp_avg is both"),
    "param_groups-a-dict": (dict(extra=lambda s: s.update(param_groups={})),
                            "param_groups is a dict"),
    "lr-None": (dict(extra=groups(lr=None)), r"\['lr'\] is None"),
    "lr-a-string": (dict(extra=groups(lr="3e-3")), r"\['lr'\] is '3e-3'"),
    "lr-negative": (dict(extra=groups(lr=-1.0)), "refused by AdamW: Invalid learning rate"),
    "lr-nan": (dict(extra=groups(lr=float("nan"))), r"\['lr'\] is nan"),
    "betas-one": (dict(extra=groups(betas=(0.9,))), r"\['betas'\] is \(0.9,\)"),
    "betas-strings": (dict(extra=groups(betas=("a", "b"))), r"\['betas'\]"),
    "beta-too-large": (dict(extra=groups(betas=(0.9, 1.5))), "Invalid beta parameter"),
    "eps-None": (dict(extra=groups(eps=None)), r"\['eps'\] is None"),
    "amsgrad-a-string": (dict(extra=groups(amsgrad="yes")), r"\['amsgrad'\] is 'yes'"),
    "no-weight_decay": (dict(extra=groups(weight_decay=KeyError)), "has no 'weight_decay'"),
    "extra-key-an-object": (dict(extra=groups(hook=torch.zeros(2))), r"\['hook'\] is Tensor"),
    "params-reordered": (dict(extra=lambda s: s["param_groups"][0]["params"].reverse()),
                         r"\['params'\] is not \[0, "),
    # manifest.json
    "optim-key-dotdot": (dict(manifest=lambda m, d: m["tensors"][-1].update(
        key="optim/0/../exp_avg")), "no key of the form"),
    "unknown-key-kind": (dict(manifest=first_entry(key="weights/x")), "no key of the form"),
    "unexpected-param": (dict(manifest=lambda m, d: m["tensors"].append(
        dict(m["tensors"][0], key="param/zzz"))), "holds 'param/zzz', which the model has not"),
    "unexpected-buffer-dotdot": (dict(manifest=lambda m, d: m["tensors"].append(
        dict(m["tensors"][0], key="buffer/a/../../b"))), "holds 'buffer/a/../../b'"),
    "no-tensors": (dict(manifest=set_manifest(tensors=KeyError)), "'tensors' is NoneType"),
    "tensors-a-dict": (dict(manifest=set_manifest(tensors={})), "'tensors' is dict"),
    "no-size": (dict(manifest=set_manifest(size=KeyError)), "'size' is None"),
    "size-a-string": (dict(manifest=set_manifest(size="12")), "'size' is '12'"),
    "extra-a-list": (dict(manifest=set_manifest(extra=[1, 2])), "'extra' is"),
    "extra-no-crc": (dict(manifest=lambda m, d: m["extra"].pop("crc32")), "'extra' is"),
    "version-a-string": (dict(manifest=set_manifest(version="1")), "is not a tieroffload"),
    "manifest-empty": (dict(manifest=lambda m, d: m.clear()), "is not a tieroffload"),
    "entry-a-list": (dict(manifest=lambda m, d: m["tensors"].append([1])), "no key of the"),
    "shape-a-string": (dict(manifest=first_entry(shape="12")), "is malformed"),
    "shape-bool": (dict(manifest=first_entry(shape=[True])), "is malformed"),
    "dtype-a-list": (dict(manifest=first_entry(dtype=["float32"])), "has dtype"),
    "crc-a-float": (dict(manifest=first_entry(crc32=1.5)), "is malformed"),
    "world_size-a-string": (dict(manifest=lambda m, d: m.update(world_size="2", ranks=[dict(m)])),
                            "world_size '2'"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_checkpoint_is_a_checkpoint_error_that_changes_nothing(tmp_path, case):
    """Each crafted case keeps its checksums true; the load raises CheckpointError (never a
    KeyError, TypeError or plain ValueError) naming the entry, with the model and the paged
    optimizer's state bit-identical to before."""
    change, words = MALFORMED[case]
    assert_refused(tmp_path, "cpu", lambda p: craft(p, **change), words)


@pytest.mark.parametrize("case", ["extra.pt-no-scalars", "lr-a-string", "scalar-key-dotdot",
                                  "optim-key-dotdot"])
def test_a_malformed_checkpoint_changes_nothing_of_a_plain_optimizer(tmp_path, case):
    change, words = MALFORMED[case]
    assert_refused(tmp_path, "plain", lambda p: craft(p, **change), words)


def test_a_valid_crafted_rewrite_still_loads(tmp_path):
    """The helper itself: rewriting extra.pt and the manifest unchanged keeps a checkpoint
    that loads, so each refusal above is the damage's."""
    model, opt = plain_pair()
    loss_step(model, opt, 0)
    path = tmp_path / "ckpt"
    tieroffload.save_checkpoint(path, model, opt, extra={"v": 1})
    craft(path, manifest=lambda m, d: None, extra=lambda s: None)
    assert tieroffload.load_checkpoint(path, model, opt) == {"v": 1}


def test_a_link_planted_at_the_temporary_name_is_not_followed(tmp_path):
    """``<path>.tmp-<pid>`` is cleared before a save writes there: a symbolic link planted at
    that name to someone's folder leaves that folder's files (even ones named like a
    checkpoint's) alone, and the save fails naming the link."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "manifest.json").write_text("theirs\n")
    path = tmp_path / "ckpt"
    os.symlink(victim, f"{path}.tmp-{os.getpid()}")
    before = tree(victim)
    with pytest.raises(OSError, match=re.escape(f"{path}.tmp-{os.getpid()}")):
        tieroffload.save_checkpoint(path, mlp(width=16, depth=2))
    assert tree(victim) == before


@pytest.mark.parametrize("opt_cls,kw", [(torch.optim.RMSprop, dict(momentum=0.9)),
                                        (torch.optim.Adagrad, {})], ids=["RMSprop", "Adagrad"])
def test_a_class_without_a_known_state_layout_still_round_trips(tmp_path, opt_cls, kw):
    """Other optimizer classes: their state is checked for shape, dtype and safe names only,
    and a checkpoint of theirs resumes exactly."""
    def run(load: bool) -> list[float]:
        torch.manual_seed(0)
        model = TinyGPT()
        opt = opt_cls(model.parameters(), lr=1e-2, **kw)
        loss_step(model, opt, 0)
        if load:
            tieroffload.save_checkpoint(tmp_path / "ckpt", model, opt)
            torch.manual_seed(1)
            model = TinyGPT()
            opt = opt_cls(model.parameters(), lr=1e-2, **kw)
            tieroffload.load_checkpoint(tmp_path / "ckpt", model, opt)
        return [loss_step(model, opt, s) for s in range(1, 4)]
    assert run(load=True) == run(load=False)


@pytest.mark.parametrize("name", ["ckpt.old-20261207", "ckpt.tmp-4000000"])
def test_a_backup_named_like_a_leftover_is_never_touched(tmp_path, name):
    """A copy of a checkpoint the user keeps beside it under a name like a save's leftover
    (``ckpt.old-<date>``) is the user's: loads and saves neither empty it nor put it in place."""
    import shutil

    model = torch.nn.Linear(4, 4)
    path = tmp_path / "ckpt"
    tieroffload.save_checkpoint(path, model)
    backup = tmp_path / name
    shutil.copytree(path, backup)
    (backup / "NOTES.txt").write_text("mine")
    before = tree(backup)
    tieroffload.load_checkpoint(path, model)  # a load looks for leftovers
    tieroffload.save_checkpoint(path, model)  # and so does a save that replaces
    shutil.rmtree(path)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        tieroffload.load_checkpoint(path, model)  # path missing: the backup is not put back
    tieroffload.save_checkpoint(path, model)  # a new checkpoint beside the backup
    assert tree(backup) == before


class _NotAllowed:
    """A type torch.load(weights_only=True) refuses to build."""


def test_extra_that_torch_will_not_load_is_refused_naming_the_type_in_plain_text(tmp_path):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(CheckpointError) as e:
        tieroffload.save_checkpoint(tmp_path / "ckpt", model, extra={"o": _NotAllowed()})
    msg = str(e.value)
    assert "\n" not in msg and "\x1b" not in msg and "_NotAllowed" in msg, msg
    assert not (tmp_path / "ckpt").exists() and os.listdir(tmp_path) == []


def test_a_data_file_longer_than_its_manifest_is_not_called_truncated(tmp_path):
    model = torch.nn.Linear(4, 4)
    path = tmp_path / "ckpt"
    tieroffload.save_checkpoint(path, model)
    with open(path / "tensors.bin", "ab") as f:
        f.write(b"\0" * 16)
    with pytest.raises(CheckpointError, match="is longer than its manifest says"):
        tieroffload.load_checkpoint(path, model)

"""``import tieroffload`` changes nothing in torch: its patches (the clip functions,
``Optimizer.zero_grad``, torch's process-wide module, parameter and optimizer-step hooks, and
accelerate's clip where gradients are paged) are put in place by the first ``offload`` and
taken away by the last ``close``, which restores the very objects they replaced."""

from __future__ import annotations

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent

CHILD = """
import importlib.util
import sys
sys.path.insert(0, sys.argv[1])
import torch
import torch.nn.modules.module as mm
import torch.optim.optimizer as oo

HAS_ACCELERATE = importlib.util.find_spec("accelerate") is not None
if HAS_ACCELERATE:
    from accelerate import Accelerator


def snapshot():
    clip = {}
    for m in (torch.nn.utils, torch.nn.utils.clip_grad):
        for name in ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_"):
            clip[m.__name__, name] = m.__dict__.get(name)
    return {
        "clip": clip,
        "zero_grad": torch.optim.Optimizer.__dict__["zero_grad"],
        "module hooks": dict(mm._global_module_registration_hooks),
        "parameter hooks": dict(mm._global_parameter_registration_hooks),
        "step pre hooks": dict(oo._global_optimizer_pre_hooks),
        "step post hooks": dict(oo._global_optimizer_post_hooks),
        "accelerate": Accelerator.__dict__["clip_grad_norm_"] if HAS_ACCELERATE else None,
    }


def same(a, b):
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            if x.keys() != y.keys() or any(x[i] is not y[i] for i in x):
                return False
        elif x is not y:
            return False
    return True


def changed(a, b):
    return sorted(k for k in a if not same({k: a[k]}, {k: b[k]}))


before = snapshot()
import tieroffload
assert tieroffload.__file__.startswith(sys.argv[1]), tieroffload.__file__
assert same(snapshot(), before), changed(snapshot(), before)

nvme = sys.argv[2]
torch.manual_seed(0)
a = tieroffload.offload(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)),
                        tieroffload.Policy(params="nvme", nvme_dir=nvme, device="cpu"))
opened = snapshot()
expect = ["clip", "module hooks", "parameter hooks", "step post hooks", "step pre hooks",
          "zero_grad"]
assert changed(opened, before) == expect, changed(opened, before)
assert torch.nn.utils.clip_grad_norm_ is tieroffload.optim.clip.clip_grad_norm_

b = tieroffload.offload(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)),
                        tieroffload.Policy(params="nvme", grads="nvme", nvme_dir=nvme,
                                           device="cpu"))
both = snapshot()
assert changed(both, opened) == (["accelerate"] if HAS_ACCELERATE else []), changed(both, opened)
tieroffload.close(b)  # the model whose gradients are paged: accelerate's clip is restored
assert same(snapshot(), opened), changed(snapshot(), opened)
tieroffload.close(a)  # the last one
assert same(snapshot(), before), changed(snapshot(), before)

c = tieroffload.offload(torch.nn.Linear(8, 8), tieroffload.Policy(params="cpu", device="cpu"))
assert changed(snapshot(), before) == expect
tieroffload.close(c)
assert same(snapshot(), before), changed(snapshot(), before)

d = tieroffload.offload(torch.nn.Linear(8, 8), tieroffload.Policy(params="cpu", device="cpu"))
assert changed(snapshot(), before) == expect
del d  # dropped without close
import gc
gc.collect()
assert same(snapshot(), before), changed(snapshot(), before)
print("ok")
"""


def test_import_patches_nothing_and_last_close_restores_torch(tmp_path):
    out = subprocess.run([sys.executable, "-c", CHILD, str(REPO), str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]

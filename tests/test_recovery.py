"""A way out after every failure: a refused hyperparameter, a checksum error, a torn step;
and offload's one-line errors for a wrong argument or a model offloaded twice over.

Each case is compared bit for bit with a run that never met the failure (or, for a plain torch
optimizer, with plain PyTorch meeting the same one), and ends with ``close()`` releasing
everything. Helpers come from helpers.py and test_faults.py.
"""

import contextlib
import copy
import gc
import os
import threading

import pytest
import torch
from helpers import assert_same, optim_state_of, params_of
from models import TinyGPT
from test_faults import KW, batch, nvme_policy, overlap_pair_with_checkpoint, run_faulty, train_step
from test_faults import shim as shim  # noqa: F401 - the fault shim's fixture, used by name

import tieroffload


def loss_of(model, step: int) -> torch.Tensor:
    return model(batch(step)).float().square().mean()


def open_fds() -> int:
    """Descriptors open now, after collecting garbage: an earlier test's unreachable model
    must not close its files in the middle of a count."""
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


def train_on_and_close(model, opt, steps) -> tuple[dict, dict]:
    """(parameters, optimizer state) after ``steps`` more training steps; both closed."""
    for s in steps:
        train_step(model, opt, s)
    out = params_of(model), optim_state_of(opt)
    opt.close()
    tieroffload.close(model)
    return out


def assert_same_runs(runs: dict) -> None:
    assert_same(runs["clean"][0], runs["bad"][0], "parameters")
    assert_same(runs["clean"][1], runs["bad"][1], "optimizer state")


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
        runs[name] = train_on_and_close(model, opt, (2, 3))
    assert_same_runs(runs)


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
            with pytest.raises(TypeError, match="refuses lr=None.*zero_grad.*forward and "
                               "backward again"):
                loss_of(model, 1).backward()
            assert not opt.stepped_in_backward
            opt.param_groups[0]["lr"] = KW["lr"]
        runs[name] = train_on_and_close(model, opt, (1, 2))
    assert_same_runs(runs)


@pytest.mark.parametrize("opt_cls, kw", [(torch.optim.Adagrad, {}),
                                         (torch.optim.SGD, dict(momentum=0.9))])
def test_the_hyperparameter_check_leaves_other_classes_as_pytorch(opt_cls, kw):
    """The check at step() probes with the optimizer's own class, whose constructor may make
    state (Adagrad's sum): good values step as plain PyTorch, lr=None is refused."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model = tieroffload.offload(copy.deepcopy(ref), tieroffload.Policy(params="cpu",
                                                                       device="cpu"))
    opt_ref = opt_cls(ref.parameters(), lr=0.1, **kw)
    opt = tieroffload.optimizer(model, opt_cls, lr=0.1, **kw)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    for step in range(3):
        for m, o in ((ref, opt_ref), (model, opt)):
            o.zero_grad()
            m(x * step).square().sum().backward()
            if step == 2 and o is opt:
                o.param_groups[0]["lr"] = None
                with pytest.raises(TypeError, match="refuses lr=None"):
                    o.step()
                o.param_groups[0]["lr"] = 0.1
            o.step()
    assert_same(params_of(ref), params_of(model), "parameters")
    opt.close()
    tieroffload.close(model)


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


def test_the_first_load_after_a_torn_backward_step_is_honoured(tmp_path):
    """A backward with overlap="backward" that raises after chunks stepped, then at once
    load_checkpoint (no forward or step() between to notice the torn step): the load clears
    it, and training then equals plain PyTorch resumed from the checkpoint."""
    ref, opt_ref, model, opt = overlap_pair_with_checkpoint(tmp_path)

    def fail(module, grad_in, grad_out):
        raise RuntimeError("injected failure in backward")

    handle = model.blocks[0].register_full_backward_hook(fail)  # after later chunks step
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="injected"):
        loss_of(model, 1).backward()
    handle.remove()
    tieroffload.load_checkpoint(tmp_path / "ckpt", model, opt)
    for step in (1, 2):
        for m, o in ((ref, opt_ref), (model, opt)):
            train_step(m, o, step)
    assert_same(params_of(ref), params_of(model), "parameters after the resumed steps")
    assert_same(optim_state_of(opt_ref), optim_state_of(opt), "optimizer state")
    opt.close()
    tieroffload.close(model)


def _spoil(unit) -> str:
    """Flips one byte of ``unit``'s extent in its swap file; returns the file's path."""
    path = unit.home.swap.path
    with open(path, "r+b") as f:
        f.seek(unit.home.offset + 100)
        b = f.read(1)
        f.seek(unit.home.offset + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    return path


def _checksum_failure(tmp_path, where: str):
    """(clean model, its optimizer, model, optimizer, the unit): both trained 2 steps, the
    second model checkpointed to tmp_path/ckpt, then one byte of a unit (``where``: a
    parameter unit or an optimizer chunk's state) that is away spoiled and met by a step."""
    torch.manual_seed(0)
    ref = TinyGPT()
    pairs = []
    for name in ("clean", "spoilt"):
        (tmp_path / name).mkdir()
        model = tieroffload.offload(copy.deepcopy(ref), nvme_policy(
            tmp_path / name, checksum=True, optimizer="nvme"))
        pairs.append((model, tieroffload.optimizer(model, torch.optim.AdamW, **KW)))
    for s in range(2):
        for m, o in pairs:
            train_step(m, o, s)
    model, opt = pairs[1]
    tieroffload.save_checkpoint(tmp_path / "ckpt", model, opt)
    model(batch(9))  # the deferred updates applied: every chunk's state has gone out
    unit = (opt.chunks[0].state_unit if where == "optimizer" else
            next(u for u in model._tieroffload.units if u.home is not None
                 and u.state.name == "AWAY"))
    _spoil(unit)
    with pytest.raises(OSError, match="checksum mismatch"):
        for s in (2, 3):
            train_step(model, opt, s)
    return (*pairs[0], model, opt, unit)


@pytest.mark.parametrize("where", ["params", "optimizer"])
def test_close_after_a_checksum_error_releases_everything_and_raises_it_once(tmp_path, where):
    """After a checksum error, close() raises it once (the restore cannot read the spoilt
    unit) and still removes the swap file, its descriptors and its threads."""
    fds, threads = open_fds(), threading.active_count()
    clean, clean_opt, model, opt, unit = _checksum_failure(tmp_path, where)
    path = unit.home.swap.path
    clean_opt.close()
    tieroffload.close(clean)
    with pytest.raises(OSError, match="checksum mismatch"):
        tieroffload.close(model)
    assert not os.path.exists(path)
    with pytest.raises(ValueError, match="not offloaded"):  # closed: nothing raises twice
        tieroffload.close(model)
    opt.close()
    assert open_fds() == fds and threading.active_count() == threads


@pytest.mark.parametrize("where", ["params", "optimizer"])
def test_a_load_after_a_checksum_error_restores_exactly(tmp_path, where):
    """After a checksum error in a step, load_checkpoint of the checkpoint taken before it
    restores exactly: training on equals the run that never met the error."""
    clean, clean_opt, model, opt, _ = _checksum_failure(tmp_path, where)
    try:
        tieroffload.load_checkpoint(tmp_path / "ckpt", model, opt)
        for s in (2, 3, 4):
            for m, o in ((clean, clean_opt), (model, opt)):
                train_step(m, o, s)
        assert_same(params_of(clean), params_of(model), "parameters")
        assert_same(optim_state_of(clean_opt), optim_state_of(opt), "optimizer state")
    finally:
        tieroffload.close(clean)
        with contextlib.suppress(OSError):  # raised once where the load did not restore
            tieroffload.close(model)


@pytest.mark.parametrize("args, words", [
    (lambda: (TinyGPT(), "nvme"), ["policy must be a tieroffload.Policy, not 'nvme'",
                                   "Policy(params='nvme', nvme_dir="]),
    (lambda: (TinyGPT(), "cpu"), ["not 'cpu'", "Policy(params='cpu')"]),
    (lambda: (TinyGPT(), "disk"), ["not 'disk'", "params is one of 'gpu', 'cpu', 'nvme'"]),
    (lambda: (None,), ["model must be a torch.nn.Module, not NoneType"]),
])
def test_offload_of_a_wrong_argument_is_a_one_line_type_error_with_the_fix(args, words):
    with pytest.raises(TypeError) as ei:
        tieroffload.offload(*args())
    msg = str(ei.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


@pytest.mark.parametrize("which", ["a submodule", "the parent"])
def test_offloading_part_of_an_offloaded_model_again_is_refused_naming_a_parameter(which):
    """offload() of a submodule of an offloaded model, or of the model around an offloaded
    submodule: refused naming a parameter already offloaded, and nothing changes."""
    model = TinyGPT()
    inner = model.blocks[0]
    first, second = (model, inner) if which == "a submodule" else (inner, model)
    tieroffload.offload(first, tieroffload.Policy(params="cpu", device="cpu"))
    with pytest.raises(ValueError, match=r"parameter '.*ln1.weight' is already offloaded "
                                         r"with another module.*close\(\)"):
        tieroffload.offload(second, tieroffload.Policy(params="cpu", device="cpu"))
    assert getattr(second, "_tieroffload", None) is None
    tieroffload.close(first)
    tieroffload.close(tieroffload.offload(second, tieroffload.Policy(params="cpu",
                                                                     device="cpu")))


@pytest.mark.parametrize("where", ["params", "optimizer"])
def test_a_checksum_error_names_the_tensor_the_file_and_the_offset(tmp_path, where):
    """The EIO of a checksum mismatch names the unit and the tensors it holds (a parameter,
    or a parameter's optimizer state and its kind), the swap file and the offset."""
    clean, clean_opt, model, opt, unit = _checksum_failure(tmp_path, where)
    path = unit.home.swap.path
    tensor = "wte.weight exp_avg" if where == "optimizer" else unit.names[0]
    assert tensor in dict(model.named_parameters()) or where == "optimizer"
    with pytest.raises(OSError) as ei:
        for s in (2, 3):
            train_step(model, opt, s)
    msg = str(ei.value)
    assert "checksum mismatch" in msg and tensor in msg, msg
    assert repr(path) in msg and f"at offset {unit.home.offset}" in msg, msg
    for m in (clean, model):
        with pytest.raises(OSError) if m is model else contextlib.nullcontext():
            tieroffload.close(m)


def test_close_after_a_persistent_read_error_releases_everything_and_raises_once(shim, tmp_path):
    """Every read of the swap fails with EIO (a dying disk): the step meets it, and close()
    raises it once while still removing the swap file, its descriptors and threads."""
    out = run_faulty(shim, """
        import threading
        def fds():
            return len(os.listdir("/proc/self/fd"))
        before = (fds(), threading.active_count())
        torch.manual_seed(0)
        model = tieroffload.offload(TinyGPT(), Policy(
            params="nvme", nvme_dir=os.environ["TMP_DIR"], device="cpu", cpu_budget="80KiB",
            optimizer="nvme", io=THREADS))
        opt = tieroffload.optimizer(model, torch.optim.AdamW, **KW)
        path = model._tieroffload.swap.path
        for step in range(2):
            opt.zero_grad(); loss_of(model, step).backward(); opt.step()
        arm(reads=-1)
        errors = []
        try:
            for step in range(2, 4):
                opt.zero_grad(); loss_of(model, step).backward(); opt.step()
        except OSError as e:
            errors.append(f"step: {e}")
        for attempt in range(2):
            try:
                tieroffload.close(model)
            except Exception as e:
                errors.append(f"close: {type(e).__name__}: {e}")
        disarm()
        result(errors=errors, swap=os.path.exists(path),
               leaked=[fds() - before[0], threading.active_count() - before[1]])
    """, tmp_path)
    errors = out["errors"]
    assert errors[0].startswith("step: ") and "Errno 5" in errors[0], errors
    closes = [e for e in errors if e.startswith("close: ")]
    assert len(closes) == 2 and "Errno 5" in closes[0] and "not offloaded" in closes[1], errors
    assert not out["swap"] and out["leaked"] == [0, 0], out

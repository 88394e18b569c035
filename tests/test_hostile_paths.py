"""Swap files and weights reached only through checked descriptors: another user who can write to
a folder cannot redirect swap writes, and load_weights reads only regular files in its folder."""

import errno
import fcntl
import itertools
import os
import stat
import threading

import numpy as np
import pytest

from tieroffload.aio import aligned_empty
from tieroffload.aio.private import ALLOW_SHARED_ENV
from tieroffload.aio.swap import SwapSpace

TAG = "race"
FS_CALLS = ("open", "mkdir", "stat", "lstat", "listdir", "fstat", "ftruncate", "unlink", "rmdir")


def fs_calls_hooked(monkeypatch, after_call):
    """Wraps os's file-system calls (and flock) so that ``after_call(k)`` runs after the k-th
    one returns: a deterministic stand-in for another process acting at that moment."""
    count = [0]

    def wrap(fn):
        def hooked(*args, **kwargs):
            out = fn(*args, **kwargs)
            count[0] += 1
            after_call(count[0])
            return out
        return hooked

    for name in FS_CALLS:
        monkeypatch.setattr(os, name, wrap(getattr(os, name)))
    monkeypatch.setattr(fcntl, "flock", wrap(fcntl.flock))
    return count


def calls_to_make_a_swap(tmp_path, monkeypatch):
    nvme = tmp_path / "count"
    nvme.mkdir()
    with monkeypatch.context() as m:
        count = fs_calls_hooked(m, lambda k: None)
        SwapSpace(str(nvme), 8192, TAG).close()
    return count[0]


def test_swap_writes_never_follow_a_rank_folder_swapped_for_a_symlink(tmp_path, monkeypatch):
    """Another user renames the private rank0/ folder and puts a symlink to their own folder (in
    which symlinks named as the swap files point at a victim file) in its place, after each
    file-system call of the swap file's creation in turn: the victim keeps its bytes, nothing
    is made in the attacker's folder, and the swap bytes land in the folder that was checked
    (or the creation is refused)."""
    victim_bytes = b"root's file\n" * 500
    for k in range(1, calls_to_make_a_swap(tmp_path, monkeypatch) + 1):
        root = tmp_path / f"k{k}"
        nvme, attacker, victim = root / "nvme", root / "attacker", root / "victim"
        for d in (nvme, attacker):
            d.mkdir(parents=True)
        victim.write_bytes(victim_bytes)
        for suffix in ("", "-1", "-2"):
            os.symlink(victim, attacker / f"tieroffload-{TAG}-rank0{suffix}.swap")
        planted = sorted(os.listdir(attacker))

        def attack(n, k=k, nvme=nvme, attacker=attacker):
            if n == k:
                try:
                    os.rename(nvme / "rank0", nvme / "moved")
                except FileNotFoundError:
                    pass  # not made yet: the symlink is there first
                os.symlink(attacker, nvme / "rank0")

        with monkeypatch.context() as m:
            fs_calls_hooked(m, attack)
            try:
                swap = SwapSpace(str(nvme), 8192, TAG)
            except PermissionError as e:
                assert "symlink" in str(e), e
                swap = None
        if swap is not None:
            data = np.random.default_rng(k).integers(0, 256, 8192, dtype=np.uint8)
            buf = aligned_empty(8192, pin=False)
            buf.numpy()[:] = data
            off = swap.alloc(8192)
            assert swap.file.pwrite(buf, off).result() == 8192
            swap.file.sync()
            assert victim.read_bytes() == victim_bytes, f"attack after call {k}: victim written"
            used = os.fstat(swap.file.fileno())
            real = next((nvme / d / f for d in os.listdir(nvme) if not os.path.islink(nvme / d)
                         for f in os.listdir(nvme / d)), None)
            assert real is not None, f"attack after call {k}: no swap file in our folder"
            assert (os.stat(real).st_dev, os.stat(real).st_ino) == (used.st_dev, used.st_ino)
            assert real.read_bytes()[off:off + 8192] == data.tobytes()
            swap.close()
        assert victim.read_bytes() == victim_bytes, f"attack after call {k}: victim overwritten"
        assert sorted(os.listdir(attacker)) == planted, \
            f"attack after call {k}: files made in the attacker's folder"


def test_swap_engine_uses_the_descriptor_that_was_checked(tmp_path, monkeypatch):
    """The swap file is opened once, by name relative to its folder: the engine's descriptor is
    that one (the same inode as the file at the swap path), never a second open by path."""
    opened: list[int] = []
    real_open = os.open

    def recording_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        if os.fspath(path).endswith(".swap") and flags & os.O_RDWR:
            assert flags & os.O_NOFOLLOW, f"{path} opened without O_NOFOLLOW"
            opened.append(fd)
        return fd

    monkeypatch.setattr(os, "open", recording_open)
    swap = SwapSpace(str(tmp_path), 4096, TAG)
    monkeypatch.undo()
    try:
        assert opened == [swap.file.fileno()], "the swap file was opened more than once"
        st, at = os.fstat(swap.file.fileno()), os.stat(swap.path, follow_symlinks=False)
        assert stat.S_ISREG(at.st_mode) and (st.st_dev, st.st_ino) == (at.st_dev, at.st_ino)
    finally:
        swap.close()
    assert not os.path.exists(swap.path)


def give_to_another_group(folder):
    """Makes ``folder``'s group one the user does not own alone (root only)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give a folder to another group")
    os.chown(folder, -1, 65534)


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o757])
def test_a_shared_nvme_dir_without_the_sticky_bit_is_refused(tmp_path, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    if mode & 0o020:
        give_to_another_group(shared)
    with pytest.raises(PermissionError) as e:
        SwapSpace(str(shared), 4096, TAG)
    msg = str(e.value)
    assert e.value.errno == errno.EPERM and "\n" not in msg
    assert str(shared) in msg and f"{mode:04o}" in msg and "chmod +t" in msg
    assert ALLOW_SHARED_ENV in msg
    assert os.listdir(shared) == [], "made something in the refused folder"


def test_a_group_writable_nvme_dir_of_the_users_own_group_is_accepted(tmp_path):
    """umask 002 with user private groups (Debian, Ubuntu) makes folders 0775 whose group is
    the user's alone: nobody else can write there, so it is not refused."""
    import grp
    import pwd

    user = pwd.getpwuid(os.geteuid())
    group = grp.getgrgid(user.pw_gid)
    if group.gr_name != user.pw_name or any(m != user.pw_name for m in group.gr_mem):
        pytest.skip("this user has no private group")
    mine = tmp_path / "mine"
    mine.mkdir()
    os.chown(mine, -1, user.pw_gid)
    os.chmod(mine, 0o775)
    SwapSpace(str(mine), 4096, TAG).close()
    assert os.listdir(mine) == []


def test_a_sticky_shared_nvme_dir_is_accepted(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    swap = SwapSpace(str(shared), 4096, TAG)
    swap.close()
    assert os.listdir(shared) == []


def test_a_shared_nvme_dir_is_accepted_when_the_user_opts_out(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    monkeypatch.setenv(ALLOW_SHARED_ENV, "1")
    swap = SwapSpace(str(shared), 4096, TAG)
    swap.close()
    assert os.listdir(shared) == []


def test_offload_refuses_a_shared_nvme_dir_in_one_line(tmp_path):
    import torch

    import tieroffload

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    model = torch.nn.Linear(8, 8)
    with pytest.raises(PermissionError, match="no sticky bit") as e:
        tieroffload.offload(model, tieroffload.Policy(params="nvme", nvme_dir=str(shared),
                                                      device="cpu"))
    assert "\n" not in str(e.value) and str(shared) in str(e.value)


def test_disk_measurement_files_never_follow_a_planted_symlink(tmp_path):
    """The throughput probe's file name is predictable: a symlink planted there is refused,
    and the file it points at keeps its bytes."""
    from tieroffload.aio.config import IOConfig
    from tieroffload.aio.throughput import bench_paths, run_files

    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me\n" * 100)
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    os.symlink(victim, bench_paths([str(nvme)], "t", 0)[0])
    task = {"dirs": [str(nvme)], "direct": [False], "size": 1 << 20,
            "io": IOConfig().to_dict(), "tag": "t"}
    with pytest.raises(PermissionError, match="symlink"):
        run_files(0, threading.Barrier(1), task)
    assert victim.read_bytes() == b"keep me\n" * 100


# -- load_weights reads only regular files inside its folder ----------------------------------

def _offloaded_linear():
    import torch

    import tieroffload

    torch.manual_seed(0)
    return tieroffload.offload(torch.nn.Linear(4, 4), tieroffload.Policy(device="cpu"))


def _weights_of(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _write_outside(tmp_path):
    """Weights that fit the model, in a folder beside the one load_weights is given."""
    import torch
    from safetensors.torch import save_file

    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({"weight": torch.full((4, 4), 7.0), "bias": torch.full((4,), 7.0)},
              str(outside / "x.safetensors"))
    return outside / "x.safetensors"


@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_load_weights_refuses_an_index_naming_a_shard_outside_its_folder(tmp_path, how):
    import json

    import tieroffload

    target = _write_outside(tmp_path)
    entry = "../outside/x.safetensors" if how == "dotdot" else str(target)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"weight": entry, "bias": entry}}))
    model = _offloaded_linear()
    before = _weights_of(model)
    for source in (folder, folder / "model.safetensors.index.json"):
        with pytest.raises(ValueError) as e:
            tieroffload.load_weights(model, source)
        msg = str(e.value)
        assert "\n" not in msg and repr(entry) in msg and str(folder) in msg, msg
    after = _weights_of(model)
    assert all((before[k] == after[k]).all() for k in before), "weights read from outside"
    tieroffload.close(model)


def test_load_weights_refuses_a_symlinked_shard_in_its_folder(tmp_path):
    import tieroffload

    target = _write_outside(tmp_path)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    os.symlink(target, folder / "model.safetensors")
    model = _offloaded_linear()
    before = _weights_of(model)
    with pytest.raises(ValueError, match="symlink") as e:
        tieroffload.load_weights(model, folder)
    assert str(folder / "model.safetensors") in str(e.value)
    after = _weights_of(model)
    assert all((before[k] == after[k]).all() for k in before)
    tieroffload.close(model)


FIFO_LOADER = """
import sys, torch, tieroffload
m = tieroffload.offload(torch.nn.Linear(4, 4), tieroffload.Policy(device="cpu"))
try:
    tieroffload.load_weights(m, sys.argv[1])
except ValueError as e:
    print("refused:", e)
"""


@pytest.mark.parametrize("how", ["folder", "index", "file"])
def test_load_weights_refuses_a_fifo_named_as_a_shard_at_once(tmp_path, how):
    """A FIFO where a shard should be is refused at once, never opened for a read that waits
    for a writer (which no signal interrupts)."""
    import json
    import subprocess
    import sys

    folder = tmp_path / "ckpt"
    folder.mkdir()
    os.mkfifo(folder / "model.safetensors")
    if how == "index":
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"weight": "model.safetensors"}}))
    source = {"folder": folder, "index": folder / "model.safetensors.index.json",
              "file": folder / "model.safetensors"}[how]
    try:
        r = subprocess.run([sys.executable, "-c", FIFO_LOADER, str(source)],
                           capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("load_weights hung on a FIFO")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("refused:") and "not a regular file" in r.stdout, r.stdout
    assert str(folder / "model.safetensors") in r.stdout


@pytest.mark.parametrize("source", [5, None, b"w.safetensors", [1, 2]])
def test_load_weights_of_something_not_a_path_is_a_one_line_type_error(source):
    import tieroffload

    model = _offloaded_linear()
    with pytest.raises(TypeError, match="load_weights: source must be") as e:
        tieroffload.load_weights(model, source)
    assert type(source).__name__ in str(e.value) and "\n" not in str(e.value)
    tieroffload.close(model)


# -- checkpoints are written only through the descriptors of the folders a save made ---------

def _save_small(path, seed):
    import torch

    import tieroffload

    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 4)
    tieroffload.save_checkpoint(path, model)
    return model


@pytest.mark.parametrize("links", [True, False], ids=["links-to-a-victim", "empty"])
def test_checkpoint_writes_never_follow_a_temporary_folder_swapped_for_a_symlink(
        tmp_path, monkeypatch, links):
    """Another user renames a save's ``<path>.tmp-<pid>`` folder and puts a symlink to their own
    folder (empty, or in which symlinks named as the checkpoint's files point at a victim file)
    in its place, after each file-system call of the save in turn: the victim keeps its bytes,
    nothing is made in the attacker's folder, and the save either lands whole or fails leaving
    the previous checkpoint as it was."""
    import torch

    import tieroffload

    victim_bytes = b"root's file\n" * 500
    fired = True
    for k in itertools.count(1):  # until the save makes fewer than k calls
        if not fired:
            break
        root = tmp_path / f"k{k}"
        attacker, victim, path = root / "attacker", root / "victim", root / "ckpt"
        attacker.mkdir(parents=True)
        victim.write_bytes(victim_bytes)
        for name in ("manifest.json", "tensors.bin", "extra.pt") if links else ():
            os.symlink(victim, attacker / name)
        planted = sorted(os.listdir(attacker))
        before = _save_small(path, 1)
        tmp = root / f"ckpt.tmp-{os.getpid()}"

        fired = False

        def attack(n, k=k, tmp=tmp, attacker=attacker, root=root):
            nonlocal fired
            if n == k:
                fired = True
                try:
                    os.rename(tmp, root / "moved")
                except FileNotFoundError:
                    pass  # not made yet: the symlink is there first
                os.symlink(attacker, tmp)

        with monkeypatch.context() as m:
            fs_calls_hooked(m, attack)
            try:
                saved = _save_small(path, 2)
            except (tieroffload.CheckpointError, OSError):
                saved = None
        assert victim.read_bytes() == victim_bytes, f"attack after call {k}: victim written"
        assert sorted(os.listdir(attacker)) == planted, \
            f"attack after call {k}: files made in the attacker's folder"
        fresh = torch.nn.Linear(4, 4)
        tieroffload.load_checkpoint(path, fresh)
        want = saved if saved is not None else before
        for a, b in zip(fresh.parameters(), want.parameters()):
            assert torch.equal(a, b), f"attack after call {k}: the checkpoint at path is wrong"

"""Writing a checkpoint: where it may go (``check_target``), its files, and the removal of
what a checkpoint holds, and nothing else."""

from __future__ import annotations

import glob
import json
import os
import re
import stat
import zlib
from typing import Any, BinaryIO

import torch
from torch import nn

from ..optim.paged import PagedOptimizer
from .opened import _complete, _crc, _Opened
from .schema import FORMAT, MAX_MANIFEST, VERSION, CheckpointError

FILES = ("manifest.json", "tensors.bin", "extra.pt")  # what a checkpoint directory holds
RANK_DIR = re.compile(r"rank(0|[1-9][0-9]*)\Z")  # and, saved by several ranks, their parts


def _bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, from a copy: ``.numpy()`` would make the original's storage
    non-resizable, and offloaded storage must stay resizable."""
    t = t.detach().to("cpu", copy=True).contiguous()
    return memoryview(t.view(-1).view(torch.uint8).numpy())


class _Writer:
    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.entries: list[dict[str, Any]] = []

    def add(self, key: str, t: torch.Tensor) -> None:
        mv = _bytes(t)
        self.entries.append({"key": key, "dtype": str(t.dtype).removeprefix("torch."),
                             "shape": list(t.shape), "offset": self.f.tell(),
                             "nbytes": len(mv), "crc32": zlib.crc32(mv)})
        self.f.write(mv)


def _create(path: str) -> BinaryIO:
    """A new file only this user may read (0600)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o600), "wb")


def _mkdir(path: str) -> None:
    os.mkdir(path, 0o700)
    os.chmod(path, 0o700)  # whatever the umask


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_target(path: Any) -> str:
    """The absolute path ``save_checkpoint(path)`` may write to, or a CheckpointError saying
    why not, raised before anything is written: ``path`` must not exist (its parent must), or
    hold a tieroffload checkpoint (manifest.json of this format, read through the directory's
    descriptor) with nothing else in it, so that replacing it deletes nothing of the user's.
    A symbolic link is followed once, to the checkpoint it names (the link stays)."""
    if path is None or (isinstance(path, (str, bytes)) and not path):
        raise CheckpointError(f"save_checkpoint needs a path (a new directory, or a checkpoint "
                              f"to replace), not {path!r}")
    try:
        raw = os.fsdecode(os.fspath(path))
    except TypeError as e:
        raise CheckpointError(f"save_checkpoint's path is a {type(path).__name__}, not a "
                              "str or os.PathLike") from e
    path = os.path.abspath(raw)
    if os.path.islink(path):
        target = os.path.realpath(path)
        if not os.path.lexists(target):
            raise CheckpointError(f"checkpoint path {path} is a symbolic link to {target}, "
                                  "which does not exist: name the checkpoint itself")
        path = target
    cwd = os.getcwd()
    if os.path.commonpath([path, cwd]) == path:
        raise CheckpointError(f"checkpoint path {raw!r} is the working directory {cwd}"
                              f"{'' if path == cwd else ' or holds it'}: name a new "
                              "directory inside it instead")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            raise FileNotFoundError(f"checkpoint directory's parent does not exist: "
                                    f"{parent}") from None
        return path
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"checkpoint path {path} is a file, not a checkpoint directory: "
                              "nothing was written; remove it or save elsewhere")
    with _Opened(path) as ck:
        names = ck.names()
        if "manifest.json" not in names:
            what = "an empty directory" if not names else f"a directory of {len(names)} entries"
            raise CheckpointError(f"checkpoint path {path} is {what} with no manifest.json, "
                                  "not a checkpoint: nothing was written; save to a new path")
        _check_own(ck, names)
    return path


def _check_own(ck: _Opened, names: list[str]) -> None:
    """``ck`` is a tieroffload checkpoint holding only what a save writes."""
    f = ck.open("manifest.json")
    try:
        head = json.loads(f.read(MAX_MANIFEST))
        ours = isinstance(head, dict) and head.get("format") == FORMAT
    except (ValueError, RecursionError):
        ours = False
    if not ours:
        raise CheckpointError(f"checkpoint path {ck.path} holds a manifest.json that is not a "
                              f"{FORMAT}'s: nothing was written; save to a new path")
    for name in names:
        if name in FILES:
            continue
        inside = os.path.join(ck.path, name)
        if RANK_DIR.match(name) and os.path.isdir(inside) and not os.path.islink(inside) \
                and set(os.listdir(inside)) <= set(FILES):
            continue
        raise CheckpointError(
            f"checkpoint {ck.path} holds {name!r}, which is no part of a checkpoint: nothing "
            "was written; move it out first (replacing a checkpoint deletes only its own files)")


def remove_checkpoint(path: str) -> None:
    """Removes the checkpoint files (and rank parts) in ``path``, then the directory if it
    is then empty: anything else in it stays, and so does the directory. A symbolic link (one
    planted at a temporary name) is not followed: nothing is removed."""
    if os.path.islink(path) or not os.path.isdir(path):
        return
    for name in FILES:
        _unlink(os.path.join(path, name))
    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in names:
        inside = os.path.join(path, name)
        if RANK_DIR.match(name) and os.path.isdir(inside) and not os.path.islink(inside):
            for f in FILES:
                _unlink(os.path.join(inside, f))
            _rmdir(inside)
    _rmdir(path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _rmdir(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _leftovers(path: str) -> list[tuple[str, int]]:
    """(directory, pid) of ``<path>.tmp-<pid>`` and ``<path>.old-<pid>`` beside ``path``."""
    out = []
    for d in glob.glob(glob.escape(path) + ".tmp-*") + glob.glob(glob.escape(path) + ".old-*"):
        tail = d.rsplit("-", 1)[-1]
        try:
            st = os.lstat(d)
        except OSError:
            continue
        # Only our own saves' leftovers: a directory another user planted beside the
        # checkpoint is never adopted, nor removed.
        if tail.isdigit() and stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            out.append((d, int(tail)))
    return out


def _recover(path: str) -> None:
    """Where ``path`` is missing, puts back the newest complete copy a killed save left beside
    it (a new one whose manifest was written, else the old one); then removes the leftovers of
    dead processes (their checkpoint files only). A live process's temporary directory is
    never touched."""
    dead = [(d, pid) for d, pid in _leftovers(path) if not _alive(pid)]
    if not os.path.exists(path):
        complete = []
        for d, _ in dead:
            if not _complete(d):
                continue
            new = ".tmp-" in d[len(path):]
            complete.append((new, os.path.getmtime(os.path.join(d, "manifest.json")), d))
        if complete:
            os.rename(max(complete)[2], path)
            _fsync_dir(os.path.dirname(path))
    for d, _ in dead:
        if os.path.isdir(d):
            remove_checkpoint(d)


def _write(tmp: str, model: nn.Module, optimizer: torch.optim.Optimizer | None,
           extra: Any) -> dict[str, Any]:
    """Writes tensors.bin and extra.pt into ``tmp``; returns the manifest of this part."""
    state = getattr(model, "_tieroffload", None)
    scalars: dict[str, Any] = {}
    loss_scale = None
    with _create(os.path.join(tmp, "tensors.bin")) as f:
        w = _Writer(f)
        if state is not None:
            for u in state.units:  # one unit resident at a time
                with state.resident([u]):
                    for name, p in zip(u.names, u.params):
                        w.add(f"param/{name}", p)
        else:
            for name, p in model.named_parameters():
                w.add(f"param/{name}", p)
        for name, b in model.named_buffers():
            w.add(f"buffer/{name}", b)
        groups = None
        if isinstance(optimizer, PagedOptimizer):
            index = optimizer._index()
            for chunk in optimizer.chunks:
                with optimizer.resident(chunk):
                    for p, st in optimizer.entries(chunk):
                        for k, v in st.items():
                            key = f"optim/{index[id(p)]}/{k}"
                            if isinstance(v, torch.Tensor):
                                w.add(key, v)
                            else:
                                scalars[key] = v
            groups = optimizer.state_dict_groups()
            if optimizer.scaler is not None:
                loss_scale = optimizer.scaler.state_dict()
        elif optimizer is not None:
            sd = optimizer.state_dict()
            for i, st in sd["state"].items():
                for k, v in st.items():
                    if isinstance(v, torch.Tensor):
                        w.add(f"optim/{i}/{k}", v)
                    else:
                        scalars[f"optim/{i}/{k}"] = v
            groups = sd["param_groups"]
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    epath = os.path.join(tmp, "extra.pt")
    try:
        with _create(epath) as f:
            torch.save({"param_groups": groups, "scalars": scalars, "loss_scale": loss_scale,
                        "extra": extra}, f)
            f.flush()
            os.fsync(f.fileno())
        # what load will accept: refused now, while the previous checkpoint is in place
        torch.load(epath, weights_only=True)
    except OSError:  # the disk: not the value
        raise
    except Exception as e:  # a lambda, an open file, a type weights_only refuses
        raise CheckpointError(f"extra holds a value that cannot be saved and loaded safely "
                              f"(use dicts, lists, numbers, strings and tensors): "
                              f"{e}".splitlines()[0]) from e
    with open(epath, "rb") as f:
        nbytes, crc = _crc(f)
    return {"format": FORMAT, "version": VERSION, "size": size, "tensors": w.entries,
            "extra": {"nbytes": nbytes, "crc32": crc}}

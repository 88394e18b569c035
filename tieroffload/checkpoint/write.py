"""Writing a checkpoint: where it may go (``check_target``), its files (through the
descriptors of ``folder.Folder``), and putting back what a killed save left."""

from __future__ import annotations

import json
import os
import stat
import zlib
from typing import Any, BinaryIO

import torch
from torch import nn

from ..hooks import registry
from ..optim.paged import PagedOptimizer
from .folder import FILES, RANK_DIR, Folder
from .opened import _complete, _crc, _Opened
from .schema import FORMAT, MAX_MANIFEST, VERSION, CheckpointError, load_refusal


def _bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, from a copy: ``.numpy()`` would make the original's storage
    non-resizable, and offloaded storage must stay resizable."""
    t = t.detach().to("cpu", copy=True).contiguous()
    return memoryview(t.view(-1).view(torch.uint8).numpy())


class _Writer:
    """Appends tensors' bytes to one open file and keeps each one's manifest entry (key,
    dtype, shape, offset, size, checksum)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.entries: list[dict[str, Any]] = []

    def add(self, key: str, t: torch.Tensor) -> None:
        mv = _bytes(t)
        self.entries.append({"key": key, "dtype": str(t.dtype).removeprefix("torch."),
                             "shape": list(t.shape), "offset": self.f.tell(),
                             "nbytes": len(mv), "crc32": zlib.crc32(mv)})
        self.f.write(mv)


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
        if name in FILES or (RANK_DIR.match(name) and _holds_only_files(ck, name)):
            continue
        raise CheckpointError(
            f"checkpoint {ck.path} holds {name!r}, which is no part of a checkpoint: nothing "
            "was written; move it out first (replacing a checkpoint deletes only its own files)")


def _holds_only_files(ck: _Opened, name: str) -> bool:
    """``name`` in ``ck`` is a folder (not a link to one) of checkpoint files only."""
    try:
        with Folder(os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                            dir_fd=ck.fd), os.path.join(ck.path, name)) as part:
            return set(part.names()) <= set(FILES)
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _leftovers(parent: Folder, base: str) -> list[tuple[str, str, int, bool]]:
    """(name, kind, pid, marked) of this user's folders ``<base>.tmp-<pid>`` and
    ``<base>.old-<pid>`` in ``parent``; ``marked``: a save of this host marked it as its own
    (``Folder.mark``). Only a marked one is ever adopted or emptied: a folder of the user's
    that only looks like one (a backup named ``ckpt.old-20261207``), or another user's, never
    is."""
    out = []
    for name in parent.names():
        for kind in ("tmp", "old"):
            tail = name[len(base) + len(kind) + 2:]
            if not (name.startswith(f"{base}.{kind}-") and tail.isdigit()):
                continue
            st = parent.lstat(name)
            if st is not None and stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
                out.append((name, kind, int(tail), parent.marked(name, kind, int(tail))))
    return out


def _recover(parent: Folder, base: str) -> None:
    """Where ``base`` is missing from ``parent``, puts back the newest complete copy a killed
    save left beside it (a new one whose manifest was written, else the old one); then removes
    the leftovers of dead processes (their checkpoint files only), and the empty folders of
    saves killed before they were marked. A live process's temporary directory is never
    touched."""
    found = [(n, kind, marked) for n, kind, pid, marked in _leftovers(parent, base)
             if not _alive(pid)]
    dead = [(n, kind) for n, kind, marked in found if marked]
    if parent.lstat(base) is None:
        complete = []
        for n, kind in dead:
            when = _complete(parent.where(n), parent)
            if when is not None:
                complete.append((kind == "tmp", when, n))
        if complete:
            parent.rename(max(complete)[2], base)
            parent.fsync()
    for n, _ in dead:
        parent.remove_checkpoint(n)
    for n, _, marked in found:
        if not marked:
            parent.remove_if_empty(n)


def _write(tmp: Folder, model: nn.Module, optimizer: torch.optim.Optimizer | None,
           extra: Any) -> dict[str, Any]:
    """Writes tensors.bin and extra.pt into ``tmp``; returns the manifest of this part."""
    state = registry.find(model)
    scalars: dict[str, Any] = {}
    loss_scale = None
    with tmp.create("tensors.bin") as f:
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
            for part in optimizer.states.chunks():  # one chunk's state in memory at a time
                with part as entries:
                    for i, st in entries:
                        for k, v in st.items():
                            key = f"optim/{i}/{k}"
                            if isinstance(v, torch.Tensor):
                                w.add(key, v)
                            else:
                                scalars[key] = v
            groups = optimizer.states.groups()
            loss_scale = optimizer.states.loss_scale()
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
    try:
        with tmp.create("extra.pt") as f:
            torch.save({"param_groups": groups, "scalars": scalars, "loss_scale": loss_scale,
                        "extra": extra}, f)
            f.flush()
            os.fsync(f.fileno())
        # what load will accept: refused now, while the previous checkpoint is in place
        with tmp.read("extra.pt") as f:
            torch.load(f, weights_only=True)
    except OSError:  # the disk: not the value
        raise
    except Exception as e:  # a lambda, an open file, a type weights_only refuses
        raise CheckpointError(f"extra holds a value that cannot be saved and loaded safely "
                              f"(use dicts, lists, numbers, strings and tensors): "
                              f"{load_refusal(e)}") from e
    with tmp.read("extra.pt") as f:
        nbytes, crc = _crc(f)
    return {"format": FORMAT, "version": VERSION, "size": size, "tensors": w.entries,
            "extra": {"nbytes": nbytes, "crc32": crc}}

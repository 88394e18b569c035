"""Checkpoints of the whole training state, from whatever tier it lives in, streamed one unit
(and one optimizer chunk) at a time, so a model larger than RAM can be saved and resumed.

A checkpoint is a directory: ``tensors.bin`` (raw bytes), ``manifest.json`` (for each tensor:
key, dtype, shape, offset, size and CRC-32) and ``extra.pt`` (optimizer hyperparameters, the
non-tensor state and the caller's ``extra``: plain types and tensors only, loaded with
``weights_only=True`` so that a crafted file cannot run code, and checksummed like the tensors).
Everything is private to the user (0700 directories, 0600 files).

Where a save goes (``write.check_target``): a path that does not exist, or an existing
tieroffload checkpoint (its manifest.json of this format) that holds nothing else. Anything
else (``""``, the working directory, a folder of other files, a regular file, a symbolic link
to any of those) is a ``CheckpointError`` naming the path and why, raised before anything is
written. A checkpoint folder with a file the user put there is refused too (the file named),
never emptied: replacing a checkpoint removes only the files a checkpoint holds. A symbolic
link to a checkpoint (``latest -> step-1000``) is followed: the checkpoint it names is
replaced, the link stays.

It is written under ``<path>.tmp-<pid>``, fsynced, and swapped into place in one step
(renameat2's RENAME_EXCHANGE), so a reader of ``<path>`` meets the old checkpoint or the new,
never none: a failure (a full disk: an OSError naming the path) leaves the previous one as it
was. Where the file system cannot swap, the old one is moved aside first; a kill between the
two renames then leaves no ``<path>`` but a complete copy beside it, which the next load or
save puts back in place. Leftovers of dead processes are then removed, a live one's never. A
load reads through descriptors it opened once, so a save that replaces ``<path>`` meanwhile is
never mixed in.

A load is all or nothing: it checks the manifest and ``extra.pt`` against their schema
(``schema``), the whole manifest against the model, every optimizer hyperparameter against
what torch accepts and every optimizer state entry against its parameter (the names the
optimizer's class keeps, shape, dtype: ``optim.state_check``), and the sizes and checksums of
everything, before it changes anything; any failure is a ``CheckpointError`` naming the
entry. Loading the optimizer replaces its state as torch's ``load_state_dict`` does: a
parameter with no state saved (a checkpoint from before the first step) starts afresh.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..hooks import registry
from ..optim.paged import PagedOptimizer
from ..utils.dist import distributed
from .folder import Folder
from .opened import _check_size, _Opened, _verify
from .schema import (
    DTYPES,
    FORMAT,
    VERSION,
    CheckpointError,
    check_optimizer,
    check_saved,
    load_refusal,
)
from .write import _recover, _write, check_target

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]


def save_checkpoint(path: str | os.PathLike, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, extra: Any = None) -> None:
    """Saves parameters, buffers, optimizer state and ``extra`` (e.g. the scheduler's
    ``state_dict()`` and the step) into the directory ``path``. Under torch.distributed every
    rank calls it: each writes its own ``rank<r>/`` part, and rank 0 writes the one manifest
    and renames the whole into place once every rank has finished (or removes it if one
    failed). ``path`` must not exist, or hold a checkpoint and nothing else (see the module's
    docstring): anything else is a CheckpointError before anything is written. A disk error
    (a full disk) is an OSError naming ``path``; the previous checkpoint stays as it was."""
    path = check_target(path)  # every rank: each raises the same error, none waits
    where, base = os.path.split(path)
    dist = distributed()
    rank = dist.get_rank() if dist else 0
    token = [f"{base}.tmp-{os.getpid()}"]
    if dist:
        dist.broadcast_object_list(token, src=0)  # one temporary name for every rank
    tmp = token[0]
    with Folder.for_writing(where) as parent:
        if rank == 0:
            _recover(parent, base)
            if parent.marked(tmp, "tmp", os.getpid()):
                parent.remove_checkpoint(tmp)  # left by an earlier process of our pid
            parent.remove_if_empty(tmp)
            with parent.make(tmp) as made:
                made.mark("tmp", os.getpid())
        if dist:
            dist.barrier()
        try:
            with parent.sub(tmp) as folder:
                _save_into(folder, parent, tmp, base, dist, rank, model, optimizer, extra)
        except OSError as e:
            if rank == 0:
                parent.remove_checkpoint(tmp)
            raise OSError(e.errno, f"{e.strerror} while saving checkpoint {path}: not saved, "
                          "the previous one (if any) is kept") from e
        except BaseException:
            if rank == 0:
                parent.remove_checkpoint(tmp)
            raise
        finally:
            if dist:
                dist.barrier()  # nobody goes on before the checkpoint is in place


def _save_into(folder: Folder, parent: Folder, tmp: str, base: str, dist: Any, rank: int,
               model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: Any) -> None:
    """Writes this rank's part into ``folder`` (``parent``'s ``tmp``); rank 0 then writes the
    manifest once every rank has written, and puts ``tmp`` in place of ``base``."""
    try:
        part = folder.make(f"rank{rank}") if dist else folder
        try:
            meta: Any = _write(part, model, optimizer, extra)
            part.fsync()
        finally:
            if part is not folder:
                part.close()
    except BaseException as e:
        meta = e
    metas = [meta]
    if dist:
        metas = [None] * dist.get_world_size()
        dist.all_gather_object(metas, meta if not isinstance(meta, BaseException)
                               else f"rank {rank}: {meta!r}")
    failed = [m for m in metas if not isinstance(m, dict)]
    if failed:
        raise meta if isinstance(meta, BaseException) else CheckpointError(
            f"checkpoint {parent.where(base)} not saved: {failed[0]}".splitlines()[0])
    if rank == 0:
        manifest = metas[0] if not dist else {
            "format": FORMAT, "version": VERSION, "world_size": len(metas), "ranks": metas}
        with folder.create("manifest.json") as f:
            f.write(json.dumps(manifest).encode())
            f.flush()
            os.fsync(f.fileno())
        folder.fsync()
        _replace(parent, tmp, base, os.fstat(folder.fd))


def _replace(parent: Folder, tmp: str, base: str, mine: os.stat_result) -> None:
    """Puts the complete checkpoint ``tmp`` (the folder ``mine`` is the status of) in place of
    ``base`` (both in ``parent``): in one step where the file system can (a reader of ``base``
    sees the old or the new, never none), else by moving the old aside first. The old one's
    files are then removed (``check_target`` made sure it held nothing else). A failure, or
    ``tmp`` found to be another folder than ours after the rename (another user renamed it),
    leaves ``base`` as it was."""
    def ours(name: str) -> bool:
        st = parent.lstat(name)
        return st is not None and (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    replaced = CheckpointError(f"checkpoint {parent.where(base)} not saved: its temporary folder "
                               f"{parent.where(tmp)} was replaced while it was written (can "
                               "another user write to the folder?)")
    try:
        _switch(parent, tmp, base, ours, replaced)
    except BaseException:
        if parent.lstat(base) is not None and not ours(base):
            _unmark(parent, base)  # the previous checkpoint, left as it was
        raise
    _unmark(parent, base)


def _switch(parent: Folder, tmp: str, base: str, ours: Callable[[str], bool],
            replaced: CheckpointError) -> None:
    """``_replace``'s renames. The previous checkpoint is marked first as the leftover it
    becomes if the process is killed half way, so the next save or load can put it back."""
    pid = os.getpid()
    if parent.lstat(base) is not None:
        with parent.sub(base) as previous:
            previous.mark("tmp", pid)
        if parent.exchange(tmp, base):
            if not ours(base):
                parent.exchange(tmp, base)
                raise replaced
            parent.fsync()
            parent.remove_checkpoint(tmp)  # the old checkpoint, now
            return
        with parent.sub(base) as previous:
            previous.mark("old", pid)
    old = f"{base}.old-{pid}"
    if parent.lstat(base) is not None:
        parent.rename(base, old)
    try:
        parent.rename(tmp, base)
        if not ours(base):
            parent.rename(base, tmp)
            raise replaced
    except BaseException:
        if parent.lstat(old) is not None:
            parent.rename(old, base)
        raise
    parent.fsync()
    parent.remove_checkpoint(old)


def _unmark(parent: Folder, base: str) -> None:
    """The checkpoint ``base`` without the mark of the save that put it there."""
    with parent.sub(base) as ck:
        ck.unmark()


def load_checkpoint(path: str | os.PathLike, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> Any:
    """Restores what ``save_checkpoint`` saved into ``model`` (offloaded with any policy, or
    not) and ``optimizer``; returns ``extra``. Refuses a truncated, corrupt or malformed
    checkpoint, or one that does not fit the model or the optimizer, with a CheckpointError
    naming the entry, before changing anything. The optimizer's state is replaced as torch's
    ``load_state_dict`` replaces it (none saved for a parameter: it starts afresh)."""
    path = os.path.abspath(os.fspath(path))
    dist = distributed()
    if not dist or dist.get_rank() == 0:
        _recover_beside(path)  # a save killed half way: put its copy back, clear leftovers
    if dist:
        dist.barrier()
    with _Opened(path) as top:
        meta = top.manifest()
        if "ranks" not in meta:
            return _load(top, meta, model, optimizer)
        world = dist.get_world_size() if dist else 1  # saved by several ranks: read our part
        if world != meta["world_size"]:
            raise CheckpointError(f"checkpoint {path} was saved by {meta['world_size']} ranks; "
                                  f"this run has {world}")
        rank = dist.get_rank() if dist else 0
        with _Opened(os.path.join(path, f"rank{rank}"), top) as part:
            return _load(part, meta["ranks"][rank], model, optimizer)


def _recover_beside(path: str) -> None:
    """``write._recover`` in the folder of ``path``, where that folder can be opened (where it
    cannot, the load itself says there is no checkpoint)."""
    try:
        parent = Folder.for_reading(os.path.dirname(path))
    except OSError:
        return
    with parent:
        _recover(parent, os.path.basename(path))


def _load(ck: _Opened, meta: dict[str, Any], model: nn.Module,
          optimizer: torch.optim.Optimizer | None) -> Any:
    """``load_checkpoint`` from one opened directory and its manifest."""
    path = ck.path
    # Opened at once, and held: a save that replaces the directory meanwhile cannot take them.
    for name in ("tensors.bin", "extra.pt"):
        ck.open(name)
    f = _check_size(ck, meta)
    ef = _verify(ck, meta, f)
    entries = {e["key"]: e for e in meta["tensors"]}
    try:
        ef.seek(0)
        saved = torch.load(ef, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: extra.pt is unreadable: "
                              f"{load_refusal(e)}") from e
    check_saved(saved, path)
    state = registry.find(model)
    params = ([(n, p) for u in state.units for n, p in zip(u.names, u.params)]
              if state is not None else list(model.named_parameters()))
    tensors = ([("param", n, p) for n, p in params]
               + [("buffer", n, b) for n, b in model.named_buffers()])
    unexpected = sorted(set(k for k in entries if not k.startswith("optim/"))
                        - {f"{kind}/{name}" for kind, name, _ in tensors})
    if unexpected:
        raise CheckpointError(f"checkpoint {path} holds {unexpected[0]!r}"
                              f"{f' and {len(unexpected) - 1} more' if len(unexpected) > 1 else ''}"
                              ", which the model has not (as load_state_dict(strict=True) refuses "
                              "unexpected keys)")
    for kind, name, p in tensors:
        e = entries.get(f"{kind}/{name}")
        if e is None:
            raise CheckpointError(f"checkpoint {path} has no {kind} {name!r}")
        if e["shape"] != list(p.shape) or e["dtype"] != str(p.dtype).removeprefix("torch."):
            raise CheckpointError(f"checkpoint {path}: {name} is {e['dtype']}{e['shape']}, the "
                                  f"model has {p.dtype}{list(p.shape)}")
    if optimizer is not None:
        check_optimizer(path, optimizer, saved, entries)

    def fill(t: torch.Tensor, key: str) -> None:
        """From the data file opened and checked above: the bytes the checksums covered."""
        e = entries[key]
        f.seek(e["offset"])
        host = torch.empty(t.shape, dtype=t.dtype)  # see _bytes
        got = f.readinto(memoryview(host.view(-1).view(torch.uint8).numpy()))
        if got != e["nbytes"]:
            raise CheckpointError(f"checkpoint {path}: {key} read {got} of its "
                                  f"{e['nbytes']} bytes")
        t.copy_(host)

    try:
        # ``loading``: what a failed step left is dropped, and units come in without a read
        with (state.loading(optimizer) if state is not None else contextlib.nullcontext()), \
                torch.no_grad():
            if state is not None:
                for u in state.units:
                    with state.resident([u], writeback=state.mover is not None):
                        for name, p in zip(u.names, u.params):
                            fill(p.data, f"param/{name}")
                        state.mark_loaded(u.params)
            else:
                for name, p in model.named_parameters():
                    fill(p.data, f"param/{name}")
            for name, b in model.named_buffers():
                fill(b, f"buffer/{name}")
        if optimizer is not None:
            _load_optimizer(optimizer, saved, entries, fill)
    except OSError as e:  # everything was checked: the disk failed part way
        raise CheckpointError(
            f"checkpoint {path}: {type(e).__name__} [{e.errno}] {e.strerror} while loading it, "
            "after the checks: the model and optimizer are now partly loaded; load it again "
            "once the disk is sound") from e
    return saved["extra"]


def _load_optimizer(optimizer: torch.optim.Optimizer, saved: dict[str, Any],
                    entries: dict[str, dict[str, Any]], fill: Any) -> None:
    scalars = saved["scalars"]

    def state_of(i: int) -> dict[str, Any] | None:
        prefix = f"optim/{i}/"
        st: dict[str, Any] = {k[len(prefix):]: v for k, v in scalars.items()
                              if k.startswith(prefix)}
        for key, e in entries.items():
            if key.startswith(prefix):
                t = torch.empty(e["shape"], dtype=DTYPES[e["dtype"]])
                fill(t, key)
                st[key[len(prefix):]] = t
        return st or None

    if isinstance(optimizer, PagedOptimizer):
        optimizer.states.load(saved["param_groups"], state_of, saved["loss_scale"])
    else:
        n = sum(len(g["params"]) for g in saved["param_groups"])
        state = {i: st for i in range(n) if (st := state_of(i)) is not None}
        optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})



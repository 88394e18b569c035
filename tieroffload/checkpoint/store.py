"""Checkpoints of the whole training state, from whatever tier it lives in, streamed one unit
(and one optimizer chunk) at a time, so a model larger than RAM can be saved and resumed.

A checkpoint is a directory: ``tensors.bin`` (raw bytes), ``manifest.json`` (for each tensor:
key, dtype, shape, offset, size and CRC-32) and ``extra.pt`` (optimizer hyperparameters, the
non-tensor state and the caller's ``extra``). It is written under a temporary name, fsynced and
renamed over the old one, so a failure (a full disk) leaves the previous checkpoint as it was.
Loading checks sizes and checksums of everything before it changes anything.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from typing import Any, BinaryIO

import torch
from torch import nn

from ..optim.paged import PagedOptimizer
from ..utils.dist import distributed

FORMAT = "tieroffload-checkpoint"
VERSION = 1
READ = 16 << 20


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated, corrupt, or does not fit the model."""


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


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(path: str | os.PathLike, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, extra: Any = None) -> None:
    """Saves parameters, buffers, optimizer state and ``extra`` (e.g. the scheduler's
    ``state_dict()`` and the step) into the directory ``path``. Under torch.distributed every
    rank calls it: each writes its own ``rank<r>/`` part, and rank 0 writes the one manifest
    and renames the whole into place once every rank has finished (or removes it if one
    failed)."""
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"checkpoint directory's parent does not exist: {parent}")
    dist = distributed()
    rank = dist.get_rank() if dist else 0
    token = [f"{path}.tmp-{os.getpid()}"]
    if dist:
        dist.broadcast_object_list(token, src=0)  # one temporary name for every rank
    tmp = token[0]
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    if dist:
        dist.barrier()
    part = os.path.join(tmp, f"rank{rank}") if dist else tmp
    try:
        os.makedirs(part, exist_ok=True)
        meta: Any = _write(part, model, optimizer, extra)
        _fsync_dir(part)
    except BaseException as e:
        meta = e
    metas = [meta]
    if dist:
        metas = [None] * dist.get_world_size()
        dist.all_gather_object(metas, meta if not isinstance(meta, BaseException)
                               else f"rank {rank}: {meta!r}")
    failed = [m for m in metas if not isinstance(m, dict)]
    try:
        if failed:
            raise meta if isinstance(meta, BaseException) else CheckpointError(
                f"checkpoint {path} not saved: {failed[0]}")
        if rank == 0:
            manifest = metas[0] if not dist else {
                "format": FORMAT, "version": VERSION, "world_size": len(metas), "ranks": metas}
            with open(os.path.join(tmp, "manifest.json"), "w") as f:
                json.dump(manifest, f)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            old = f"{path}.old-{os.getpid()}"
            if os.path.exists(path):
                os.rename(path, old)
            os.rename(tmp, path)
            _fsync_dir(parent)
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if dist:
            dist.barrier()  # nobody goes on before the checkpoint is in place


def _write(tmp: str, model: nn.Module, optimizer: torch.optim.Optimizer | None,
           extra: Any) -> dict[str, Any]:
    state = getattr(model, "_tieroffload", None)
    scalars: dict[str, Any] = {}
    loss_scale = None
    with open(os.path.join(tmp, "tensors.bin"), "wb") as f:
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
    torch.save({"param_groups": groups, "scalars": scalars, "loss_scale": loss_scale,
                "extra": extra},
               os.path.join(tmp, "extra.pt"))
    with open(os.path.join(tmp, "extra.pt"), "rb+") as f:
        os.fsync(f.fileno())
    return {"format": FORMAT, "version": VERSION, "size": size, "tensors": w.entries}


def _read_manifest(path: str) -> dict[str, Any]:
    mpath = os.path.join(path, "manifest.json")
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        with open(mpath) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint manifest {mpath} is missing or unreadable: {e}") from e
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"{mpath} is not a {FORMAT} version {VERSION}")
    if "ranks" not in meta:
        _check_size(path, meta)
    return meta


def _check_size(path: str, meta: dict[str, Any]) -> None:
    data = os.path.join(path, "tensors.bin")
    size = os.path.getsize(data) if os.path.exists(data) else -1
    if size != meta["size"]:
        raise CheckpointError(f"checkpoint data {data} is truncated: {size} bytes, the "
                              f"manifest says {meta['size']}")


def _verify(path: str, meta: dict[str, Any]) -> None:
    with open(os.path.join(path, "tensors.bin"), "rb") as f:
        for e in meta["tensors"]:
            f.seek(e["offset"])
            crc, left = 0, e["nbytes"]
            while left:
                block = f.read(min(READ, left))
                if not block:
                    break
                crc = zlib.crc32(block, crc)
                left -= len(block)
            if left or crc != e["crc32"]:
                raise CheckpointError(f"checkpoint {path} is corrupt: {e['key']} (bytes "
                                      f"{e['offset']}..{e['offset'] + e['nbytes']}) fails its "
                                      "checksum")


def load_checkpoint(path: str | os.PathLike, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> Any:
    """Restores what ``save_checkpoint`` saved into ``model`` (offloaded with any policy, or
    not) and ``optimizer``; returns ``extra``. Refuses a truncated or corrupt checkpoint, or one
    that does not fit the model, before changing anything."""
    path = os.path.abspath(os.fspath(path))
    meta = _read_manifest(path)
    if "ranks" in meta:  # saved by several ranks: this rank reads its own part
        dist = distributed()
        world = dist.get_world_size() if dist else 1
        if world != meta["world_size"]:
            raise CheckpointError(f"checkpoint {path} was saved by {meta['world_size']} ranks; "
                                  f"this run has {world}")
        rank = dist.get_rank()
        path = os.path.join(path, f"rank{rank}")
        meta = meta["ranks"][rank]
        _check_size(path, meta)
    _verify(path, meta)
    entries = {e["key"]: e for e in meta["tensors"]}
    try:
        saved = torch.load(os.path.join(path, "extra.pt"), weights_only=False)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: extra.pt is unreadable: {e}") from e
    state = getattr(model, "_tieroffload", None)
    params = ([(n, p) for u in state.units for n, p in zip(u.names, u.params)]
              if state is not None else list(model.named_parameters()))
    for kind, name, p in ([("param", n, p) for n, p in params]
                          + [("buffer", n, b) for n, b in model.named_buffers()]):
        e = entries.get(f"{kind}/{name}")
        if e is None:
            raise CheckpointError(f"checkpoint {path} has no {kind} {name!r}")
        if e["shape"] != list(p.shape) or e["dtype"] != str(p.dtype).removeprefix("torch."):
            raise CheckpointError(f"checkpoint {path}: {name} is {e['dtype']}{e['shape']}, the "
                                  f"model has {p.dtype}{list(p.shape)}")
    with open(os.path.join(path, "tensors.bin"), "rb") as f:
        def fill(t: torch.Tensor, key: str) -> None:
            e = entries[key]
            f.seek(e["offset"])
            host = torch.empty(t.shape, dtype=t.dtype)  # see _bytes
            f.readinto(memoryview(host.view(-1).view(torch.uint8).numpy()))
            t.copy_(host)

        with torch.no_grad():
            if state is not None:
                for u in state.units:
                    with state.resident([u], writeback=state.mover is not None):
                        for name, p in zip(u.names, u.params):
                            fill(p.data, f"param/{name}")
            else:
                for name, p in model.named_parameters():
                    fill(p.data, f"param/{name}")
            for name, b in model.named_buffers():
                fill(b, f"buffer/{name}")
        if optimizer is not None:
            _load_optimizer(optimizer, saved, entries, fill)
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
                t = torch.empty(e["shape"], dtype=getattr(torch, e["dtype"]))
                fill(t, key)
                st[key[len(prefix):]] = t
        return st or None

    if saved["param_groups"] is None:
        raise CheckpointError("checkpoint has no optimizer state")
    if isinstance(optimizer, PagedOptimizer):
        optimizer.load_groups(saved["param_groups"])
        if optimizer.scaler is not None and saved.get("loss_scale"):
            optimizer.scaler.load_state_dict(saved["loss_scale"])
        index = optimizer._index()
        for chunk in optimizer.chunks:
            optimizer.load_chunk(chunk, lambda p: state_of(index[id(p)]))
    else:
        n = sum(len(g["params"]) for g in saved["param_groups"])
        state = {i: st for i in range(n) if (st := state_of(i)) is not None}
        optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})

"""Streaming weights into an offloaded model, one shard and one unit at a time."""

from __future__ import annotations

import errno
import json
import os
import re
import reprlib
import stat
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from ..compat.tensors import version
from . import registry
from .state import OffloadState

Source = str | os.PathLike | dict[str, torch.Tensor] | Sequence[str | os.PathLike]


class IncompatibleKeys(NamedTuple):
    """What ``load_weights`` returns, as ``load_state_dict`` does: the model's parameters the
    weights lack, and the weights' keys the model does not have (empty unless strict=False)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


@dataclass(frozen=True)
class Shard:
    """A safetensors file to read: ``name`` in the folder open as ``folder_fd`` (found there or
    named by its index: never a symlink, never outside it), or, with ``folder_fd`` None, a path
    the user named (followed as given). Either way only a regular file is read."""

    folder_fd: int | None
    name: str
    path: Path

    def __str__(self) -> str:
        return str(self.path)

    def open(self) -> int:
        """A descriptor of the file, checked to be a regular file; O_NONBLOCK so that a FIFO
        fails here at once instead of hanging the open."""
        return _open_regular(self.folder_fd, self.name, self.path, "shard")


def _open_regular(folder_fd: int | None, name: str, path: Path, what: str) -> int:
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
    if folder_fd is not None:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(name, flags, dir_fd=folder_fd)
    except OSError as e:
        if e.errno == errno.ELOOP and folder_fd is not None:
            raise ValueError(f"load_weights: {what} {path} is a symlink; only regular files "
                             "inside the folder are read (pass the file itself)") from None
        raise OSError(e.errno, e.strerror, str(path)) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"load_weights: {what} {path} is not a regular file (a FIFO, a device "
                         "or a folder); refusing to read it")
    return fd


@contextmanager
def _safe_open(shard: Shard) -> Iterator[Any]:
    """safetensors' reader over the very file ``shard.open`` checked (through /proc/self/fd,
    which names that open file, not a path that could be swapped)."""
    from safetensors import safe_open

    fd = shard.open()
    try:
        with safe_open(f"/proc/self/fd/{fd}", framework="pt", device="cpu") as h:
            yield h
    finally:
        os.close(fd)


def _index_shards(folder_fd: int, folder: Path, index: Path, fd: int) -> list[Shard]:
    """The shards the index open as ``fd`` names: plain file names beside it, each once."""
    with os.fdopen(fd) as f:
        try:
            weight_map = json.load(f).get("weight_map")
        except (ValueError, AttributeError) as e:
            raise ValueError(f"load_weights: {index} is not a safetensors index "
                             f"({type(e).__name__}: {e})".splitlines()[0]) from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"load_weights: {index} has no weight_map")
    shards = []
    for name in dict.fromkeys(weight_map.values()):
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name \
                or "\0" in name:
            raise ValueError(f"load_weights: {index} names the shard {name!r}, which is not a "
                             f"file in {folder}; an index may name only files beside it")
        shards.append(Shard(folder_fd, name, folder / name))
    return shards


def shard_files(source: str | os.PathLike | Sequence[str | os.PathLike]
                ) -> tuple[list[Shard], int | None]:
    """The safetensors files of ``source`` and the descriptor of the folder they are read
    from (the caller closes it): a file, a directory (its ``*.safetensors.index.json`` when it
    has one, else every ``*.safetensors`` in it), an index file (the shards its ``weight_map``
    names, which must be files beside it) or a list of files."""
    if not isinstance(source, (str, os.PathLike)):
        files = [Shard(None, os.fspath(f), Path(f)) for f in source]
        if not files:
            raise ValueError("load_weights: the list of safetensors files is empty")
        return files, None
    path = Path(source)
    if not path.is_dir() and path.suffix != ".json":
        return [Shard(None, os.fspath(path), path)], None
    folder = path if path.is_dir() else path.parent
    folder_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if path.is_dir():
            names = sorted(os.listdir(folder_fd))
            index = [n for n in names if n.endswith(".safetensors.index.json")]
            if len(index) > 1:
                raise ValueError(f"load_weights: {path} has {len(index)} index files "
                                 f"({', '.join(index)}); pass the one to load")
            if index:
                fd = _open_regular(folder_fd, index[0], path / index[0], "index")
                return _index_shards(folder_fd, folder, path / index[0], fd), folder_fd
            files = [Shard(folder_fd, n, path / n) for n in names
                     if n.endswith(".safetensors") and not n.startswith(".")]
            if not files:
                raise FileNotFoundError(f"load_weights: {path} holds no *.safetensors file")
            return files, folder_fd
        fd = _open_regular(None, os.fspath(path), path, "index")
        return _index_shards(folder_fd, folder, path, fd), folder_fd
    except BaseException:
        os.close(folder_fd)
        raise


def _checked_source(source: Any) -> Source:
    """``source`` (an iterable of files as a list), or a one-line TypeError unless it is
    something ``load_weights`` reads."""
    if isinstance(source, (str, os.PathLike, dict)):
        return source
    files = list(source) if isinstance(source, Iterable) and \
        not isinstance(source, (bytes, bytearray)) else None
    if files is None or not all(isinstance(f, (str, os.PathLike)) for f in files):
        raise TypeError(f"load_weights: source must be a safetensors file, a folder, an index, "
                        f"a list of files or a state dict, not {type(source).__name__} "
                        f"({reprlib.repr(source)})")
    return files


def load_weights(model: nn.Module, source: Source, strict: bool = True) -> IncompatibleKeys:
    """Loads weights from safetensors (a file, a sharded directory, its index, or a list of
    shards) or a state dict, streamed one shard and one unit at a time into the tiers, so a
    model larger than RAM can be filled. A tied parameter loads under any of its names.
    Non-persistent buffers of a model built on the meta device are computed (a Hugging Face
    model's ``_init_weights``: rotary frequencies, position ids). Only regular files are read,
    and from a folder or an index only files in that folder, never through a symlink.
    Returns the missing and unexpected keys, as ``load_state_dict`` does."""
    source = _checked_source(source)
    s = registry.state_of(model)
    shards, folder_fd = ([], None) if isinstance(source, dict) else shard_files(source)
    try:
        return _load(model, s, source, shards, strict)
    finally:
        if folder_fd is not None:
            os.close(folder_fd)


def _load(model: nn.Module, s: OffloadState, source: Source, shards: list[Shard],
          strict: bool) -> IncompatibleKeys:
    names = _aliases(model)
    shapes: dict[str, tuple[int, ...]] = {}  # of every key, from the headers
    if isinstance(source, dict):
        plan = [(None, set(source))]
        # A mapping that makes its tensors as they are asked for (a subclass whose stored
        # values are not tensors) has each one's shape checked as it is read instead.
        shapes = {k: tuple(v.shape) for k, v in source.items() if isinstance(v, torch.Tensor)}
    else:
        plan = []
        seen: dict[str, Shard] = {}
        for f in shards:
            with _safe_open(f) as h:
                keys = set(h.keys())
                shapes.update((k, tuple(h.get_slice(k).get_shape())) for k in keys)
            for k in keys & seen.keys():
                raise ValueError(f"load_weights: {k!r} is in both {seen[k]} and {f}")
            seen.update(dict.fromkeys(keys, f))
            plan.append((f, keys))
    every = set().union(*(k for _, k in plan))
    missing = [n for u in s.units for n, p in zip(u.names, u.params)
               if not names.get(id(p), {n}) & every]
    if strict and missing:
        raise KeyError(f"weights are missing {len(missing)} parameters: {missing[:5]}")
    # Checked before any byte is written: a failure leaves the model as it was.
    known = {n for ns in names.values() for n in ns}
    known |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    ignored = [re.compile(r) for r in getattr(model, "_keys_to_ignore_on_load_unexpected",
                                              None) or ()]  # a Hugging Face model's
    unexpected = sorted(k for k in every - known if not any(r.search(k) for r in ignored))
    if strict and unexpected:
        raise KeyError(f"weights have {len(unexpected)} keys the model does not: "
                       f"{unexpected[:5]}")
    for u in s.units:
        for n, p in zip(u.names, u.params):
            for k in names.get(id(p), {n}) & every:
                if shapes.get(k, tuple(p.shape)) != tuple(p.shape):
                    raise ValueError(f"{k}: weights have shape {shapes[k]}, the model "
                                     f"{tuple(p.shape)}")
    for f, keys in plan:
        if f is None:
            _load_from(s, names, keys, source.__getitem__)
            continue
        with _safe_open(f) as h:  # one shard at a time
            _load_from(s, names, keys, h.get_tensor)
    _meta_buffers(model, s.device, plan, source if isinstance(source, dict) else None)
    return IncompatibleKeys(missing, unexpected)


def _aliases(model: nn.Module) -> dict[int, set[str]]:
    """Every name of each parameter (tied ones have several)."""
    names: dict[int, set[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), set()).add(n)
    return names


def _load_from(s: OffloadState, names: dict[int, set[str]], keys: set[str],
               get: Callable[[str], torch.Tensor]) -> None:
    for u in s.units:
        todo = [(min(found), p) for n, p in zip(u.names, u.params)
                if (found := names.get(id(p), {n}) & keys)]
        if not todo:
            continue
        s.before_write(u)
        with s.resident([u], writeback=s.mover is not None), torch.no_grad():
            for name, p in todo:
                t = get(name)
                if tuple(t.shape) != tuple(p.shape):  # copy_ would broadcast
                    raise ValueError(f"{name}: weights have shape {tuple(t.shape)}, the model "
                                     f"{tuple(p.shape)}")
                p.copy_(t)
            s.mark_loaded([p for _, p in todo])
            s.wrote(u)


def _meta_buffers(model: nn.Module, device: torch.device,
                  plan: list[tuple[Shard | None, set[str]]],
                  state_dict: dict[str, torch.Tensor] | None) -> None:
    """Gives the buffers still on the meta device their values: from the weights where they
    are there, else computed by a Hugging Face model's ``_init_weights``; raises naming one
    that is neither."""
    todo: dict[nn.Module, list[str]] = {}
    for mname, module in model.named_modules():
        for k, b in module._buffers.items():
            if b is None or b.device.type != "meta":
                continue
            name = f"{mname}.{k}" if mname else k
            where = next((f for f, keys in plan if name in keys), False)
            if where is False:
                todo.setdefault(module, []).append(k)
                continue
            t = torch.empty_like(b, device=device)
            if where is None:
                t.copy_(state_dict[name])
            else:
                with _safe_open(where) as h:
                    t.copy_(h.get_tensor(name))
            module._buffers[k] = t
    init = getattr(model, "_init_weights", None)
    for module, ks in todo.items():
        if callable(init):
            _init_buffers(init, module, ks, device)
    meta = [f"{m}.{k}" if m else k for m, mod in model.named_modules()
            for k, b in mod._buffers.items() if b is not None and b.device.type == "meta"]
    if meta:
        raise ValueError(f"load_weights: buffer {meta[0]!r} ({len(meta)} in all) is on the meta "
                         "device, not in the weights and not computed by the model's "
                         "_init_weights; fill it before use")


def _init_buffers(init: Callable[[nn.Module], None], module: nn.Module, ks: list[str],
                  device: torch.device) -> None:
    """Runs ``init`` on ``module`` with throwaway copies of its own parameters (their values
    are loaded, not initialised); keeps the buffers ``ks`` it wrote or replaced, and puts the
    others back on the meta device."""
    own = dict(module._parameters)
    metas = {k: module._buffers[k] for k in ks}
    fresh = {k: torch.empty_like(b, device=device) for k, b in metas.items()}
    versions = {k: version(t) for k, t in fresh.items()}
    module._buffers.update(fresh)
    try:
        for k, p in own.items():
            if p is not None:
                module._parameters[k] = nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device=device),
                    requires_grad=p.requires_grad)
        with torch.no_grad():
            init(module)
    finally:
        module._parameters.update(own)
        for k in ks:
            b = module._buffers.get(k)
            if b is fresh[k] and version(b) == versions[k]:
                module._buffers[k] = metas[k]  # not computed

"""Streaming weights into an offloaded model, one shard and one unit at a time."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from ..compat.tensors import version
from .state import OffloadState, _state

Source = str | os.PathLike | dict[str, torch.Tensor] | Sequence[str | os.PathLike]


def shard_files(source: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """The safetensors files of ``source``: a file, a directory (its
    ``*.safetensors.index.json`` when it has one, else every ``*.safetensors`` in it), an
    index file (the shards its ``weight_map`` names) or a list of files."""
    if not isinstance(source, (str, os.PathLike)):
        files = [Path(f) for f in source]
        if not files:
            raise ValueError("load_weights: the list of safetensors files is empty")
        return files
    path = Path(source)
    if path.is_dir():
        index = sorted(path.glob("*.safetensors.index.json"))
        if len(index) > 1:
            raise ValueError(f"load_weights: {path} has {len(index)} index files "
                             f"({', '.join(i.name for i in index)}); pass the one to load")
        if index:
            return shard_files(index[0])
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"load_weights: {path} holds no *.safetensors file")
        return files
    if path.suffix == ".json":
        with open(path) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"load_weights: {path} has no weight_map")
        return [path.parent / name for name in dict.fromkeys(weight_map.values())]
    return [path]


def load_weights(model: nn.Module, source: Source, strict: bool = True) -> None:
    """Loads weights from safetensors (a file, a sharded directory, its index, or a list of
    shards) or a state dict, streamed one shard and one unit at a time into the tiers, so a
    model larger than RAM can be filled. A tied parameter loads under any of its names.
    Non-persistent buffers of a model built on the meta device are computed (a Hugging Face
    model's ``_init_weights``: rotary frequencies, position ids)."""
    s = _state(model)
    names = _aliases(model)
    shapes: dict[str, tuple[int, ...]] = {}  # of every key, from the headers
    if isinstance(source, dict):
        plan = [(None, set(source))]
        # A mapping that makes its tensors as they are asked for (a subclass whose stored
        # values are not tensors) has each one's shape checked as it is read instead.
        shapes = {k: tuple(v.shape) for k, v in source.items() if isinstance(v, torch.Tensor)}
    else:
        from safetensors import safe_open

        plan = []
        seen: dict[str, Path] = {}
        for f in shard_files(source):
            with safe_open(os.fspath(f), framework="pt", device="cpu") as h:
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
        with safe_open(os.fspath(f), framework="pt", device="cpu") as h:  # one shard at a time
            _load_from(s, names, keys, h.get_tensor)
    _meta_buffers(model, s.device, plan, source if isinstance(source, dict) else None)


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


def _meta_buffers(model: nn.Module, device: torch.device, plan: list[tuple[Path | None, set[str]]],
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
                from safetensors import safe_open

                with safe_open(os.fspath(where), framework="pt", device="cpu") as h:
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

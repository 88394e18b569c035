"""What a checkpoint may hold: the manifest's and ``extra.pt``'s schema, and the optimizer
state and hyperparameters checked against the optimizer they are loaded into. Every check
runs before anything changes; any failure is a one-line ``CheckpointError`` naming the entry
(never a KeyError or TypeError from a field that is missing or of another type)."""

from __future__ import annotations

import re
from typing import Any

import torch

from ..optim.paged import PagedOptimizer
from ..optim.state_check import SAFE_NAME, Entry, check_plain

FORMAT = "tieroffload-checkpoint"
VERSION = 1
MAX_MANIFEST = 1 << 30  # bytes of manifest.json: about 5 M tensors
# The dtypes a checkpoint may hold: what parameters, buffers and optimizer state use.
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}
OPTIM_KEY = re.compile(r"optim/(0|[1-9][0-9]*)/(.*)\Z", re.S)
EXTRA_KEYS = ("param_groups", "scalars", "loss_scale", "extra")  # of extra.pt


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated, corrupt, malformed, or does not fit the model;
    or a path ``save_checkpoint`` must not write to."""


def _count(v: Any) -> bool:
    return type(v) is int and v >= 0


def check_manifest(meta: Any, where: str) -> None:
    """``meta`` (manifest.json of ``where``) is a whole manifest: this format and version,
    and either one part (see ``check_part``) or ``world_size`` parts under ``ranks``."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT \
            or meta.get("version") != VERSION:
        raise CheckpointError(f"{where} is not a {FORMAT} version {VERSION}")
    if "ranks" not in meta:
        check_part(meta, where)
        return
    world, ranks = meta.get("world_size"), meta["ranks"]
    if type(world) is not int or world < 1 or not isinstance(ranks, list) \
            or len(ranks) != world:
        raise CheckpointError(f"{where}: world_size {world!r:.20} with "
                              f"{len(ranks) if isinstance(ranks, list) else 'no'} ranks: "
                              "a multi-rank manifest needs one part per rank")
    for r, part in enumerate(ranks):
        check_part(part, f"{where} (rank {r})")


def check_part(meta: Any, where: str) -> None:
    """One rank's part: ``size`` of tensors.bin, ``extra`` (extra.pt's nbytes and crc32),
    ``tensors``: entries of a known key, dtype, shape, offset, nbytes and crc32, each key
    once. Sizes against the files are ``_check_size``'s."""
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where}: a part is a {type(meta).__name__}, not an object")
    if not _count(meta.get("size")):
        raise CheckpointError(f"{where}: 'size' is {meta.get('size')!r:.40}, not a byte count")
    extra = meta.get("extra")
    if extra is None:
        raise CheckpointError(f"{where} has no checksum of extra.pt (saved by an older "
                              "tieroffload): save it again")
    if not (isinstance(extra, dict) and _count(extra.get("nbytes"))
            and _count(extra.get("crc32"))):
        raise CheckpointError(f"{where}: 'extra' is {extra!r:.80}, not its nbytes and crc32")
    tensors = meta.get("tensors")
    if not isinstance(tensors, list):
        raise CheckpointError(f"{where}: 'tensors' is {type(tensors).__name__}, not a list")
    keys: set[str] = set()
    for e in tensors:
        key = e.get("key") if isinstance(e, dict) else None
        if not isinstance(key, str) or not _known_key(key):
            raise CheckpointError(f"{where}: manifest entry {e!r:.120} has no key of the form "
                                  "param/<name>, buffer/<name> or optim/<index>/<state name>")
        shape = e.get("shape")
        if not (e.get("dtype") in DTYPES if isinstance(e.get("dtype"), str) else False):
            raise CheckpointError(f"{where}: manifest entry {key} has dtype "
                                  f"{e.get('dtype')!r:.40}, not one of {sorted(DTYPES)}")
        if not (isinstance(shape, list) and all(_count(n) for n in shape)
                and all(_count(e.get(f)) for f in ("offset", "nbytes", "crc32"))):
            raise CheckpointError(f"{where}: manifest entry {key} is malformed: "
                                  f"{e!r:.160}")
        if key in keys:
            raise CheckpointError(f"{where}: {key} is in the manifest twice")
        keys.add(key)


def _known_key(key: str) -> bool:
    m = OPTIM_KEY.match(key)
    if m:
        return SAFE_NAME.match(m.group(2)) is not None
    kind, _, name = key.partition("/")
    return kind in ("param", "buffer") and bool(name)


def check_saved(saved: Any, where: str) -> None:
    """extra.pt holds a dict of ``param_groups`` (None, or a list: checked against the
    optimizer in ``check_optimizer``), ``scalars`` (optim/<index>/<name> -> a plain value),
    ``loss_scale`` (None or a dict) and ``extra`` (the caller's)."""
    if not isinstance(saved, dict) or set(saved) != set(EXTRA_KEYS):
        keys = sorted(map(str, saved)) if isinstance(saved, dict) else type(saved).__name__
        raise CheckpointError(f"checkpoint {where}: extra.pt holds {keys}, not "
                              f"{list(EXTRA_KEYS)}")
    if saved["param_groups"] is not None and not isinstance(saved["param_groups"], list):
        raise CheckpointError(f"checkpoint {where}: extra.pt's param_groups is a "
                              f"{type(saved['param_groups']).__name__}, not a list")
    if saved["loss_scale"] is not None and not isinstance(saved["loss_scale"], dict):
        raise CheckpointError(f"checkpoint {where}: extra.pt's loss_scale is a "
                              f"{type(saved['loss_scale']).__name__}, not a dict")
    scalars = saved["scalars"]
    if not isinstance(scalars, dict):
        raise CheckpointError(f"checkpoint {where}: extra.pt's scalars is a "
                              f"{type(scalars).__name__}, not a dict")
    for k, v in scalars.items():
        m = OPTIM_KEY.match(k) if isinstance(k, str) else None
        if m is None or not SAFE_NAME.match(m.group(2)):
            raise CheckpointError(f"checkpoint {where}: extra.pt's scalar {k!r:.60} is not "
                                  "optim/<index>/<state name>")
        if not (v is None or isinstance(v, (bool, int, float, str))):
            raise CheckpointError(f"checkpoint {where}: extra.pt's scalar {k} is a "
                                  f"{type(v).__name__}, not a number")


def optim_state(entries: dict[str, dict[str, Any]], scalars: dict[str, Any],
                where: str) -> dict[int, dict[str, Entry]]:
    """The saved optimizer state as ``state_check`` sees it: index -> name -> entry, from the
    manifest's tensors and extra.pt's scalars (a name in both is refused)."""
    state: dict[int, dict[str, Entry]] = {}
    for key, e in entries.items():
        if m := OPTIM_KEY.match(key):
            entry = Entry(tuple(e["shape"]), DTYPES[e["dtype"]])
            state.setdefault(int(m.group(1)), {})[m.group(2)] = entry
    for key, v in scalars.items():
        m = OPTIM_KEY.match(key)
        st = state.setdefault(int(m.group(1)), {})
        if m.group(2) in st:
            raise CheckpointError(f"checkpoint {where}: {key} is both a tensor and a scalar")
        st[m.group(2)] = Entry.of(v)
    return state


def check_optimizer(where: str, optimizer: torch.optim.Optimizer, saved: dict[str, Any],
                    entries: dict[str, dict[str, Any]]) -> None:
    """Refuses, before anything is written, optimizer state that does not fit ``optimizer``:
    none saved, other param groups, hyperparameters torch would not accept, state names the
    optimizer's class does not keep, or a state tensor of another shape or dtype than the one
    the optimizer keeps for that parameter (its own dtype, or fp32 where it has a master)."""
    groups = saved["param_groups"]
    if groups is None:
        raise CheckpointError(f"checkpoint {where} has no optimizer state; load it without the "
                              "optimizer")
    state = optim_state(entries, saved["scalars"], where)
    label = "optim/{}/{}".format
    try:
        if isinstance(optimizer, PagedOptimizer):
            optimizer.states.check(groups, state, saved["loss_scale"], label)
        else:
            check_plain(optimizer, groups, state, label)
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(f"checkpoint {where}: {e}") from e


def load_refusal(error: Exception) -> str:
    """One line saying why ``torch.load(weights_only=True)`` refused a file: the unpickler's
    reason (the type it will not build), without torch's advice and terminal colours."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("WeightsUnpickler error:"):
            return line.split(". Please use", 1)[0]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else type(error).__name__

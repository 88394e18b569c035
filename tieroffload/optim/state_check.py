"""What an optimizer may load: a state dict's structure, hyperparameters of the types torch
accepts, and state entries of the names, shapes and dtypes the optimizer's class keeps, all
checked before anything changes, so a load is all or nothing and a crafted state (``exp_avg``
as a scalar, which fused AdamW reads past) never reaches a kernel.

Errors are ``ValueError`` naming the entry (``state[3]['exp_avg']``,
``param_groups[0]['lr']``); the checkpoint layer re-raises them as ``CheckpointError``.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

# The step count torch keeps: fp32, or fp64 under torch.set_default_dtype(torch.float64).
STEP_DTYPES = (torch.float32, torch.float64)
# A scalar state entry of a class the project does not know: a count of some kind.
SCALAR_DTYPES = (torch.float32, torch.float64, torch.int64)
SAFE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*\Z")  # no "/", no "..", nothing empty


@dataclass(frozen=True)
class Entry:
    """One saved state value as the checks see it: a tensor's ``shape`` and ``dtype``, or
    (``shape`` None) a plain value."""

    shape: tuple[int, ...] | None
    dtype: torch.dtype | None = None
    value: Any = None

    @staticmethod
    def of(v: Any) -> Entry:
        if isinstance(v, torch.Tensor):
            return Entry(tuple(v.shape), v.dtype)
        return Entry(None, None, v)


def known_state(opt_cls: type, group: Mapping[str, Any]) -> dict[str, str] | None:
    """The state names a parameter stepped by ``opt_cls`` with ``group``'s hyperparameters
    has, each "step" (a scalar count) or "param" (the parameter's shape): all of them once it
    has stepped, none before. None for a class the project does not know."""
    if issubclass(opt_cls, (torch.optim.Adam, torch.optim.AdamW)):
        names = {"step": "step", "exp_avg": "param", "exp_avg_sq": "param"}
        if group.get("amsgrad"):
            names["max_exp_avg_sq"] = "param"
        return names
    if issubclass(opt_cls, torch.optim.SGD):
        return {"momentum_buffer": "param"} if group.get("momentum") else {}
    return None


def _plain(v: Any) -> bool:
    if isinstance(v, (list, tuple)):
        return all(_plain(x) for x in v)
    return v is None or isinstance(v, (bool, int, float, str))


def _number(v: Any) -> bool:
    """A finite int or float (not a bool), or a finite 0-dim floating tensor."""
    if isinstance(v, torch.Tensor):
        return v.dim() == 0 and v.is_floating_point() and bool(torch.isfinite(v))
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _like(saved: Any, own: Any, nullable: bool = False) -> bool:
    """``saved`` is of the kind torch accepts where the optimizer now has ``own`` (None too
    where the constructor's default is None: foreach, fused)."""
    if nullable and saved is None:
        return True
    if isinstance(own, bool):
        return isinstance(saved, bool)
    if own is None:  # foreach, fused: None or a choice
        return saved is None or isinstance(saved, bool)
    if _number(own):
        return _number(saved)
    if isinstance(own, (list, tuple)):
        return (isinstance(saved, (list, tuple)) and len(saved) == len(own)
                and all(_like(s, o) for s, o in zip(saved, own)))
    if isinstance(own, str):
        return isinstance(saved, str)
    return _plain(saved) or isinstance(saved, torch.Tensor)


def check_groups(opt_cls: type, defaults: Mapping[str, Any], own: list[dict[str, Any]],
                 saved: Any) -> None:
    """``saved`` param groups fit the optimizer's ``own``: as many, of as many parameters,
    numbered 0, 1, ... in order as torch's state_dict numbers them; every hyperparameter of
    ``defaults`` present, of the type torch accepts there, and accepted by ``opt_cls``'s own
    constructor (lr >= 0, betas in [0, 1), ...). Other keys (a scheduler's ``initial_lr``)
    must hold plain values."""
    if not isinstance(saved, list) or not all(isinstance(g, dict) for g in saved):
        raise ValueError(f"param_groups is a {type(saved).__name__}, not a list of dicts")
    sizes = [len(g["params"]) if isinstance(g.get("params"), list) else None for g in saved]
    if sizes != [len(g["params"]) for g in own]:
        raise ValueError(f"param_groups of {sizes} parameters; this optimizer has "
                         f"{[len(g['params']) for g in own]}")
    first = 0
    signature = inspect.signature(opt_cls.__init__).parameters
    accepted = set(signature)
    nullable = {k for k, a in signature.items() if a.default is None}
    required = {k for k, a in list(signature.items())[2:] if a.default is a.empty
                and a.kind in (a.POSITIONAL_OR_KEYWORD, a.KEYWORD_ONLY)}
    for gi, (g, mine) in enumerate(zip(saved, own)):
        n = len(mine["params"])
        if g["params"] != list(range(first, first + n)) or \
                not all(type(i) is int for i in g["params"]):
            raise ValueError(f"param_groups[{gi}]['params'] is not [{first}, ..., "
                             f"{first + n - 1}], the numbering torch's state_dict uses")
        first += n
        for k in defaults:
            if k not in g:
                raise ValueError(f"param_groups[{gi}] has no {k!r}, a hyperparameter of "
                                 f"{opt_cls.__name__}")
            if not _like(g[k], mine.get(k, defaults[k]), k in nullable):
                raise ValueError(f"param_groups[{gi}][{k!r}] is {g[k]!r:.60}, where "
                                 f"{opt_cls.__name__} takes a value like "
                                 f"{mine.get(k, defaults[k])!r:.60}")
        for k, v in g.items():
            if k != "params" and k not in defaults and not (isinstance(k, str) and _plain(v)):
                raise ValueError(f"param_groups[{gi}][{k!r}] is {type(v).__name__}, not a "
                                 "plain value")
        if not required <= set(defaults):
            continue  # a constructor that needs more than its hyperparameters: not run
        kwargs = {k: g[k] for k in defaults if k in accepted}
        try:  # torch's own checks of the values
            opt_cls([nn.Parameter(torch.zeros(1))], **kwargs)
        except Exception as e:
            raise ValueError(f"param_groups[{gi}] is refused by {opt_cls.__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e


def check_state(opt_cls: type, params: list[torch.Tensor], groups: list[dict[str, Any]],
                state: Mapping[Any, Mapping[str, Entry]],
                kept: Callable[[torch.Tensor], torch.dtype],
                label: Callable[[Any, str], str] = "state[{}][{!r}]".format) -> None:
    """Every saved state entry fits its parameter (index into ``params``, the optimizer's in
    order): an int index of a parameter; safe names; for a class the project knows (Adam,
    AdamW, SGD; see ``known_state``) exactly its names for the saved group's
    hyperparameters, all tensors: a scalar ``step`` of fp32/fp64, the rest of the
    parameter's shape and of the dtype the optimizer keeps (``kept(param)``). For another
    class: a scalar count, a tensor of the parameter's shape and kept dtype (or that shape less
one dimension: a factored moment), or a plain value.
    ``groups`` are the saved, already checked param groups; ``label(index, name)`` names an
    entry in errors."""
    group_of = [gi for gi, g in enumerate(groups) for _ in g["params"]]
    for i, st in state.items():
        if type(i) is not int or not 0 <= i < len(params):
            raise ValueError(f"{label(f'{i!r:.40}', '*')} is for no parameter of this optimizer "
                             f"({len(params)} parameters)")
        if not isinstance(st, Mapping):
            raise ValueError(f"{label(i, '*')} is a {type(st).__name__}, not a dict")
        p = params[i]
        want = kept(p)
        known = known_state(opt_cls, groups[group_of[i]])
        for name, e in st.items():
            where = label(i, f"{name:.40}" if isinstance(name, str) else repr(name)[:40])
            if not isinstance(name, str) or not SAFE_NAME.match(name):
                raise ValueError(f"{where} is not a state name (letters, digits, _ and .)")
            kind = known.get(name) if known is not None else None
            if known is not None and kind is None:
                raise ValueError(f"{where}: {opt_cls.__name__} keeps no such state (it keeps "
                                 f"{sorted(known) or 'none'} with these hyperparameters)")
            if e.shape is None:
                if known is not None or not _plain(e.value):
                    raise ValueError(f"{where} is a {type(e.value).__name__}, not a tensor")
                continue
            if kind == "step":
                if e.shape != () or e.dtype not in STEP_DTYPES:
                    raise ValueError(f"{where} is {_fmt(e)}; a step count is a scalar of "
                                     f"{[str(d) for d in STEP_DTYPES]}")
                continue
            if kind is None and e.shape == () and e.dtype in SCALAR_DTYPES:
                continue  # a count, for a class the project does not know
            if kind is None and _factor(e.shape, tuple(p.shape)) and e.dtype == want:
                continue  # a factored moment (Adafactor's rows or columns), of that class
            if e.shape != tuple(p.shape) or e.dtype != want:
                raise ValueError(f"{where} is {_fmt(e)}; this optimizer keeps "
                                 f"{str(want).removeprefix('torch.')}{list(p.shape)} for that "
                                 "parameter")
        if known is not None and st and set(st) != set(known):
            raise ValueError(f"{label(i, '*')} has {sorted(st)}; {opt_cls.__name__} keeps "
                             f"{sorted(known)} for a parameter that has stepped (or none)")


def check_plain(optimizer: torch.optim.Optimizer, groups: Any,
                state: Mapping[Any, Mapping[str, Entry]],
                label: Callable[[Any, str], str] = "state[{}][{!r}]".format) -> None:
    """``check_groups`` and ``check_state`` for a torch optimizer, whose state has the
    parameters' dtypes."""
    check_groups(type(optimizer), optimizer.defaults, optimizer.param_groups, groups)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    check_state(type(optimizer), params, groups, state, lambda p: p.dtype, label)


def _factor(shape: tuple[int, ...], of: tuple[int, ...]) -> bool:
    """``shape`` is ``of`` with one dimension left out (the row or column statistics of a
    factored second moment, as transformers' Adafactor keeps them)."""
    return len(shape) == len(of) - 1 and any(shape == of[:k] + of[k + 1:]
                                             for k in range(len(of)))


def _fmt(e: Entry) -> str:
    return f"{str(e.dtype).removeprefix('torch.')}{list(e.shape or ())}"


def check_loss_scale(own: Mapping[str, Any], saved: Any,
                     optional: frozenset[str] = frozenset()) -> None:
    """A saved loss scale has the keys of ``own`` (``LossScale.state_dict()``; those in
    ``optional`` may be missing, as in a dict saved before they were), each of its type, and
    a positive finite scale."""
    if not isinstance(saved, dict) or not set(own) - optional <= set(saved) <= set(own):
        raise ValueError(f"loss_scale is {saved!r:.80}, not a dict of {sorted(own)}")
    for k, v in saved.items():
        if type(v) is not type(own[k]) and not (isinstance(own[k], float)
                                                and type(v) is int):
            raise ValueError(f"loss_scale[{k!r}] is {v!r:.40}, not a {type(own[k]).__name__}")
    if not (math.isfinite(saved["scale"]) and saved["scale"] > 0):
        raise ValueError(f"loss_scale['scale'] is {saved['scale']!r}, not a positive number")

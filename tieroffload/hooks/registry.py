"""Which model has which ``OffloadState``: the one owner of that mapping (as FSDP2's
``_composable_state`` keeps one state per module). A model's state is ``model._tieroffload``
while it is offloaded; ``live`` holds every open state, for the process-wide hooks (a plain
optimizer's step, ``zero_grad``, clip) that must find the states of parameters they are
given. Attaching the first state puts tieroffload's patches of torch in place and detaching
the last takes them away (see ``patches``)."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from torch import nn

from . import patches

if TYPE_CHECKING:
    from .state import OffloadState

ATTR = "_tieroffload"  # the attribute of an offloaded model that holds its state
live: weakref.WeakSet[OffloadState] = weakref.WeakSet()  # every open OffloadState
_open: dict[int, weakref.finalize] = {}  # id(state) -> lets its patches go if it is collected


def states() -> list[OffloadState]:
    """Every open state, in a list (safe against one closing meanwhile)."""
    return list(live)


def find(model: nn.Module) -> OffloadState | None:
    """``model``'s state, or None where it is not offloaded."""
    return getattr(model, ATTR, None)


def state_of(model: nn.Module) -> OffloadState:
    """``model``'s state; raises where it is not offloaded."""
    state = find(model)
    if state is None:
        raise ValueError("model is not offloaded (call tieroffload.offload(model, policy))")
    return state


def check_free(model: nn.Module) -> None:
    """Refuses a model that is offloaded already, itself or through a module that contains
    one of its parameters (or that one of its modules contains)."""
    if find(model) is not None:
        raise ValueError("model is already offloaded; tieroffload.close(model) first")
    for name, p in model.named_parameters():
        if any(id(p) in s.param_unit for s in states()):
            raise ValueError(
                f"tieroffload.offload: parameter {name!r} is already offloaded with another "
                "module (one that contains this one, or one inside it): offload the whole "
                "model once, or tieroffload.close() that module first")


def attach(model: nn.Module, state: OffloadState) -> None:
    """Makes ``state`` the open state of ``model``."""
    setattr(model, ATTR, state)
    live.add(state)
    patches.model_opened()
    done = _open[id(state)] = weakref.finalize(state, _collected, id(state))
    done.atexit = False  # at exit, _close_all closes what is open


def forget(state: OffloadState) -> None:
    """``state`` is closed: no process-wide hook finds it any more (nothing if it was never
    attached, or is forgotten already)."""
    done = _open.pop(id(state), None)
    if done is not None and done.detach() is not None:
        live.discard(state)
        patches.model_closed()


def _collected(key: int) -> None:
    """A state dropped without ``close`` (its model collected): its patches are let go."""
    _open.pop(key, None)
    patches.model_closed()


def detach(model: nn.Module) -> None:
    """``model`` is a plain model again (its state closed)."""
    setattr(model, ATTR, None)


def state_of_module(module: nn.Module) -> OffloadState | None:
    """The open state whose model contains ``module``, if any."""
    return next((s for s in states() if id(module) in s.guards.module_ids), None)

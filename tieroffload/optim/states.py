"""The paged optimizer's state, read and replaced chunk by chunk: torch's state dicts, and the
chunk-state API that checkpoints use (``PagedOptimizer.states``), which never holds more than
one chunk's state in memory.

The API (a ``ChunkStates``, documented in docs/optimizer.md):

- ``chunks()``: one context per chunk; inside ``with part as entries`` the chunk's state is
  in memory and ``entries`` lists ``(index, state)`` for its parameters that have state
  (``index`` as in torch's state dict; ``state`` maps names to the live tensors and values,
  the fp32 master copy under ``"master"``). Valid inside the block only.
- ``groups()``: ``param_groups`` as torch's state dict has them (parameters as indices).
- ``loss_scale()``: the loss scale's state dict, or None without loss scaling. The loss scale
  (``scaler``) is the optimizer's own (``PagedOptimizer.scaler`` reads and sets this one).
- ``check(groups, state, loss_scale, label)``: raises ValueError naming the entry unless all
  of it can be loaded (``state``: index -> name -> ``state_check.Entry``).
- ``load(groups, state_of, loss_scale)``: replaces the hyperparameters, the loss scale (unless
  None) and each chunk's state with ``state_of(index)`` (None: no state), chunk by chunk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from .layout import Chunk, Layout
from .loss_scale import LossScale
from .pager import StatePager
from .state_check import Entry, check_groups, check_loss_scale, check_state

if TYPE_CHECKING:
    from .deferred import Updater
    from .in_backward import BackwardSteps


class ChunkStates:
    """The optimizer's state as torch's layout sees it, read and replaced one chunk at a time
    (see the module docstring for the API checkpoints use)."""

    def __init__(self, opt_cls: type[torch.optim.Optimizer], defaults: dict[str, Any],
                 layout: Layout, pager: StatePager, updater: Updater, backward: BackwardSteps,
                 scaler: LossScale | None) -> None:
        self.opt_cls, self.defaults = opt_cls, defaults
        self.layout = layout
        self.pager = pager
        self.updater = updater
        self.backward = backward
        self.scaler = scaler

    def chunks(self) -> list[ChunkState]:
        """One context per chunk, in order: the chunk's state is in memory (and up to date:
        its deferred update applied) inside it."""
        index = self.layout.index()
        return [ChunkState(self, c, index) for c in self.layout.chunks]

    def groups(self) -> list[dict[str, Any]]:
        """``param_groups`` as torch's state_dict has them (parameters as indices)."""
        index = self.layout.index()
        return [{**{k: v for k, v in g.items() if k != "params"},
                 "params": [index[id(p)] for p in g["params"]]} for g in self.layout.param_groups]

    def loss_scale(self) -> dict[str, Any] | None:
        return None if self.scaler is None else self.scaler.state_dict()

    def check(self, groups: Any, state: dict[Any, dict[str, Entry]], loss_scale: Any = None,
              label: Callable[[Any, str], str] = "state[{}][{!r}]".format) -> None:
        """Raises ValueError, naming the entry, unless ``groups`` (torch's param_groups layout),
        ``state`` (index -> name -> entry) and ``loss_scale`` can all be loaded: see
        ``state_check``. A ``master`` entry (an fp32 copy of an fp16/bf16 parameter) only
        for a parameter that has one here, of its shape. ``label(index, name)`` names an
        entry in errors."""
        param_groups = self.layout.param_groups
        check_groups(self.opt_cls, self.defaults, param_groups, groups)
        params = [p for g in param_groups for p in g["params"]]
        masters = {id(c.params[i]) for c in self.layout.chunks for i in c.masters}
        own: dict[Any, dict[str, Entry]] = {}
        for i, st in state.items():
            if isinstance(st, dict) and "master" in st:
                e = st["master"]
                p = params[i] if type(i) is int and 0 <= i < len(params) else None
                if p is None or id(p) not in masters or e.shape != tuple(p.shape) \
                        or e.dtype != torch.float32:
                    raise ValueError(f"{label(f'{i!r:.40}', 'master')} is no fp32 master copy "
                                     "of an fp16/bf16 parameter of this optimizer")
                st = {k: v for k, v in st.items() if k != "master"}
            own[i] = st
        check_state(self.opt_cls, params, groups, own,
                    lambda p: torch.float32 if id(p) in masters else p.dtype, label)
        if loss_scale is not None and self.scaler is not None:
            check_loss_scale(self.scaler.state_dict(), loss_scale, self.scaler.optional)

    def load(self, groups: list[dict[str, Any]], state_of: Callable[[int], dict | None],
             loss_scale: dict[str, Any] | None) -> None:
        """Loads what ``check`` passed: the groups' hyperparameters, the loss scale (unless
        None), then each chunk's state, one chunk in memory at a time (see ``replace``)."""
        self._load_groups(groups)
        if self.scaler is not None and loss_scale is not None:
            self.scaler.load_state_dict(loss_scale)
        self._replace_all(state_of)

    def state_dict(self) -> dict[str, Any]:
        """The torch layout ({"state", "param_groups"}), with copies of the state tensors."""
        self.updater.settle()
        state: dict[int, dict[str, Any]] = {}
        for part in self.chunks():
            with part as entries:
                for i, st in entries:
                    state[i] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                for k, v in st.items()}
        sd = {"state": state, "param_groups": self.groups()}
        if self.scaler is not None:
            sd["loss_scale"] = self.scaler.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """See ``PagedOptimizer.load_state_dict``."""
        self.updater.settle()
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict) \
                or "param_groups" not in state_dict:
            raise ValueError("optimizer state dict must be a dict with 'state' (a dict) and "
                             "'param_groups', as state_dict() makes it")
        saved = state_dict["state"]
        self.check(state_dict["param_groups"],
                   {i: {k: Entry.of(v) for k, v in st.items()}
                    if isinstance(st, dict) else st for i, st in saved.items()},
                   state_dict.get("loss_scale"))
        self._load_groups(state_dict["param_groups"])
        if self.scaler is not None and "loss_scale" in state_dict:
            self.scaler.load_state_dict(state_dict["loss_scale"])
        self._replace_all(saved.get)

    def _load_groups(self, groups: list[dict[str, Any]]) -> None:
        """Takes the hyperparameters of saved ``param_groups``, checked by ``check``."""
        self.backward.torn = []  # every chunk's state and parameters come from what is loaded
        for g, saved in zip(self.layout.param_groups, groups):
            g.update({k: v for k, v in saved.items() if k != "params"})

    def _replace_all(self, state_of: Callable[[int], dict | None]) -> None:
        index = self.layout.index()
        for chunk in self.layout.chunks:
            self.pager.replace(chunk, lambda p: state_of(index[id(p)]))


class ChunkState:
    """One chunk's state for ``with``: in memory inside the block, as ``(index, state)`` of
    its parameters that have state; its deferred update is applied first."""

    def __init__(self, states: ChunkStates, chunk: Chunk, index: dict[int, int]) -> None:
        self.states, self.chunk, self.index = states, chunk, index

    def __enter__(self) -> list[tuple[int, dict[str, Any]]]:
        self.states.updater.settle(self.chunk.units)
        self.block = self.states.pager.resident(self.chunk)
        self.block.__enter__()
        return [(self.index[id(p)], st) for p, st in self.chunk.entries()]

    def __exit__(self, *exc: object) -> None:
        self.block.__exit__(*exc)

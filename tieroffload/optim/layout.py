"""The paged optimizer's chunks: the parameters of a few consecutive units each, with an inner
optimizer of the user's class over them, and the index from units and parameters to them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..compat.tensors import version
from ..core.mover import Ticket
from ..core.units import Unit

if TYPE_CHECKING:
    from ..hooks.state import OffloadState

CHUNK_BYTES = 16 << 20  # parameters per chunk, at least one unit


class Chunk:
    """One chunk: its parameters and units, and the inner optimizer that steps them. Its other
    fields belong to one part each: ``masters``, ``writes``, ``versions``, ``host_grads`` and
    ``grads_event`` to ``HostStep``; ``state_unit``, ``pending`` and ``keep`` to
    ``StatePager``."""

    def __init__(self, params: list[nn.Parameter], units: list[Unit],
                 masters: dict[int, nn.Parameter]) -> None:
        self.params = params
        self.units = units
        self.masters = masters  # fp32 host copies of the parameters that need one, by position
        # What the masters have seen: the units' outside writes, the parameters' versions.
        self.writes = {u.id: u.writes for u in units}
        self.versions = {i: version(params[i]) for i in masters}
        # Their gradients, copied to the host for the next update (None: not taken yet).
        self.host_grads: dict[int, torch.Tensor] | None = None
        self.grads_event: Any = None  # the last of those copies
        self.inner: Any = None
        self.group_of: list[int] = []  # outer group index of each inner group
        self.state_unit: Unit | None = None  # the chunk's state tensors, once they exist
        self.pending: Ticket | None = None   # a load or store on its way
        self.keep = False  # wanted again while its store is on its way: stays when written

    def inner_param(self, i: int) -> nn.Parameter:
        """What the inner optimizer steps: the master copy, or the parameter itself."""
        return self.masters.get(i, self.params[i])

    def entries(self) -> list[tuple[nn.Parameter, dict[str, Any]]]:
        """Each parameter of the chunk with its state (the master copy under "master")."""
        out = []
        for i, p in enumerate(self.params):
            q = self.inner_param(i)
            st = dict(self.inner.state.get(q, {})) if self.inner is not None else {}
            if q is not p:
                st["master"] = q.data
            if st:
                out.append((p, st))
        return out

    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors to page: the state's own objects (and the master parameters), whose
        storage paging may replace."""
        out = []
        names = {id(p): n for u in self.units for n, p in zip(u.names, u.params)}
        for i, p in enumerate(self.params):
            q = self.inner_param(i)
            st = dict(self.inner.state.get(q, {}))
            if q is not p:
                st["master"] = q
            out += [(f"{names.get(id(p), i)} {k}", t) for k, t in sorted(st.items())
                    if isinstance(t, torch.Tensor)]
        return out


class Layout:
    """Which chunk steps what: the chunks in the model's unit order, the chunk of each unit,
    each parameter's index in state dicts, and the outer groups' hyperparameters given to the
    chunks' inner groups."""

    def __init__(self, param_groups: list[dict[str, Any]], chunks: list[Chunk]) -> None:
        self.param_groups = param_groups  # the outer optimizer's own list (fixed once built)
        self.chunks = chunks
        self.unit_chunk = {u.id: i for i, c in enumerate(chunks) for u in c.units}

    def index(self) -> dict[int, int]:
        """Parameter id -> its index in torch's state dict layout."""
        return {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    def units(self) -> list[Unit]:
        return [u for c in self.chunks for u in c.units]

    def holding(self, units: list[Unit]) -> set[int]:
        """The chunks that hold any of ``units``."""
        return {self.unit_chunk[u.id] for u in units if u.id in self.unit_chunk}

    def owns(self, params: list[torch.Tensor]) -> bool:
        """True when every one of ``params`` is stepped by a chunk."""
        mine = {id(p) for c in self.chunks for p in c.params}
        return all(id(p) in mine for p in params)

    def hyperparameters(self) -> list[dict[str, Any]]:
        """The groups' hyperparameters as they are now: tensors (an lr a scheduler fills in
        place after step()) copied, for an update that runs later."""
        return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in g.items()
                 if k != "params"} for g in self.param_groups]

    def sync_groups(self, chunk: Chunk, groups: list[dict[str, Any]] | None = None) -> None:
        """Gives the chunk's inner groups the hyperparameters of ``groups`` (default: the
        outer groups' own values, for an update that runs now)."""
        for inner_group, gi in zip(chunk.inner.param_groups, chunk.group_of):
            for k, v in (groups or self.param_groups)[gi].items():
                if k != "params":
                    inner_group[k] = v


def local_params(offload: OffloadState, model: nn.Module, params: list | None) -> list:
    """The parameters (or param groups) to step, with FSDP's DTensor parameters replaced
    by their local shards."""
    local = offload.local
    out: list = []
    for x in list(model.parameters()) if params is None else params:
        if isinstance(x, dict):
            ps = x["params"]
            ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
            out.append({**x, "params": [local(p) for p in ps]})
        else:
            out.append(local(x))
    return out


def build_chunks(offload: OffloadState, param_groups: list[dict[str, Any]],
                 opt_cls: type[torch.optim.Optimizer], kwargs: dict[str, Any],
                 make_masters: Callable[[list[nn.Parameter], list[Unit]], dict[int, nn.Parameter]],
                 put_away: Callable[[Chunk], None]) -> list[Chunk]:
    """The chunks over the groups' parameters, along the model's units, at most
    ``CHUNK_BYTES`` (a quarter of the budget where parameters are paged) but one unit each;
    their masters are taken now (``make_masters``) and paged out to their tier at once
    (``put_away``)."""
    group_index = {id(p): gi for gi, g in enumerate(param_groups) for p in g["params"]}
    order: list[list[nn.Parameter]] = []
    units: list[list[Unit]] = []
    limit = min(CHUNK_BYTES, offload.budget // 4) if offload.mover else CHUNK_BYTES
    size = limit + 1
    seen: set[int] = set()
    for u in offload.units:
        ps = [p for p in u.params if id(p) in group_index and id(p) not in seen]
        if not ps:
            continue
        seen.update(id(p) for p in ps)
        if size + u.nbytes > limit:
            order.append([])
            units.append([])
            size = 0
        order[-1] += ps
        units[-1].append(u)
        size += u.nbytes
    chunks = []
    for ps, us in zip(order, units):
        chunk = Chunk(ps, us, make_masters(ps, us))
        groups = []
        for gi, g in enumerate(param_groups):
            mine = [chunk.inner_param(i) for i, p in enumerate(ps) if group_index[id(p)] == gi]
            if mine:
                groups.append({**{k: v for k, v in g.items() if k != "params"},
                               "params": mine})
                chunk.group_of.append(gi)
        chunk.inner = opt_cls(groups, **kwargs)
        chunk.inner._tieroffload_inner = True  # a chunk: no over-budget warning for it
        chunks.append(chunk)
        put_away(chunk)  # the master copies go to their tier at once
    return chunks


def state_bytes(chunk: Chunk, opt_cls: type[torch.optim.Optimizer],
                param_groups: list[dict[str, Any]]) -> int:
    """Bytes of the chunk's state once stepped: two fp32 slots per element (Adam's moments;
    one for SGD with momentum, none without), its fp32 masters, a step count each."""
    momentum = any(g.get("momentum", 0) for g in param_groups)
    slots = (1 if momentum else 0) if issubclass(opt_cls, torch.optim.SGD) else 2
    n = 0
    for i, p in enumerate(chunk.params):
        n += (slots + (i in chunk.masters)) * p.numel() * 4 + 64
    return n

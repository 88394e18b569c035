"""The paged optimizer: optimizer state lives in its tier (RAM or NVMe) and streams through the
step chunk by chunk, so Adam's 8 bytes of state per parameter never have to fit at once.

Each chunk (the parameters of a few consecutive units) has an inner optimizer of the user's class
and arguments, so the update is exactly what that torch optimizer computes (Adam and AdamW use
PyTorch's fused CPU kernel unless told otherwise). The outer object is a ``torch.optim.Optimizer``
whose ``param_groups`` are the ones users and ``lr_scheduler`` change; their values are copied
into the chunks before each step. On NVMe the state of chunk i+1 is read while chunk i is
updated, and chunk i is written back while chunk i+1 is.
"""

from __future__ import annotations

import atexit
import inspect
import weakref
from collections.abc import Iterable, MutableMapping
from typing import Any, Callable

import torch
from torch import nn

from ..aio.pages import PagePool
from ..aio.swap import SwapSpace, stable_tag
from ..compat.tensors import add_grad_norms, clip_coefficient, total_norm, version
from ..core.devices import HostBuffers, Transfers
from ..core.homes import NvmeHome
from ..core.mover import NBUF, Mover, Ticket, timed_wait
from ..core.units import State, Unit
from ..hooks.state import OffloadState, _state
from ..utils.dist import world_size
from .hyper import HyperCheck
from .loss_scale import LossScale
from .state_check import Entry, check_groups, check_loss_scale, check_state

CHUNK_BYTES = 16 << 20  # parameters per chunk, at least one unit

_live: weakref.WeakSet[PagedOptimizer] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for opt in list(_live):
        opt.close()


LOW_PRECISION = (torch.float16, torch.bfloat16)


class _Chunk:
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


class _StateElsewhere(MutableMapping):
    """``opt.state`` of a paged optimizer: its state lives chunk by chunk in its tier, so a
    read would find nothing and a write (a moment reset) would change nothing; both raise."""

    def __init__(self, tier: str) -> None:
        self.tier = tier

    def _refuse(self, *args: Any) -> Any:
        raise RuntimeError(
            f"tieroffload: a paged optimizer keeps its state chunk by chunk in its tier "
            f"(optimizer={self.tier!r}), not in opt.state: read it with opt.state_dict(), "
            "change it with opt.load_state_dict(sd)")

    __getitem__ = __setitem__ = __delitem__ = __iter__ = __len__ = __contains__ = _refuse


class PagedOptimizer(torch.optim.Optimizer):
    """See the module docstring; build it with ``tieroffload.optimizer``."""

    _tieroffload_paged = True  # the plain-optimizer hooks of offload() leave this one alone

    @property
    def state(self) -> MutableMapping:
        return _StateElsewhere(self.offload.policy.optimizer)

    @state.setter
    def state(self, value: Any) -> None:
        if "_ids" in self.__dict__:  # built: torch.optim.Optimizer.__init__ sets it first
            _StateElsewhere(self.offload.policy.optimizer)._refuse()

    def __init__(self, model: nn.Module, opt_cls: type[torch.optim.Optimizer],
                 params: Iterable | None, kwargs: dict[str, Any],
                 loss_scale: str | float | None = "auto", overlap: bool | str = True,
                 accumulation_steps: int = 1) -> None:
        self.offload: OffloadState = _state(model)
        policy = self.offload.policy
        self.tier = policy.optimizer
        device = self.offload.device
        # The host step: CUDA compute, the state and fp32 masters in host RAM or on NVMe.
        self.host_step = self.tier != "gpu" and device.type == "cuda"
        if self.tier == "gpu" and device.type != "cuda":
            raise ValueError('optimizer="gpu" needs a CUDA compute device')
        self.host = torch.device("cpu") if self.tier != "gpu" else device
        self.xfer = Transfers(device)
        kwargs = dict(kwargs)
        if opt_cls in (torch.optim.Adam, torch.optim.AdamW) and not (
                {"fused", "foreach", "differentiable"} & set(kwargs)):
            kwargs["fused"] = True
        hyper = HyperCheck(opt_cls, kwargs, self.host)
        super().__init__(self._local_params(model, params), dict(hyper.opt.defaults))
        self.hyper = hyper  # refuses at step() what opt_cls's step would refuse later
        self._ids = frozenset(id(p) for g in self.param_groups for p in g["params"])
        self._check_in_model()
        if self.offload.grads is not None:
            self._check_whole_units()
        self.opt_cls, self.kwargs = opt_cls, kwargs
        self.swap: SwapSpace | None = None
        self.mover = self.offload.mover
        self._owned: list[Any] = []  # engine, mover and swap made here, closed by close()
        # Pages of a chunk's state written out, for the next chunk read: one chunk at most.
        self.pool = PagePool(0)
        self._writing: list[_Chunk] = []  # chunks whose state is being written, oldest first
        if self.tier == "nvme":
            engine = self.offload.engine
            if self.mover is None or self.host_step:
                # Not offloaded, or a host state (its mover moves host memory): our own.
                if engine is None:
                    engine = policy.io.engine()
                    self._owned.append(engine)
                self.mover = Mover(self.host, CHUNK_BYTES, NBUF, self.offload.stats,
                                   checksum=policy.checksum)
                self._owned.append(self.mover)
            self.swap = self.offload.swap
            if self.swap is None:
                self.swap = self._own_swap(model, engine)
                self._owned.insert(0, self.swap)
        self.chunks = self._build_chunks()
        self._host_buffers()
        fp16 = any(p.dtype == torch.float16 for c in self.chunks for p in c.params)
        if loss_scale == "auto":
            loss_scale = "dynamic" if fp16 else None
        if loss_scale not in (None, "dynamic"):
            if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) \
                    or not 1.0 <= loss_scale <= 2.0**64:
                raise ValueError(f'loss_scale must be "auto", "dynamic", None or a number from 1 '
                                 f"to 2**64 (a power of two keeps it exact), not {loss_scale!r}")
        self.scaler = (None if loss_scale is None else LossScale() if loss_scale == "dynamic"
                       else LossScale(float(loss_scale), dynamic=False))
        if overlap not in (True, False, "backward"):
            raise ValueError(f'overlap must be True, False or "backward", not {overlap!r}')
        if overlap == "backward" and (self.scaler is not None or self.offload.shards
                                      or world_size() > 1):
            raise ValueError(
                'overlap="backward" steps each chunk as soon as its gradients are final, so it '
                "cannot wait for a check of every gradient (fp16 loss scaling) or for other "
                "ranks' gradients (DDP, FSDP): use overlap=True")
        if not (isinstance(accumulation_steps, int) and accumulation_steps >= 1):
            raise ValueError(f"accumulation_steps must be an int >= 1, not {accumulation_steps!r}")
        if accumulation_steps != 1 and overlap != "backward":
            raise ValueError(
                'accumulation_steps is for overlap="backward", which must know which backward '
                "is the last before step(); otherwise gradients accumulate until step() anyway")
        self.accumulation_steps = accumulation_steps
        self._backwards = 0  # overlap="backward": backward passes begun since the last step()
        # Deferred steps (see step): only where the parameters are paged, so that nothing
        # reads them between step() and the next use, which applies the update first.
        self.overlap = overlap if overlap == "backward" else (
            overlap and self.offload.mover is not None)
        self._ready: dict[int, set[int]] = {}  # overlap="backward": chunk -> units with grads
        self._stepped: set[int] = set()  # overlap="backward": chunks stepped this backward
        self._stepped_at = 0  # the backward (its count) in which they stepped
        # overlap="backward": the forward before a stepping backward reads the state of the
        # chunks from this index on as it reaches them (see _window_start)
        self._tail: int | None = None
        self._used: list[dict[str, Any]] | None = None  # the hyperparameters they stepped with
        self._writing_own = False  # an in-backward step writes its chunk's parameters
        self._scaled = False  # scale_loss was called since the last step() or zero_grad()
        # A step() let gradients go (p.grad is None after it) and no zero_grad() came since:
        # PyTorch would add the next backward's gradients to those (see check_zeroed).
        self._unzeroed = False
        self._torn: list[int] = []  # chunks stepped by a backward that then raised
        # A state store that failed inside backward, after chunks had stepped: raised by the
        # next step(), which a retry redoes whole (the state stays resident until written).
        self._failed_store: BaseException | None = None
        self._pending: dict[int, list[torch.Tensor | None] | None] = {}  # chunk -> its grads
        self._pending_scale: float | None = None
        # zero_grad(set_to_none=False): plain PyTorch keeps a zero p.grad for every parameter
        # that had one, and steps it (weight decay, moments) in a step where it gets no
        # gradient; here p.grad is None after a step, so those are filled with zeros.
        self._had_grad: set[int] = set()  # got a gradient since zero_grad(set_to_none=True)
        self._fill: frozenset[int] = frozenset()  # would hold a zero p.grad now
        self._pending_fill: frozenset[int] = frozenset()  # _fill of the deferred step
        self._clips: list[torch.Tensor] = []  # clip_grad_norm_ factors of paged gradients
        self._pending_clips: list[torch.Tensor] = []  # those of the deferred updates
        self._settling = False
        self._resume = False  # a step failed part way: its other chunks wait in _pending
        self._unit_chunk = {u.id: i for i, c in enumerate(self.chunks) for u in c.units}
        if self.tier == "nvme":
            try:  # a full disk fails here, not in the middle of a step
                self.swap.reserve([self._state_bytes(c) for c in self.chunks])
            except BaseException:
                self.close()
                raise
        _live.add(self)
        self.offload.optimizers.add(self)

    def _state_bytes(self, chunk: _Chunk) -> int:
        """Bytes of the chunk's state once stepped: two fp32 slots per element (Adam's moments;
        one for SGD with momentum, none without), its fp32 masters, a step count each."""
        momentum = any(g.get("momentum", 0) for g in self.param_groups)
        slots = (1 if momentum else 0) if issubclass(self.opt_cls, torch.optim.SGD) else 2
        n = 0
        for i, p in enumerate(chunk.params):
            n += (slots + (i in chunk.masters)) * p.numel() * 4 + 64
        return n

    def _check_in_model(self) -> None:
        """It steps the model's parameters chunk by chunk along its units: one from elsewhere
        (a loss temperature) would never be stepped, so it is refused."""
        seen: set[int] = set()
        for gi, g in enumerate(self.param_groups):
            for i, p in enumerate(g["params"]):
                where = (f"tieroffload.optimizer: parameter {i} of param group {gi} (shape "
                         f"{tuple(p.shape)}, {p.dtype})")
                if id(p) in seen:
                    raise ValueError(f"{where} is listed twice; torch would step it twice (and "
                                     "deprecates it): list each parameter once")
                seen.add(id(p))
                if id(p) not in self.offload.param_unit:
                    raise ValueError(
                        f"{where} is not a parameter of the offloaded model, and the paged "
                        "optimizer steps only the model's; step it with a torch.optim "
                        "optimizer of its own")

    def _check_whole_units(self) -> None:
        """Paged gradients are stored, read back and used up a unit (module) at a time: one
        paged optimizer steps all of a module's trainable parameters or none."""
        for u in self.offload.units:
            if not any(id(p) in self._ids for p in u.params):
                continue
            other = [n for n, p in zip(u.names, u.params)
                     if p.requires_grad and id(p) not in self._ids]
            if other:
                raise ValueError(
                    f"tieroffload.optimizer: module {u.name!r} has parameters this optimizer "
                    f"steps and {len(other)} trainable one(s) it does not ({other[0]!r}); with "
                    f"gradients paged (grads={self.offload.policy.grads!r}) a module's "
                    "gradients are stored and used up together, so one paged optimizer steps "
                    "all of them: give different settings (lr, weight_decay) by param groups")

    def _local_params(self, model: nn.Module, params: list | None) -> list:
        """The parameters (or param groups) to step, with FSDP's DTensor parameters replaced
        by their local shards."""
        local = self.offload.local
        out: list = []
        for x in list(model.parameters()) if params is None else params:
            if isinstance(x, dict):
                ps = x["params"]
                ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
                out.append({**x, "params": [local(p) for p in ps]})
            else:
                out.append(local(x))
        return out

    _closed = False  # set by close(): from then on every use is refused (_check_open)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                "tieroffload: this paged optimizer is closed (opt.close(), or "
                "tieroffload.close(model)) and its state is gone: take opt.state_dict() before "
                "closing (a torch optimizer loads it), and make a new one with "
                "tieroffload.optimizer(model, ...) to train offloaded again")

    def close(self, apply: bool = True) -> None:
        """Applies what a step() left deferred (it is the model's; not with ``apply=False``,
        as when the model is closed without restoring it), then deletes the swap space this
        optimizer made (the state in it is lost) and leaves the model. A second close does
        nothing; any other use after it raises."""
        if self._closed:
            return
        self._closed = True
        try:
            if apply:
                self.settle()
            self._drain()
        finally:
            self.offload.pending_opts.discard(self)
            self.offload.optimizers.discard(self)
            for thing in self._owned:
                thing.close()
            self._owned.clear()
            self.pool.clear()
            for bufs in (self.grad_bufs, self.copy_bufs):
                if bufs is not None:
                    bufs.close()
            _live.discard(self)

    def held(self) -> dict[str, tuple[list[tuple[int, int]], int]]:
        """Host memory it holds, by kind, as (ranges it mapped, bytes from malloc):
        "optimizer" the chunks' state and masters, "staging" its own mover's buffers and the
        host step's, "parked" the pages kept for the next chunk read."""
        ranges, heap = [], 0
        for c in self.chunks:
            if c.state_unit is not None:
                r, h = c.state_unit.held()
            else:
                r, h = [], sum(t.untyped_storage().nbytes() for _, t in self._state_tensors(c)
                               if t.device.type == "cpu")
            ranges += r
            heap += h
        staging = [r for b in (self.grad_bufs, self.copy_bufs) if b is not None for r in b.held()]
        if self.mover is not None and self.mover in self._owned:
            staging += self.mover.held()
        return {"optimizer": (ranges, heap), "staging": (staging, 0),
                "parked": (list(self.pool.ranges), 0)}

    def _own_swap(self, model: nn.Module, engine: Any) -> SwapSpace:
        names = [n for n, _ in model.named_parameters()]
        nvme_dir = self.offload.policy.nvme_dir
        if not nvme_dir:
            raise ValueError('optimizer="nvme" needs nvme_dir in the policy')
        return SwapSpace(nvme_dir, 0, stable_tag(names) + "-optim", engine)

    def _build_chunks(self) -> list[_Chunk]:
        group_index = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        order: list[list[nn.Parameter]] = []
        units: list[list[Unit]] = []
        limit = min(CHUNK_BYTES, self.offload.budget // 4) if self.offload.mover else CHUNK_BYTES
        size = limit + 1
        seen: set[int] = set()
        for u in self.offload.units:
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
            masters: dict[int, nn.Parameter] = {}
            if any(self._needs_master(p) for p in ps):
                with self.offload.resident(us):
                    masters = {i: nn.Parameter(p.detach().to(self.host, torch.float32, copy=True),
                                               requires_grad=p.requires_grad)
                               for i, p in enumerate(ps) if self._needs_master(p)}
            chunk = _Chunk(ps, us, masters)
            groups = []
            for gi, g in enumerate(self.param_groups):
                mine = [chunk.inner_param(i) for i, p in enumerate(ps) if group_index[id(p)] == gi]
                if mine:
                    groups.append({**{k: v for k, v in g.items() if k != "params"},
                                   "params": mine})
                    chunk.group_of.append(gi)
            chunk.inner = self.opt_cls(groups, **self.kwargs)
            chunk.inner._tieroffload_inner = True  # a chunk: no over-budget warning for it
            chunks.append(chunk)
            self._page_out(chunk)  # the master copies go to their tier at once
            self._wait(chunk)
        return chunks

    def _needs_master(self, p: torch.Tensor) -> bool:
        """An fp32 copy where the optimizer steps: for fp16/bf16 parameters, and for every
        parameter the host steps for a device."""
        return p.dtype in LOW_PRECISION or p.device.type != self.host.type  # cuda == cuda:0

    def _host_buffers(self) -> None:
        """The host step's buffers, sized for the largest chunk: two of fp32 gradients (one
        chunk's in use while the next one's arrive) and one of working copies on their way
        back; pinned for CUDA."""
        self.grad_bufs: HostBuffers | None = None
        self.copy_bufs: HostBuffers | None = None
        self._grad_slot = 0
        self._back_event: Any = None
        sized = [[c.params[i] for i in c.masters] for c in self.chunks if c.masters]
        if not sized or self.host.type == "cuda":  # masters on the GPU: no host step
            return
        def span(ts: list[torch.Tensor], itemsize: int | None) -> int:
            return sum(-(-t.numel() * (itemsize or t.element_size()) // 64) * 64 for t in ts)
        pin = self.xfer.cuda
        stats = self.offload.stats
        self.grad_bufs = HostBuffers(max(span(ts, 4) for ts in sized), 2, pin, stats)
        self.copy_bufs = HostBuffers(max(span(ts, None) for ts in sized), 1, pin, stats)

    # -- paging the state ----------------------------------------------------------------------

    def entries(self, chunk: _Chunk) -> list[tuple[nn.Parameter, dict[str, Any]]]:
        """Each parameter of the chunk with its state (the master copy under "master")."""
        out = []
        for i, p in enumerate(chunk.params):
            q = chunk.inner_param(i)
            st = dict(chunk.inner.state.get(q, {})) if chunk.inner is not None else {}
            if q is not p:
                st["master"] = q.data
            if st:
                out.append((p, st))
        return out

    def _state_tensors(self, chunk: _Chunk) -> list[tuple[str, torch.Tensor]]:
        """The tensors to page: the state's own objects (and the master parameters), whose
        storage paging may replace."""
        out = []
        names = {id(p): n for u in chunk.units for n, p in zip(u.names, u.params)}
        for i, p in enumerate(chunk.params):
            q = chunk.inner_param(i)
            st = dict(chunk.inner.state.get(q, {}))
            if q is not p:
                st["master"] = q
            out += [(f"{names.get(id(p), i)} {k}", t) for k, t in sorted(st.items())
                    if isinstance(t, torch.Tensor)]
        return out

    def _page_in(self, chunk: _Chunk) -> None:
        """Starts bringing the chunk's state back (no wait). State still being written is
        still here: it stays once written, with nothing to read."""
        u = chunk.state_unit
        if chunk in self._writing:
            chunk.keep = True
        if u is None or u.state is not State.AWAY:
            return
        u.allocate(self.pool)  # the load overwrites every byte
        u.state = State.FETCHING
        chunk.pending = self.mover.load(u)

    def _wait(self, chunk: _Chunk, retry: bool = True) -> None:
        """Waits for the chunk's state read or store. A read that failed is read once more,
        now, before its error is raised: started ahead of its use (in the forward before, or
        chunks ahead in backward), its error would fail whatever met it next, inside backward
        after chunks had stepped a torn step, where the disk may have recovered since."""
        if chunk in self._writing:
            self._writing.remove(chunk)
        if chunk.pending is not None:
            ticket, chunk.pending = chunk.pending, None
            u = chunk.state_unit
            keep, chunk.keep = chunk.keep, False
            try:
                timed_wait(ticket, self.offload.stats)
            except BaseException as e:
                # A failed read gives the memory back (the next use reads afresh); after a
                # failed write the state is still here, resident, and goes out again later.
                if u.state is State.FETCHING:
                    u.free()
                    u.state = State.AWAY
                    if retry and isinstance(e, Exception):
                        self._page_in(chunk)
                        self._wait(chunk, retry=False)
                        return
                else:  # memory holds the only copy, as a unit's failed write leaves it
                    u.dirty = True
                raise
            if u.state is State.FETCHING:
                u.state = State.RESIDENT
            elif not keep:  # a store finished: the memory can go
                u.free(self.pool)
                u.state = State.AWAY

    def _page_out(self, chunk: _Chunk) -> None:
        """Starts writing the chunk's state to NVMe; its memory is freed once written."""
        if self.tier != "nvme":
            return
        tensors = self._state_tensors(chunk)
        if not tensors:
            return
        old = chunk.state_unit
        if old is None or [id(s.param) for s in old.segments] != [id(t) for _, t in tensors]:
            if old is not None:  # the state grew (after the first step): a new layout
                old.home.release()
            u = Unit(-1, f"optimizer state of {chunk.units[0].name}", tensors)
            u.kind = "optimizer"
            u.home = NvmeHome(self.swap, u.nbytes)
            if not self.mover.cuda:  # O_DIRECT straight into the state: no staging copy
                u.adopt_flat(self.swap.align)
                self.pool.cap = max(self.pool.cap, u.flat.numel())
            chunk.state_unit = u
        chunk.state_unit.state = State.RESIDENT  # until _wait sees the store done
        chunk.state_unit.dirty = False
        chunk.pending = self.mover.store(chunk.state_unit)
        self._writing.append(chunk)

    def _state_in(self, chunk: _Chunk) -> None:
        """Makes the chunk's state resident: waits for its last store (the update reads the
        state back), starts its read unless one is already on its way, and waits for it."""
        if chunk in self._writing:
            self._wait(chunk)
        self._page_in(chunk)
        self._wait(chunk)

    def _drain(self, keep: int = 0) -> None:
        """Waits for the state stores in flight but the newest ``keep``; the memory of those
        done goes to the pool."""
        self._free_stored()
        while len(self._writing) > keep:
            self._wait(self._writing[0])

    def _free_stored(self) -> None:
        """Gives the memory of the chunks whose store is done to the pool (no wait)."""
        for chunk in [c for c in self._writing if c.pending is None or c.pending.done()]:
            self._wait(chunk)

    def _reap(self) -> None:
        """``_free_stored``; once no store is left and no step is under way, the pages kept
        for the next chunk's read go back: until the next step they serve nothing."""
        self._free_stored()
        if not self._writing and not self._pending and not self._stepped:
            self.pool.clear()
            if self.offload.grads is not None:
                self.offload.grads.pool.clear()

    # -- the step ------------------------------------------------------------------------------

    def _hyperparameters(self) -> list[dict[str, Any]]:
        """The groups' hyperparameters as they are now: tensors (an lr a scheduler fills in
        place after step()) copied, for an update that runs later."""
        return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in g.items()
                 if k != "params"} for g in self.param_groups]

    def _sync_groups(self, chunk: _Chunk, groups: list[dict[str, Any]] | None = None) -> None:
        """Gives the chunk's inner groups the hyperparameters of ``groups`` (default: the
        outer groups' own values, for an update that runs now)."""
        for inner_group, gi in zip(chunk.inner.param_groups, chunk.group_of):
            for k, v in (groups or self.param_groups)[gi].items():
                if k != "params":
                    inner_group[k] = v

    def _changed_since(self, used: list[dict[str, Any]] | None) -> str | None:
        """Says which hyperparameter changed since chunks stepped in backward with ``used``."""
        for gi, (then, g) in enumerate(zip(used or [], self.param_groups)):
            for k, old in then.items():
                new = g.get(k)
                same = (torch.equal(old, new) if isinstance(old, torch.Tensor)
                        and isinstance(new, torch.Tensor) else old == new)
                if not same:
                    return (f"tieroffload: param group {gi}'s {k!r} changed from {old!r} to "
                            f'{new!r} between backward and step(); with overlap="backward" '
                            "every chunk stepped during backward with the first (this step "
                            "used it throughout): set hyperparameters before backward (a "
                            "scheduler stepped after opt.step() does), or use overlap=True")
        return None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Steps every chunk; with ``overlap`` (the default where parameters are paged) each
        chunk's update is deferred to the first use of its parameters (the next forward, a
        state dict, a checkpoint): its state's I/O then overlaps the forward's compute instead
        of following backward. The update is the same: its gradients and hyperparameters are
        taken now, and ``p.grad`` is None after the step."""
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.offload.settle_failed_backward()
        self._check_scaled()
        self._check_torn()
        self._check_alone()
        error, self._failed_store = self._failed_store, None
        if error is not None:
            raise error
        resuming = self._resume
        if not resuming:  # before anything is taken, as torch's step refuses them
            self.hyper.check(self.param_groups)
        self.settle()  # what a previous step left, before new gradients are taken
        if resuming:  # this call retries a step that failed part way: it is now complete
            self._resume = False
            return loss
        self._unzeroed = self._unzeroed or (bool(self.overlap) and self._backwards > 0)
        self._backwards = 0
        self._scaled = False
        if self.offload.grads is not None:
            self.offload.grads.store_set_by_hand([u for c in self.chunks for u in c.units])
        for shard in self.offload.shards:
            shard.pull_grad()
        chunks = self.chunks
        scale = self.scaler.scale if self.scaler is not None else None
        if scale is not None and self._overflow():
            self.scaler.update(overflow=True)  # skip this step: its gradients are lost
            for chunk in chunks:
                self._consume_grads(chunk)
            return loss
        if self.overlap == "backward":  # what backward did not step (no gradients) goes now
            todo = [i for i in range(len(chunks)) if i not in self._stepped]
            used, self._used = self._used, None
            self._stepped.clear()
            self._ready.clear()
            for i in todo:
                self._sync_groups(chunks[i], used)
            self._run(todo, None, [], self._fill, record=True)
            changed = self._changed_since(used)
            if changed:
                raise RuntimeError(changed)
            return loss
        groups = self._hyperparameters()  # of this step, for updates deferred past sched.step()
        for chunk in chunks:
            self._sync_groups(chunk, groups)
        if self.overlap:
            for i, chunk in enumerate(chunks):
                self._pending[i] = self._take_grads(chunk)
                self._had_grad.update(self._with_grads(chunk, self._pending[i]))
            self._pending_fill = self._fill
            for shard in self.offload.shards:
                shard.clear_grad(set_to_none=True)  # taken with the locals' gradients
            self._pending_scale = scale
            self._pending_clips, self._clips = self._clips, []
            # A view taken outside the hooks (``w = p.data``) reads and writes the unit's memory
            # itself, unseen: its chunk is updated now, as a plain step shows through the view.
            self.settle(self.offload.viewed())
            if self._pending:  # held until applied, even if the caller drops this optimizer
                self.offload.pending_opts.add(self)
            # The first update waits for nothing: its state and gradients come in now, while
            # the caller gets the next batch.
            if self._pending:
                first = chunks[min(self._pending)]
                self._page_in(first)
                if self.offload.grads is not None and not self._grads_in_ram(first):
                    self.offload.grads.start_bring_in(first.units)
        else:
            clips, self._clips = self._clips, []
            self._run(list(range(len(chunks))), scale, clips, self._fill, record=True)
        if self.scaler is not None:
            self.scaler.update(overflow=False)
        return loss

    def grads_ready(self, u: Unit) -> bool:
        """With ``overlap="backward"``, in the last backward of ``accumulation_steps``: steps
        the chunk that holds ``u`` once all of its units have their gradients, while backward
        goes on with earlier layers; then starts reading the state (and the gradients earlier
        micro-batches stored) of the chunk that backward reaches next. True when ``u``'s
        gradients are taken here (held in memory until the chunk steps): they are not paged."""
        i = self._unit_chunk.get(u.id)
        if (self.overlap != "backward" or i is None
                or self._backwards < self.accumulation_steps):
            return False
        if i in self._stepped and self._stepped_at == self._backwards:
            raise RuntimeError(
                f"tieroffload: {u.names[0]!r} got a second gradient in one micro-batch, after "
                'overlap="backward" had stepped its chunk with the first: a second backward '
                "through the same graph (retain_graph=True) before step(), or a module used in "
                "two reentrant checkpoint segments (use_reentrant=True), gives one per pass; "
                "call step() between backwards, use use_reentrant=False, or overlap=True")
        if i in self._stepped:
            raise RuntimeError(
                f'tieroffload: overlap="backward" steps each chunk during backward number '
                f"{self.accumulation_steps} (accumulation_steps) after a step(), so step() must "
                "follow it; pass accumulation_steps=N for N micro-batches, or use overlap=True")
        grads = self.offload.grads
        if grads is not None:
            grads.merge(u)
        chunk = self.chunks[i]
        ready = self._ready.setdefault(i, set())
        ready.add(u.id)
        if len(ready) < len(chunk.units):
            return True
        del self._ready[i]
        if not self._stepped:  # refused before the first chunk steps: nothing is torn
            self.hyper.check(self.param_groups, in_backward=True)
            self._used = self._hyperparameters()
        self._sync_groups(chunk, self._used)
        with torch.no_grad():
            self._state_in(chunk)
            # Stepped from here: a state read that failed (twice, see _wait) changed nothing,
            # and a backward that raised before the first chunk stepped can be retried.
            self._stepped.add(i)
            self._stepped_at = self._backwards
            # the step hooks bring the parameters in and out
            self._writing_own = True  # its own writes to the chunk pass check_write
            try:
                self._step_chunk(chunk, None, [], self._fill, record=True)
            finally:
                self._writing_own = False
            for p in chunk.params:
                p.grad = None
            self._consume_grads(chunk)
            if self.offload.mover is not None and not self.offload.mover.cuda:
                # Backward needs these parameters no more: written now, while it computes,
                # not all at once when the budget needs their memory (see write_behind).
                self.offload.scheduler.write_behind(chunk.units)
            # The stores of the chunks before have had this chunk's backward to finish: their
            # pages go to the state read next (backward runs from the last chunk). One may go
            # on behind that read: waiting for it held the read back, and backward with it.
            try:
                self._drain(keep=1)
            except Exception as e:  # raised by step(): from here no retry could redo backward
                self._failed_store = self._failed_store or e
            if i > 0 and i - 1 not in self._stepped:
                self._bring_in(self.chunks[i - 1])
                self._read_ahead(i - 1)
            self._page_out(chunk)
        return True

    def backward_failed(self, uncount: bool = False) -> None:
        """The model's last backward raised. With ``overlap="backward"``, chunks it stepped hold
        this step's update and the others do not: training refuses to go on (``_check_torn``)
        until a checkpoint is loaded. Before any chunk stepped, nothing is lost: a retry or a
        step() is as plain PyTorch's after a backward that raised. ``uncount``: it had counted
        as a micro-batch, which it is not (a step() since has reset the count already)."""
        if self._stepped:
            self._torn = sorted(self._stepped)
        elif uncount:
            self._backwards = max(0, self._backwards - 1)
        self._stepped.clear()
        self._ready.clear()
        self._used = None

    def abandon_step(self) -> None:
        """Forgets what a failed, torn or deferred step left undone (the deferred updates and
        the gradients they took, a step to resume, a torn step, a failed store, state reads on
        their way), for a load that replaces every chunk's state and the model's parameters:
        none of it is to be applied, and a read that fails now (the bytes a disk error spoiled)
        is of bytes about to be replaced."""
        self.offload.settle_failed_backward()
        if self.offload.grads is not None and self._pending:
            self.offload.grads.clear(self.deferred_units())
        for chunk in self.chunks:
            chunk.host_grads, chunk.grads_event = None, None
            if chunk.pending is not None:
                try:
                    self._wait(chunk, retry=False)
                except Exception:  # of bytes the load that follows replaces
                    pass
        self._writing.clear()
        self._pending.clear()
        self._pending_clips, self._pending_fill = [], frozenset()
        self._resume, self._torn, self._failed_store = False, [], None
        self._stepped.clear()
        self._ready.clear()
        self._used = None
        self.offload.pending_opts.discard(self)

    def grads_zeroed(self, ids: set[int]) -> None:
        """A zero_grad() outside this optimizer (``model.zero_grad()``, another optimizer's)
        cleared the gradients of the parameters ``ids``."""
        if ids & self._ids:
            self._unzeroed = False

    def check_zeroed(self) -> None:
        """Refuses a backward after a step() that let the gradients go, with no zero_grad()
        since: PyTorch keeps them in p.grad and adds the new ones to them."""
        if self._unzeroed:
            raise RuntimeError(
                "tieroffload: a backward after step() with no zero_grad() since: PyTorch would "
                "add its gradients to those the step used (p.grad keeps them), but the paged "
                "optimizer lets them go at step() (p.grad is None after it); call "
                "opt.zero_grad() or model.zero_grad() after each step() (p.grad = None by hand "
                "goes unseen), or use overlap=False, which keeps them")

    def check_write(self, u: Unit) -> None:
        """Refuses a write to ``u`` between an in-backward step of its chunk and ``step()``:
        PyTorch would step the written values, and here the step is already taken."""
        i = self._unit_chunk.get(u.id)
        if i is not None and i in self._stepped and not self._writing_own:
            raise RuntimeError(
                f"tieroffload: writing {u.names[0]!r} between backward and step(): "
                'overlap="backward" has stepped its chunk during backward already, so the '
                "write would replace this step's update instead of being updated by it; write "
                "before backward or after step(), or use overlap=True")

    def _check_alone(self) -> None:
        """Two open paged optimizers stepping the same parameters would each use up what the
        other needs (the paged gradients, the deferred updates): refused at the next training
        forward or step."""
        for other in list(self.offload.optimizers):
            shared = len(self._ids & other._ids) if other is not self and other in _live else 0
            if shared:
                raise ValueError(
                    f"tieroffload: {shared} of the parameters this paged optimizer steps are "
                    "stepped by another open paged optimizer of the model too: give each its own "
                    "parameters (params=...), or close the other first (one dropped after a "
                    "step() whose update is still deferred stays open until it is applied: "
                    "run `with tieroffload.materialize(model): pass` before building this one)")

    def _check_torn(self) -> None:
        if self._torn:
            raise RuntimeError(
                f'tieroffload: a backward with overlap="backward" raised after {len(self._torn)}'
                f" of {len(self.chunks)} chunks had stepped: their parameters hold that step's "
                "update and the others do not, which no retry can undo; load the last checkpoint "
                "(tieroffload.load_checkpoint(path, model, opt)) to go on")

    @property
    def stepped_in_backward(self) -> bool:
        """True when chunks have stepped during backward and ``step()`` has not followed."""
        return bool(self._stepped)

    def used_grads_of(self, params: list[torch.Tensor]) -> bool:
        """Some of ``params`` are stepped by this optimizer, whose chunks stepped during this
        backward: their gradients are used up (p.grad is None)."""
        return bool(self._stepped) and any(id(p) in self._ids for p in params)

    def forward_begins(self) -> None:
        """Before the forward whose backward is the last of ``accumulation_steps``, the first
        chunk that backward steps starts in."""
        self._check_torn()
        self._check_alone()
        if (self.overlap == "backward" and self._backwards + 1 == self.accumulation_steps
                and self.chunks):
            self._bring_in(self.chunks[-1])
            self._tail = self._window_start()

    def backward_begins(self) -> None:
        """Counts the model's backward passes (micro-batches) since the last ``step()``."""
        self._backwards += 1
        self._tail = None

    def _window(self) -> int:
        """Bytes of state an in-backward step may hold, the chunk stepping and the stores on
        their way included: twice the largest chunk's. Reading ahead within it keeps the disk
        busy where one chunk at a time left it idle between small chunks; where the chunks are
        as large as the largest, one is read ahead, as before."""
        return 2 * max((c.state_unit.nbytes for c in self.chunks if c.state_unit is not None),
                       default=0)

    def _window_start(self) -> int:
        """The first of the last chunks whose state fits the window together: backward steps
        them first, so the forward before reads them, where the disk has time to spare."""
        room, i = self._window(), len(self.chunks)
        while i > 0 and self.chunks[i - 1].state_unit is not None \
                and self.chunks[i - 1].state_unit.nbytes <= room:
            room -= self.chunks[i - 1].state_unit.nbytes
            i -= 1
        return i

    def _read_ahead(self, i: int) -> None:
        """In backward, after ``_bring_in(chunks[i])``: starts the state reads of the chunks
        before it, which backward steps next, while the state held fits ``_window``."""
        room = self._window() - sum(
            c.state_unit.nbytes for c in self.chunks
            if c.state_unit is not None and c.state_unit.state is not State.AWAY)
        for j in range(i - 1, -1, -1):
            u = self.chunks[j].state_unit
            if j in self._stepped or u is None or u.state is not State.AWAY:
                continue
            if u.nbytes > room:
                return
            self._page_in(self.chunks[j])
            room -= u.nbytes

    def _bring_in(self, chunk: _Chunk) -> None:
        """Starts reading what an in-backward step of ``chunk`` needs from NVMe: its state, and
        its gradients from earlier micro-batches."""
        self._page_in(chunk)
        if self.offload.grads is not None:
            self.offload.grads.start_bring_in(chunk.units)

    def _with_grads(self, chunk: _Chunk, grads: list[torch.Tensor | None] | None) -> set[int]:
        """Ids of the chunk's parameters that have a gradient for the step: in ``grads`` (taken
        from ``p.grad``), or, where those wait in the gradient pager (None), stored there."""
        if grads is not None:
            return {id(p) for p, g in zip(chunk.params, grads) if g is not None}
        pager = self.offload.grads
        return {id(p) for p in pager.stored(chunk.units)} if pager is not None else set()

    def _take_grads(self, chunk: _Chunk) -> list[torch.Tensor | None] | None:
        """The chunk's gradients, kept for its deferred update (None: they wait on NVMe)."""
        if self.offload.grads is not None:
            return None
        grads = [p.grad for p in chunk.params]
        for p in chunk.params:
            p.grad = None
        return grads

    def settle(self, units: list[Unit] | None = None) -> None:
        """Applies the deferred updates of the chunks that hold ``units`` (all: None), and
        frees the state of the last step's stores that are done (each forward acquire calls
        this). A backward that raised is settled first (see ``backward_failed``): a load
        that follows a torn step then clears it, and is honoured."""
        self.offload.settle_failed_backward()
        if self._writing and not self._settling:
            self._reap()
        if self._tail is not None and units is not None and torch.is_grad_enabled():
            for i in {self._unit_chunk.get(u.id, -1) for u in units}:
                if i >= self._tail:
                    self._page_in(self.chunks[i])
        if not self._pending or self._settling:
            return
        todo = (sorted(self._pending) if units is None else
                sorted({self._unit_chunk[u.id] for u in units if u.id in self._unit_chunk}
                       & self._pending.keys()))
        if not todo:
            return
        self._settling = True
        try:
            # Called from forward hooks too, inference_mode()'s among them: the state it makes
            # must stay usable by a training step.
            with torch.inference_mode(False), torch.no_grad():
                self._run(todo, self._pending_scale, self._pending_clips, self._pending_fill,
                          record=False)  # recorded when step() took the gradients
        finally:
            self._settling = False
        if not self._pending:
            self.offload.pending_opts.discard(self)

    def _run(self, todo: list[int], scale: float | None, clips: list[torch.Tensor],
             fill: frozenset[int], record: bool) -> None:
        """Updates chunks ``todo`` in order (gradients times ``clips``), pipelined: chunk i+1's
        state, gradients and parameters come in while chunk i is updated, and chunk i-1's state
        goes out. After the last, the next deferred chunk's state starts coming in."""
        chunks = self.chunks
        sched = self.offload.scheduler if self.offload.mover is not None else None
        done = 0
        try:
            for k in range(len(todo)):
                self._run_chunk(todo, k, sched, scale, clips, fill, record)
                done += 1  # updated: a failure from here on must not update it again
                self._consume_grads(chunks[todo[k]])
                self._page_out(chunks[todo[k]])
        except BaseException:
            for c in chunks:  # copies taken ahead: a retry takes them afresh
                c.host_grads, c.grads_event = None, None
            # The chunks not updated wait in _pending with their gradients, so that retrying
            # the call that failed updates each of them once (and those done, not again).
            for i in todo[done:]:
                if i not in self._pending:
                    self._pending[i] = self._take_grads(chunks[i])
                    self._resume = True
            self._pending_scale = scale
            self._pending_clips = clips
            self._pending_fill = fill
            raise
        # The last stores go on beside what follows the step: the next forward's acquires
        # free them (see settle), where a failed one raises from a call that a retry redoes
        # whole. Waiting here left the disk's last writes unhidden, and a store that failed
        # here failed a step() already complete, which a retry would apply again.

    def _run_chunk(self, todo: list[int], k: int, sched: Any, scale: float | None,
                   clips: list[torch.Tensor], fill: frozenset[int], record: bool) -> None:
        """Updates chunk ``todo[k]`` (see ``_run``): its state, gradients and parameters in,
        the next chunk's on their way."""
        chunks = self.chunks
        i = todo[k]
        chunk = chunks[i]
        self._state_in(chunk)  # read ahead, except the first
        if sched is not None:  # held while the next chunk is prefetched: it must stay
            sched.acquire(chunk.units, force=True, record=False)
        try:
            nxt = chunks[todo[k + 1]] if k + 1 < len(todo) else None
            ahead = nxt or next((chunks[j] for j in sorted(self._pending) if j > i), None)
            if chunk.masters and chunk.host_grads is None and self.offload.grads is None:
                self._grads_out(chunk, self._pending.get(i))  # before the next chunk's
            if ahead is not None:
                # Earlier chunks' stores first: their pages go to the state read next.
                self._drain()
                self._page_in(ahead)
                if self.offload.grads is not None and not self._grads_in_ram(ahead):
                    self.offload.grads.start_bring_in(ahead.units)
                if sched is not None and nxt is not None:
                    sched.prefetch(nxt.units)
                if nxt is not None and nxt.masters and self.offload.grads is None:
                    # Its gradients leave the device while this chunk is updated.
                    self._grads_out(nxt, self._pending.get(todo[k + 1]))
            grads = self._pending.get(i)
            if grads is not None:
                for p, g in zip(chunk.params, grads):
                    p.grad = g
            if self._grads_in_ram(chunk):
                self._grads_from_ram(chunk, clips)
            elif self.offload.grads is not None:
                self.offload.grads.bring_in(chunk.units)
            self._step_chunk(chunk, scale, clips, fill, record)
            # Deferred until updated: a deferred update that fails (a read of its gradients,
            # in the forward that settles it) stays deferred, and is not taken for a step that
            # failed part way (see _run), which would skip the caller's next step().
            self._pending.pop(i, None)
            if grads is not None:  # used up: the user's zero_grad may already have run
                for p in chunk.params:
                    p.grad = None
        finally:
            if sched is not None:
                sched.release(chunk.units)

    def _step_chunk(self, chunk: _Chunk, scale: float | None, clips: list[torch.Tensor],
                    fill: frozenset[int], record: bool) -> None:
        """Updates the chunk with the gradients it has (``p.grad``, or its masters' host
        copies); those in ``fill`` that have none get zeros; ``record``: note which had one."""
        for p in chunk.params:
            for c in clips:  # clip_grad_norm_ of gradients that were on NVMe
                if p.grad is not None:
                    p.grad.mul_(c.to(p.grad.device))
        if chunk.masters:
            if chunk.host_grads is None:
                self._grads_out(chunk, None)
            self.xfer.wait(chunk.grads_event)
        for i, p in enumerate(chunk.params):
            q = chunk.masters.get(i)
            g = p.grad if q is None else chunk.host_grads.get(i)  # type: ignore[union-attr]
            if g is None and id(p) in fill:
                g = torch.zeros_like(p if q is None else q, memory_format=torch.preserve_format)
                if q is None:
                    p.grad = g
            elif g is not None and record:
                self._had_grad.add(id(p))
            if q is not None:
                q.grad = g
            if g is not None and scale is not None:
                g.mul_(1.0 / scale)
        chunk.host_grads, chunk.grads_event = None, None
        if not chunk.masters:
            chunk.inner.step()  # offload()'s step hooks bring the chunk's parameters in and out
            return
        with self.offload.resident(chunk.units, writeback=True):
            self._sync_masters(chunk)
            chunk.inner.step()
            self._masters_back(chunk)
            chunk.versions = {i: version(chunk.params[i]) for i in chunk.masters}

    def _sync_masters(self, chunk: _Chunk) -> None:
        """A parameter written from outside since its master was taken or last stepped
        (``load_state_dict``, ``load_weights``, ``nn.init``, a write through ``p.data``) gets
        its new value as its master, so the step updates what was written, as PyTorch steps
        the parameter itself. One merely viewed keeps its master, which rounds to it. Seen by
        its version counter, or, where a write bumps none (``p.data``), by its unit's count of
        outside writes (``Guards.wrote``), or, for a model not offloaded whose parameters sit
        beside their masters, by comparing them at every step. (A model resident on a GPU
        with its masters on the host: a write through ``p.data`` goes unseen.)"""
        unit_of = self.offload.param_unit
        guarded = self.offload.mover is not None
        for i, q in chunk.masters.items():
            p = chunk.params[i]
            u = unit_of[id(p)]
            unseen = version(p) == chunk.versions[i] and u.writes == chunk.writes[u.id]
            if unseen and (guarded or p.device != q.device):
                continue
            now = p.detach().to(q.device)
            if not torch.equal(now, q.to(now.dtype)):
                q.copy_(now)
        chunk.writes = {u.id: u.writes for u in chunk.units}

    def _grads_out(self, chunk: _Chunk, grads: list[torch.Tensor | None] | None) -> None:
        """Starts copying the gradients of the chunk's master-backed parameters (``grads``, or
        their ``p.grad``) to host fp32 buffers; ``_step_chunk`` waits for them."""
        have = [(i, g) for i in chunk.masters
                if (g := (grads[i] if grads is not None else chunk.params[i].grad)) is not None]
        if self.grad_bufs is None:  # fp32 masters on the GPU (optimizer="gpu"), beside them
            chunk.host_grads = {i: g.to(torch.float32, copy=True) for i, g in have}
            chunk.grads_event = None
            return
        views = self.grad_bufs.views(self._grad_slot, [g for _, g in have], torch.float32)
        self._grad_slot += 1
        ev = None
        for (_, g), v in zip(have, views):
            ev = self.xfer.to_host(g, v)
        chunk.host_grads = {i: v for (i, _), v in zip(have, views)}
        chunk.grads_event = ev

    def _grads_in_ram(self, chunk: _Chunk) -> bool:
        """The host steps the chunk with gradients paged to pinned RAM (``grads="cpu"`` with
        CUDA): it reads them where they are, with no trip back to the device."""
        pager = self.offload.grads
        return (self.grad_bufs is not None and pager is not None and pager.in_ram
                and len(chunk.masters) == len(chunk.params))

    def _grads_from_ram(self, chunk: _Chunk, clips: list[torch.Tensor]) -> None:
        """Sets ``chunk.host_grads`` from the RAM home of its paged gradients: each one times
        the clip coefficients in its own dtype (as torch clips ``p.grad``), then in fp32."""
        stored = self.offload.grads.host_grads(chunk.units, clips)  # type: ignore[union-attr]
        have = [(i, stored[id(chunk.params[i])]) for i in chunk.masters
                if id(chunk.params[i]) in stored]
        views = self.grad_bufs.views(self._grad_slot, [g for _, g in have], torch.float32)
        self._grad_slot += 1
        for (_, g), v in zip(have, views):
            v.copy_(g)
        chunk.host_grads = {i: v for (i, _), v in zip(have, views)}
        chunk.grads_event = None

    def _masters_back(self, chunk: _Chunk) -> None:
        """The updated masters, rounded to their parameters' dtype on the host, go back to
        the parameters (on the side stream for CUDA; the compute stream waits for them)."""
        if self.copy_bufs is None:  # fp32 masters on the GPU (optimizer="gpu")
            for i, q in chunk.masters.items():
                chunk.params[i].copy_(q)
                q.grad = None
            return
        self.xfer.wait(self._back_event)  # the buffer's last copies are done
        idx = list(chunk.masters)
        views = self.copy_bufs.views(0, [chunk.params[i] for i in idx])
        ev = None
        for i, v in zip(idx, views):
            q = chunk.masters[i]
            v.copy_(q)
            ev = self.xfer.to_device(v, chunk.params[i])
            q.grad = None
        self._back_event = ev
        if self.offload.mover is not None:  # the unit is written home next: values first
            self.xfer.wait(ev)

    def _consume_grads(self, chunk: _Chunk) -> None:
        if self.offload.grads is not None:
            self.offload.grads.consume(chunk.units)

    def _overflow(self) -> bool:
        """True when any gradient is inf or NaN (fp16 loss scaling)."""
        if self.offload.grads is not None:
            return not self.offload.grads.all_finite()
        return any(p.grad is not None and not bool(torch.isfinite(p.grad).all())
                   for c in self.chunks for p in c.params)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over this optimizer's parameters, gradients
        paged to NVMe included: returns the total norm (torch's formula, over unscaled
        gradients) and scales the gradients by ``min(1, max_norm / (norm + 1e-6))``, resident
        ones now, paged ones in the step."""
        self._check_open()
        return self.clip_params([p for g in self.param_groups for p in g["params"]], max_norm,
                                norm_type, error_if_nonfinite)

    def owns(self, params: list[torch.Tensor]) -> bool:
        """True when every one of ``params`` is stepped by this optimizer."""
        mine = {id(p) for c in self.chunks for p in c.params}
        return all(id(p) in mine for p in params)

    def clip_params(self, params: list[torch.Tensor], max_norm: float, norm_type: float,
                    error_if_nonfinite: bool) -> torch.Tensor:
        """``clip_grad_norm_`` over ``params``, in their order (see ``clip_grad_norm_``)."""
        if self.overlap == "backward":
            raise RuntimeError('tieroffload: overlap="backward" steps each chunk during backward, '
                               "before clip_grad_norm_ could run; use overlap=True to clip")
        norm_type = float(norm_type)
        pager = self.offload.grads
        norms: dict[int, tuple[torch.Tensor, torch.device, torch.dtype]] = {}
        wanted = {id(p) for p in params}
        seen: set[int] = set()
        for chunk in self.chunks:
            ps = [p for p in chunk.params if id(p) in wanted]
            if not ps:
                continue
            if pager is not None:
                pager.bring_in(chunk.units)
            try:
                add_grad_norms(ps, norm_type, norms, self._clips if pager is not None else [])
            finally:
                if pager is not None:
                    pager.put_back(chunk.units)
            seen.update(id(p) for p in ps)
        add_grad_norms([p for p in params if id(p) not in seen], norm_type, norms, [])
        present = [p for p in params if id(p) in norms]
        if not present:
            return torch.tensor(0.0)
        total = total_norm(present, norms, norm_type)
        if self.scaler is not None:  # the gradients are scaled (by a power of two)
            total = total / self.scaler.scale
        coef = clip_coefficient(total, max_norm, norm_type, error_if_nonfinite)
        resident = [p for p in present if pager is None or id(p) not in seen]
        for p in resident:
            p.grad.mul_(coef.to(p.grad.device))
        if len(resident) < len(present):
            self._clips.append(coef)
        return total

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (fp16); backward that, then ``step()`` unscales."""
        self._check_open()
        self._scaled = True
        return loss if self.scaler is None else loss * self.scaler.scale

    def _check_scaled(self) -> None:
        """With loss scaling, ``step()`` divides the gradients by the scale: a backward of an
        unscaled loss would step by 1/65536 of them, and nothing would learn."""
        if self.scaler is not None and self._backwards and not self._scaled:
            raise RuntimeError(
                f"tieroffload: loss scaling is on (scale {self.scaler.scale:g}; fp16 parameters "
                "default to it) but backward ran on a loss not passed through "
                "opt.scale_loss(loss): backward opt.scale_loss(loss), or build the optimizer "
                "with loss_scale=None")

    @property
    def loss_scale(self) -> float | None:
        return None if self.scaler is None else self.scaler.scale

    @property
    def skipped_steps(self) -> int:
        return 0 if self.scaler is None else self.scaler.skipped

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The groups are fixed once built (its chunks and their state are laid out for them):
        a group added later is refused, not left unstepped."""
        if getattr(self, "chunks", None) is None:  # torch's __init__ adds the first groups
            return super().add_param_group(param_group)
        raise ValueError(
            "tieroffload: a paged optimizer's parameter groups are fixed once built (its chunks "
            "are laid out for them): build tieroffload.optimizer(model, cls, params=[...every "
            "group...]) again, or step the new parameters with an optimizer of their own")

    def deferred_units(self) -> list[Unit]:
        """The units of the chunks whose update is deferred: their stored gradients are taken."""
        return [u for i in self._pending for u in self.chunks[i].units]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._check_open()
        self.offload.settle_failed_backward()  # a torn step says so, not "call step()"
        self._check_torn()
        if self._stepped:
            raise RuntimeError(
                f'tieroffload: zero_grad() after a backward in which overlap="backward" '
                f"stepped {len(self._stepped)} of {len(self.chunks)} chunks, before step(): "
                "the update is taken already, so the batch cannot be skipped; call step() to "
                "finish it (skipping batches needs overlap=True)")
        self._backwards = 0  # what was accumulated is gone
        self._scaled = False
        self._unzeroed = False
        if set_to_none:
            self._had_grad.clear()
            self._fill = frozenset()
        else:
            self._fill = frozenset(self._had_grad)
        self._clips = []
        self._ready.clear()
        if self.offload.grads is not None:  # deferred updates keep the gradients they took
            self.offload.grads.clear([u for c in self.chunks for u in c.units],
                                     keep=self.deferred_units())
        for shard in self.offload.shards:
            shard.clear_grad(set_to_none)
        for chunk in self.chunks:
            chunk.inner.zero_grad(set_to_none)
            for i in chunk.masters:  # the fp16/bf16 parameters' own gradients
                p = chunk.params[i]
                if set_to_none or p.grad is None:
                    p.grad = None
                else:
                    p.grad.zero_()

    # -- state dicts ---------------------------------------------------------------------------

    def _index(self) -> dict[int, int]:
        return {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    def state_dict(self) -> dict[str, Any]:
        """The torch layout ({"state", "param_groups"}), with copies of the state tensors."""
        self._check_open()
        self.settle()
        index = self._index()
        state: dict[int, dict[str, Any]] = {}
        for chunk in self.chunks:
            with self.resident(chunk):
                for p, st in self.entries(chunk):
                    state[index[id(p)]] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                           for k, v in st.items()}
        sd = {"state": state, "param_groups": self.state_dict_groups()}
        if self.scaler is not None:
            sd["loss_scale"] = self.scaler.state_dict()
        return sd

    def state_dict_groups(self) -> list[dict[str, Any]]:
        """``param_groups`` as torch's state_dict has them (parameters as indices)."""
        index = self._index()
        return [{**{k: v for k, v in g.items() if k != "params"},
                 "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]

    def check_loadable(self, groups: Any, state: dict[Any, dict[str, Entry]],
                       loss_scale: Any = None,
                       label: Callable[[Any, str], str] = "state[{}][{!r}]".format) -> None:
        """Raises ValueError, naming the entry, unless ``groups`` (torch's param_groups layout),
        ``state`` (index -> name -> entry) and ``loss_scale`` can all be loaded: see
        ``state_check``. A ``master`` entry (an fp32 copy of an fp16/bf16 parameter) only
        for a parameter that has one here, of its shape. ``label(index, name)`` names an
        entry in errors."""
        check_groups(self.opt_cls, self.defaults, self.param_groups, groups)
        params = [p for g in self.param_groups for p in g["params"]]
        masters = {id(c.params[i]) for c in self.chunks for i in c.masters}
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
            check_loss_scale(self.scaler.state_dict(), loss_scale)

    def load_groups(self, groups: list[dict[str, Any]]) -> None:
        """Takes the hyperparameters of saved ``param_groups``, checked by ``check_loadable``."""
        self._torn = []  # every chunk's state and parameters come from what is loaded
        for g, saved in zip(self.param_groups, groups):
            g.update({k: v for k, v in saved.items() if k != "params"})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's: the saved state replaces the current one (a parameter with none saved
        starts afresh, as before its first step). Everything is checked before anything
        changes; a dict that does not fit raises ValueError naming the entry."""
        self._check_open()
        self.settle()
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict) \
                or "param_groups" not in state_dict:
            raise ValueError("optimizer state dict must be a dict with 'state' (a dict) and "
                             "'param_groups', as state_dict() makes it")
        saved = state_dict["state"]
        self.check_loadable(state_dict["param_groups"],
                            {i: {k: Entry.of(v) for k, v in st.items()}
                             if isinstance(st, dict) else st for i, st in saved.items()},
                            state_dict.get("loss_scale"))
        self.load_groups(state_dict["param_groups"])
        if self.scaler is not None and "loss_scale" in state_dict:
            self.scaler.load_state_dict(state_dict["loss_scale"])
        index = self._index()
        for chunk in self.chunks:
            self.load_chunk(chunk, lambda p: saved.get(index[id(p)]))

    def load_chunk(self, chunk: _Chunk, saved_of: Callable[[nn.Parameter], dict | None]) -> None:
        """Replaces one chunk's state with ``saved_of(param)`` (a checked dict of its state,
        or None: no state, as before the first step) and pages it out: one chunk in memory at
        a time. Tensors of the same name, shape and dtype are filled in place, so the paged
        layout stays valid; any other change makes a new one."""
        self._wait(chunk)
        if chunk.state_unit is not None and chunk.state_unit.state is State.AWAY:
            chunk.state_unit.allocate()  # what is kept is refilled below, the rest dropped
            chunk.state_unit.state = State.RESIDENT
        for i, p in enumerate(chunk.params):
            saved = saved_of(p) or {}
            q = chunk.inner_param(i)
            cur = chunk.inner.state.get(q, {})
            new: dict[str, Any] = {}
            for k, v in saved.items():
                old = cur.get(k)
                if k == "master":
                    q.data.copy_(v)
                elif (isinstance(old, torch.Tensor) and isinstance(v, torch.Tensor)
                      and old.shape == v.shape and old.dtype == v.dtype):
                    new[k] = old.copy_(v)
                else:
                    new[k] = v.clone().to(q.device) if isinstance(v, torch.Tensor) else v
            if new:
                chunk.inner.state[q] = new
            else:
                chunk.inner.state.pop(q, None)
        if chunk.state_unit is not None and not self._state_tensors(chunk):
            chunk.state_unit.free()  # no state left: nothing to page
            chunk.state_unit.home.release()
            chunk.state_unit = None
        self._page_out(chunk)
        self._wait(chunk)

    def resident(self, chunk: _Chunk):
        """Context: the chunk's state is in memory (and up to date) inside the block."""
        self.settle(chunk.units)
        return _Resident(self, chunk)


class _Resident:
    def __init__(self, opt: PagedOptimizer, chunk: _Chunk) -> None:
        self.opt, self.chunk = opt, chunk

    def __enter__(self) -> None:
        self.opt._wait(self.chunk)
        self.opt._page_in(self.chunk)
        self.opt._wait(self.chunk)
        self.paged = self.chunk.state_unit is not None

    def __exit__(self, *exc: object) -> None:
        if self.paged:
            if self.chunk.state_unit.dirty:  # a store failed: written again, not dropped
                self.opt._page_out(self.chunk)
                return
            u = self.chunk.state_unit
            u.free(self.opt.pool)
            u.state = State.AWAY


def optimizer(model: nn.Module, opt_cls: type[torch.optim.Optimizer],
              params: Iterable | None = None, *, loss_scale: str | float | None = "auto",
              overlap: bool | str = True, accumulation_steps: int = 1,
              **kwargs: Any) -> PagedOptimizer:
    """A ``torch.optim.Optimizer`` over an offloaded model whose state lives in
    ``policy.optimizer`` ("cpu" or "nvme"; "gpu" with CUDA compute) and is stepped in chunks.
    ``params``: param groups as torch accepts them (default: all of the model's).

    fp16 and bf16 parameters get fp32 master copies in the optimizer's tier (taken from their
    values now); the step updates the masters and writes them back rounded. ``loss_scale``:
    "auto" (dynamic when any parameter is fp16, else none), "dynamic", a fixed number, or None;
    with scaling, backward ``opt.scale_loss(loss)``, and a step whose gradients overflow is
    skipped (``opt.skipped_steps``). ``overlap``: defer each chunk's update to the next use of
    its parameters (see ``PagedOptimizer.step``); ``"backward"`` steps each chunk during
    backward, as soon as its gradients are final (single process, no loss scaling, and no
    clipping between backward and ``step()``, which then only steps what got no gradient): its
    I/O then overlaps backward's compute, and the last micro-batch's gradients never go to
    NVMe. With gradient accumulation, ``accumulation_steps`` says how many backward passes
    make one step: the chunks step during the last of them."""
    if not (isinstance(opt_cls, type) and issubclass(opt_cls, torch.optim.Optimizer)):
        raise TypeError(f"opt_cls must be a torch.optim.Optimizer class, not {opt_cls!r}")
    closure = inspect.signature(opt_cls.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(f"tieroffload.optimizer: {opt_cls.__name__}.step needs a closure (it "
                         "re-evaluates the loss), which a step taken chunk by chunk cannot "
                         "give; step it as a plain optimizer over the model, with the "
                         'gradients on the compute device (grads="cpu" on the CPU, grads="gpu" '
                         "with CUDA)")
    if params is not None:
        params = list(params)
    return PagedOptimizer(model, opt_cls, params, kwargs, loss_scale, overlap,
                          accumulation_steps)

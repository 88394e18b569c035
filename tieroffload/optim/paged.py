"""The paged optimizer: optimizer state lives in its tier (RAM or NVMe) and streams through the
step chunk by chunk, so Adam's 8 bytes of state per parameter never have to fit at once.

Each chunk (the parameters of a few consecutive units) has an inner optimizer of the user's class
and arguments, so the update is exactly what that torch optimizer computes (Adam and AdamW use
PyTorch's fused CPU kernel unless told otherwise). The outer object is a ``torch.optim.Optimizer``
whose ``param_groups`` are the ones users and ``lr_scheduler`` change; their values are copied
into the chunks before each step. On NVMe the state of chunk i+1 is read while chunk i is
updated, and chunk i is written back while chunk i+1 is.

``PagedOptimizer`` is the face over parts that each own their fields: ``layout`` (the chunks),
``pager`` (their state's I/O), ``host`` (fp32 masters, the host step), ``updater`` (updates,
now or deferred), ``backward`` (steps inside backward), ``misuse`` (its checks) and ``states``
(state dicts, the chunk-state API checkpoints use, and the loss scale, ``scaler``).
"""

from __future__ import annotations

import atexit
import operator
import weakref
from collections.abc import Iterable, MutableMapping
from typing import Any, Callable

import torch
from torch import nn

from ..core.units import Unit
from ..hooks.registry import state_of
from ..hooks.state import OffloadState
from ..hooks.steps import clip_fp32, clip_norm
from .deferred import Updater
from .guards import (
    Misuse,
    check_alone,
    check_in_model,
    check_optimizer_class,
    check_options,
    check_whole_units,
    make_scaler,
)
from .hyper import HyperCheck
from .in_backward import BackwardSteps
from .layout import CHUNK_BYTES, Layout, build_chunks, local_params, state_bytes
from .loss_scale import LossScale
from .masters import HostStep
from .pager import StatePager
from .states import ChunkStates

__all__ = ["CHUNK_BYTES", "PagedOptimizer", "optimizer"]

_live: weakref.WeakSet[PagedOptimizer] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for opt in list(_live):
        opt.close()


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


class _NoState:
    """The ``state`` attribute: a ``_StateElsewhere``; setting it is refused once built
    (``torch.optim.Optimizer.__init__`` sets it first)."""

    def __get__(self, opt: Any, owner: type | None = None) -> Any:
        return self if opt is None else _StateElsewhere(opt.offload.policy.optimizer)

    def __set__(self, opt: Any, value: Any) -> None:
        if "_ids" in opt.__dict__:  # built
            _StateElsewhere(opt.offload.policy.optimizer)._refuse()


class _Part:
    """A face attribute that is a part's own field (read and written there): ``part`` is the
    dotted path of the part, ``name`` the field's name in it."""

    def __init__(self, part: str, name: str | None = None) -> None:
        self.part = operator.attrgetter(part)
        self.name = name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    def __get__(self, opt: Any, owner: type | None = None) -> Any:
        return self if opt is None else getattr(self.part(opt), self.name)

    def __set__(self, opt: Any, value: Any) -> None:
        setattr(self.part(opt), self.name, value)


class PagedOptimizer(torch.optim.Optimizer):
    """See the module docstring; build it with ``tieroffload.optimizer``. The methods from
    ``grads_ready`` to ``clip_params`` are what ``offload()``'s hooks call."""

    _tieroffload_paged = True  # the plain-optimizer hooks of offload() leave this one alone

    state = _NoState()
    accumulation_steps = _Part("backward")  # AutoBatch sets it
    overlap = _Part("backward")
    mover = _Part("pager")
    # Reached by the tests: kept readable (and _page_in replaceable) here.
    grad_bufs = _Part("host")
    _page_in = _Part("pager", "page_in")
    _stepped = _Part("backward", "stepped")
    _pending = _Part("updater.deferred", "grads")
    _window_start = _Part("backward", "window_start")
    _grads_in_ram = _Part("host", "grads_in_ram")
    # The loss scale has one owner, the state API that state dicts and checkpoints use:
    # setting opt.scaler replaces it there.
    scaler = _Part("states")

    def __init__(self, model: nn.Module, opt_cls: type[torch.optim.Optimizer],
                 params: Iterable | None, kwargs: dict[str, Any],
                 loss_scale: str | float | LossScale | None = "auto", overlap: bool | str = True,
                 accumulation_steps: int = 1) -> None:
        self.offload: OffloadState = state_of(model)
        offload = self.offload
        self.tier = offload.policy.optimizer
        device = offload.device
        # The host step: CUDA compute, the state and fp32 masters in host RAM or on NVMe.
        self.host_step = self.tier != "gpu" and device.type == "cuda"
        if self.tier == "gpu" and device.type != "cuda":
            raise ValueError('optimizer="gpu" needs a CUDA compute device')
        host = torch.device("cpu") if self.tier != "gpu" else device
        self.host = HostStep(offload, host)
        kwargs = dict(kwargs)
        if opt_cls in (torch.optim.Adam, torch.optim.AdamW) and not (
                {"fused", "foreach", "differentiable"} & set(kwargs)):
            kwargs["fused"] = True
        hyper = HyperCheck(opt_cls, kwargs, host)
        super().__init__(local_params(offload, model, params), dict(hyper.opt.defaults))
        self.hyper = hyper  # refuses at step() what opt_cls's step would refuse later
        self._ids = frozenset(id(p) for g in self.param_groups for p in g["params"])
        check_in_model(self.param_groups, offload.param_unit)
        if offload.grads is not None:
            check_whole_units(offload.units, self._ids, offload.policy.grads)
        self.opt_cls, self.kwargs = opt_cls, kwargs
        self.misuse = Misuse()
        self.pager = StatePager(offload, model, self.tier, host, self.host_step)
        self.chunks = build_chunks(offload, self.param_groups, opt_cls, kwargs,
                                   self.host.make_masters, self.pager.put_away)
        self.layout = Layout(self.param_groups, self.chunks)
        self.host.size_buffers(self.chunks)
        fp16 = any(p.dtype == torch.float16 for c in self.chunks for p in c.params)
        scaler = make_scaler(loss_scale, fp16)
        check_options(overlap, accumulation_steps, scaler, offload.shards)
        # Deferred steps (see step): only where the parameters are paged, so that nothing
        # reads them between step() and the next use, which applies the update first.
        overlap = overlap if overlap == "backward" else (overlap and offload.mover is not None)
        self.updater = Updater(self, offload, self.layout, self.pager, self.host)
        self.backward = BackwardSteps(offload, self.layout, self.pager, self.updater, hyper,
                                      overlap, accumulation_steps)
        self.updater.backward = weakref.proxy(self.backward)
        self.states = ChunkStates(opt_cls, self.defaults, self.layout, self.pager,
                                  self.updater, self.backward, scaler)
        try:  # a full disk fails here, not in the middle of a step
            self.pager.reserve([state_bytes(c, opt_cls, self.param_groups)
                                for c in self.chunks])
        except BaseException:
            self.close()
            raise
        _live.add(self)
        offload.optimizers.add(self)

    def close(self, apply: bool = True) -> None:
        """Applies what a step() left deferred (it is the model's; not with ``apply=False``,
        as when the model is closed without restoring it), then deletes the swap space this
        optimizer made (the state in it is lost) and leaves the model. A second close does
        nothing; any other use after it raises."""
        if self.misuse.closed:
            return
        self.misuse.closed = True
        try:
            if apply:
                self.settle()
            self.pager.drain()
        finally:
            self.offload.pending_opts.discard(self)
            self.offload.optimizers.discard(self)
            self.pager.close()
            self.host.close()
            _live.discard(self)

    def held(self) -> dict[str, tuple[list[tuple[int, int]], int]]:
        """Host memory it holds, by kind, as (ranges it mapped, bytes from malloc):
        "optimizer" the chunks' state and masters, "staging" its own mover's buffers and the
        host step's, "parked" the pages kept for the next chunk read."""
        return {"optimizer": self.pager.held(self.chunks),
                "staging": (self.host.held() + self.pager.own_mover_held(), 0),
                "parked": (list(self.pager.pool.ranges), 0)}

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Steps every chunk; with ``overlap`` (the default where parameters are paged) each
        chunk's update is deferred to the first use of its parameters (the next forward, a
        state dict, a checkpoint): its state's I/O then overlaps the forward's compute instead
        of following backward. The update is the same: its gradients and hyperparameters are
        taken now, and ``p.grad`` is None after the step."""
        self.misuse.check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.offload.settle_failed_backward()
        backward, updater = self.backward, self.updater
        self.misuse.check_scaled(self.scaler, backward.backwards)
        backward.check_torn()
        check_alone(self, _live)
        backward.take_failed_store()
        resuming = updater.deferred.resume
        if not resuming:  # before anything is taken, as torch's step refuses them
            self.hyper.check(self.param_groups)
        self.settle()  # what a previous step left, before new gradients are taken
        if resuming:  # this call retries a step that failed part way: it is now complete
            updater.deferred.resume = False
            return loss
        self.misuse.unzeroed = self.misuse.unzeroed or (bool(self.overlap)
                                                        and backward.backwards > 0)
        backward.backwards = 0
        self.misuse.scaled = False
        if self.offload.grads is not None:
            self.offload.grads.store_set_by_hand(self.layout.units())
        for shard in self.offload.shards:
            shard.pull_grad()
        scale = self.scaler.scale if self.scaler is not None else None
        if scale is not None and updater.overflow():
            self.scaler.update(overflow=True)  # skip this step: its gradients are lost
            updater.fp32_clips = []
            for chunk in self.chunks:
                updater.consume_grads(chunk)
            return loss
        if self.overlap == "backward":  # what backward did not step (no gradients) goes now
            backward.finish()
            return loss
        groups = self.layout.hyperparameters()  # of this step, for updates deferred past
        for chunk in self.chunks:               # sched.step()
            self.layout.sync_groups(chunk, groups)
        if self.overlap:
            updater.defer(scale)
        else:
            clips, updater.clips = updater.clips, []
            fp32, updater.fp32_clips = updater.fp32_clips, []
            updater.run(list(range(len(self.chunks))), scale, clips, updater.fill, record=True,
                        fp32_clips=fp32)
        if self.scaler is not None:
            self.scaler.update(overflow=False)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.misuse.check_open()
        self.offload.settle_failed_backward()  # a torn step says so, not "call step()"
        self.backward.check_torn()
        self.backward.check_unstepped()
        self.backward.backwards = 0  # what was accumulated is gone
        self.misuse.scaled = False
        self.misuse.unzeroed = False
        updater = self.updater
        if set_to_none:
            updater.had_grad.clear()
            updater.fill = frozenset()
        else:
            updater.fill = frozenset(updater.had_grad)
        updater.clips, updater.fp32_clips = [], []
        self.backward.ready.clear()
        if self.offload.grads is not None:  # deferred updates keep the gradients they took
            self.offload.grads.clear(self.layout.units(), keep=self.deferred_units())
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

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The groups are fixed once built (its chunks and their state are laid out for them):
        a group added later is refused, not left unstepped."""
        if getattr(self, "chunks", None) is None:  # torch's __init__ adds the first groups
            return super().add_param_group(param_group)
        raise ValueError(
            "tieroffload: a paged optimizer's parameter groups are fixed once built (its chunks "
            "are laid out for them): build tieroffload.optimizer(model, cls, params=[...every "
            "group...]) again, or step the new parameters with an optimizer of their own")

    def state_dict(self) -> dict[str, Any]:
        """The torch layout ({"state", "param_groups"}), with copies of the state tensors."""
        self.misuse.check_open()
        return self.states.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's: the saved state replaces the current one (a parameter with none saved
        starts afresh, as before its first step). Everything is checked before anything
        changes; a dict that does not fit raises ValueError naming the entry."""
        self.misuse.check_open()
        self.states.load_state_dict(state_dict)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (fp16); backward that, then ``step()`` unscales."""
        self.misuse.check_open()
        self.misuse.scaled = True
        return loss if self.scaler is None else loss * self.scaler.scale

    @property
    def loss_scale(self) -> float | None:
        return None if self.scaler is None else self.scaler.scale

    @property
    def skipped_steps(self) -> int:
        return 0 if self.scaler is None else self.scaler.skipped

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, *, fp32: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over this optimizer's parameters, gradients
        paged to NVMe included: returns the total norm (torch's formula, over unscaled
        gradients) and scales the gradients by ``min(1, max_norm / (norm + 1e-6))``, resident
        ones now, paged ones in the step. ``fp32`` (always so under loss scaling): DeepSpeed's
        clip, as ``tieroffload.initialize`` asks for it: the norm is taken in fp32 (that of
        each gradient, then of those) and the step multiplies the gradients' fp32 copies (the
        masters' gradients) by the coefficient, not the bf16 or fp16 gradients."""
        self.misuse.check_open()
        return self.clip_params([p for g in self.param_groups for p in g["params"]], max_norm,
                                norm_type, error_if_nonfinite, fp32)

    # -- what offload()'s hooks call ----------------------------------------------------------

    def grads_ready(self, u: Unit) -> bool:
        """With ``overlap="backward"``, in the last backward of ``accumulation_steps``: steps
        the chunk that holds ``u`` once all of its units have their gradients, while backward
        goes on with earlier layers; then starts reading the state (and the gradients earlier
        micro-batches stored) of the chunk that backward reaches next. True when ``u``'s
        gradients are taken here (held in memory until the chunk steps): they are not paged."""
        return self.backward.grads_ready(u)

    def backward_failed(self, uncount: bool = False) -> None:
        """The model's last backward raised. With ``overlap="backward"``, chunks it stepped hold
        this step's update and the others do not: training refuses to go on (``check_torn``)
        until a checkpoint is loaded. Before any chunk stepped, nothing is lost: a retry or a
        step() is as plain PyTorch's after a backward that raised. ``uncount``: it had counted
        as a micro-batch, which it is not (a step() since has reset the count already)."""
        self.backward.failed(uncount)

    def abandon_step(self) -> None:
        """Forgets what a failed, torn or deferred step left undone (the deferred updates and
        the gradients they took, a step to resume, a torn step, a failed store, state reads on
        their way), for a load that replaces every chunk's state and the model's parameters:
        none of it is to be applied, and a read that fails now (the bytes a disk error spoiled)
        is of bytes about to be replaced."""
        self.offload.settle_failed_backward()
        if self.offload.grads is not None and self.updater.deferred:
            self.offload.grads.clear(self.deferred_units())
        self.host.forget(self.chunks)
        self.pager.abandon(self.chunks)
        self.updater.deferred.clear()
        self.backward.abandon()
        self.offload.pending_opts.discard(self)

    def grads_zeroed(self, ids: set[int], set_to_none: bool | None = None) -> None:
        """A zero_grad() outside this optimizer (``model.zero_grad()``, another optimizer's)
        cleared the gradients of the parameters ``ids``: with ``set_to_none`` False, those that
        had one hold a zero ``p.grad`` in plain PyTorch, stepped where no gradient comes."""
        mine = ids & self._ids
        if not mine:
            return
        self.misuse.unzeroed = False
        updater = self.updater
        if set_to_none:
            updater.had_grad -= mine
            updater.fill = updater.fill - mine
        elif set_to_none is False:
            updater.fill = updater.fill | (updater.had_grad & mine)

    def check_zeroed(self) -> None:
        """Refuses a backward after a step() that let the gradients go, with no zero_grad()
        since: PyTorch keeps them in p.grad and adds the new ones to them."""
        self.misuse.check_zeroed()

    def check_write(self, u: Unit) -> None:
        """Refuses a write to ``u`` between an in-backward step of its chunk and ``step()``:
        PyTorch would step the written values, and here the step is already taken."""
        self.backward.check_write(u)

    @property
    def stepped_in_backward(self) -> bool:
        """True when chunks have stepped during backward and ``step()`` has not followed."""
        return bool(self.backward.stepped)

    def used_grads_of(self, params: list[torch.Tensor]) -> bool:
        """Some of ``params`` are stepped by this optimizer, whose chunks stepped during this
        backward: their gradients are used up (p.grad is None)."""
        return bool(self.backward.stepped) and any(id(p) in self._ids for p in params)

    def forward_begins(self) -> None:
        """Before the forward whose backward is the last of ``accumulation_steps``, the first
        chunk that backward steps starts in."""
        self.backward.check_torn()
        check_alone(self, _live)
        self.backward.forward_begins()

    def backward_begins(self) -> None:
        """Counts the model's backward passes (micro-batches) since the last ``step()``."""
        self.backward.backward_begins()

    def settle(self, units: list[Unit] | None = None) -> None:
        """Applies the deferred updates of the chunks that hold ``units`` (all: None), and
        frees the state of the last step's stores that are done (each forward acquire calls
        this). A backward that raised is settled first (see ``backward_failed``): a load
        that follows a torn step then clears it, and is honoured."""
        self.updater.settle(units)

    def deferred_units(self) -> list[Unit]:
        """The units of the chunks whose update is deferred: their stored gradients are taken."""
        return self.updater.deferred_units()

    def owns(self, params: list[torch.Tensor]) -> bool:
        """True when every one of ``params`` is stepped by this optimizer."""
        return self.layout.owns(params)

    def clip_params(self, params: list[torch.Tensor], max_norm: float, norm_type: float,
                    error_if_nonfinite: bool, fp32: bool = False) -> torch.Tensor:
        """``clip_grad_norm_`` over ``params``, in their order (see ``clip_grad_norm_``)."""
        if self.overlap == "backward":
            raise RuntimeError('tieroffload: overlap="backward" steps each chunk during backward, '
                               "before clip_grad_norm_ could run; use overlap=True to clip")
        pager = self.offload.grads
        wanted = {id(p) for p in params}
        stored = [(pager, c.units, ps) for c in self.chunks
                  if (ps := [p for p in c.params if id(p) in wanted])]
        if fp32 or self.scaler is not None:
            scale = 1.0 if self.scaler is None else self.scaler.scale
            total, coef = clip_fp32(params, max_norm, norm_type, error_if_nonfinite, stored,
                                    scale, self.updater.fp32_clips, self.scaler is not None,
                                    [p for p in params if id(p) not in self._ids])
            if coef is not None:  # (host step: the masters' gradients are on the host)
                self.updater.fp32_clips.append((frozenset(id(p) for p in params),
                                                coef.cpu() if self.host_step else coef))
            return total
        total, coef, later = clip_norm(params, max_norm, norm_type, error_if_nonfinite, stored,
                                       self.updater.clips)
        if later:
            self.updater.clips.append(coef)
        return total


def optimizer(model: nn.Module, opt_cls: type[torch.optim.Optimizer],
              params: Iterable | None = None, *,
              loss_scale: str | float | LossScale | None = "auto",
              overlap: bool | str = True, accumulation_steps: int = 1,
              **kwargs: Any) -> PagedOptimizer:
    """A ``torch.optim.Optimizer`` over an offloaded model whose state lives in
    ``policy.optimizer`` ("cpu" or "nvme"; "gpu" with CUDA compute) and is stepped in chunks.
    ``params``: param groups as torch accepts them (default: all of the model's).

    fp16 and bf16 parameters get fp32 master copies in the optimizer's tier (taken from their
    values now); the step updates the masters and writes them back rounded. ``loss_scale``:
    "auto" (dynamic when any parameter is fp16, else none), "dynamic", a fixed number, a
    ``LossScale`` (``tieroffload.initialize`` passes DeepSpeed's), or None;
    with scaling, backward ``opt.scale_loss(loss)``, and a step whose gradients overflow is
    skipped (``opt.skipped_steps``). ``overlap``: defer each chunk's update to the next use of
    its parameters (see ``PagedOptimizer.step``); ``"backward"`` steps each chunk during
    backward, as soon as its gradients are final (single process, no loss scaling, and no
    clipping between backward and ``step()``, which then only steps what got no gradient): its
    I/O then overlaps backward's compute, and the last micro-batch's gradients never go to
    NVMe. With gradient accumulation, ``accumulation_steps`` says how many backward passes
    make one step: the chunks step during the last of them."""
    check_optimizer_class(opt_cls)
    if params is not None:
        params = list(params)
    return PagedOptimizer(model, opt_cls, params, kwargs, loss_scale, overlap,
                          accumulation_steps)

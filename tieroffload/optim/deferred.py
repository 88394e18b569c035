"""Updating chunks: pipelined over the chunks' state, gradients and parameters, now or
deferred from ``step()`` to the first use of each chunk's parameters."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..core.units import Unit
from .layout import Chunk, Layout
from .masters import HostStep
from .pager import StatePager

if TYPE_CHECKING:
    from ..hooks.state import OffloadState

Grads = list[torch.Tensor | None] | None  # a chunk's gradients (None: in the gradient pager)
# clip_grad_norm_ coefficients under loss scaling, each with the ids of the parameters it
# clips: they multiply the fp32 gradients once unscaled (see hooks.steps.clip_fp32).
Fp32Clips = list[tuple[frozenset[int], torch.Tensor]]



class InBackward(Protocol):
    """What the updater needs of the in-backward steps (``in_backward.BackwardSteps``)."""

    stepped: set[int]

    def read_tail(self, units: list[Unit] | None) -> None: ...

class Deferred:
    """The update a step() took and has not applied yet: each chunk not yet updated with the
    gradients it took, and what all of them use (loss scale, clip coefficients, the
    parameters to fill with zero gradients). A chunk leaves it once updated, never before.
    ``resume``: a step failed part way and the rest waits here; the step() that retries it
    applies them and is then complete."""

    def __init__(self) -> None:
        self.grads: dict[int, Grads] = {}  # chunk -> its gradients
        self.scale: float | None = None
        self.clips: list[torch.Tensor] = []
        self.fp32_clips: Fp32Clips = []
        self.fill: frozenset[int] = frozenset()
        self.resume = False

    def __bool__(self) -> bool:
        return bool(self.grads)

    def keep(self, scale: float | None, clips: list[torch.Tensor],
             fill: frozenset[int], fp32_clips: Fp32Clips) -> None:
        self.scale, self.clips, self.fill, self.fp32_clips = scale, clips, fill, fp32_clips

    def clear(self) -> None:
        self.grads.clear()
        self.clips, self.fill, self.fp32_clips = [], frozenset(), []
        self.resume = False


class Updater:
    """Updates chunks, in order and pipelined (``run``), and applies the deferred updates of
    the chunks whose units are about to be used (``settle``). Keeps the gradient bookkeeping a
    step takes: clip coefficients of paged gradients not applied yet (``clips``), the
    parameters that got a gradient since ``zero_grad(set_to_none=True)`` (``had_grad``) and
    those that hold a zero ``p.grad`` in plain PyTorch now (``fill``)."""

    def __init__(self, owner: Any, offload: OffloadState, layout: Layout, pager: StatePager,
                 host: HostStep) -> None:
        # The optimizer, which ``offload.pending_opts`` holds while updates wait; weak, as is
        # ``backward``: the optimizer holds its parts, and a cycle would outlive a drop of it.
        self.owner = weakref.ref(owner)
        self.offload = offload
        self.layout = layout
        self.pager = pager
        self.host = host
        self.deferred = Deferred()
        self.backward: InBackward | None = None  # weak, set once built (it uses this one)
        self.settling = False
        self.clips: list[torch.Tensor] = []  # clip_grad_norm_ factors of paged gradients
        self.fp32_clips: Fp32Clips = []  # and of every gradient, in fp32 (DeepSpeed's clip)
        # zero_grad(set_to_none=False): plain PyTorch keeps a zero p.grad for every parameter
        # that had one, and steps it (weight decay, moments) in a step where it gets no
        # gradient; here p.grad is None after a step, so those are filled with zeros.
        self.had_grad: set[int] = set()  # got a gradient since zero_grad(set_to_none=True)
        self.fill: frozenset[int] = frozenset()  # would hold a zero p.grad now

    def settle(self, units: list[Unit] | None = None) -> None:
        """Applies the deferred updates of the chunks that hold ``units`` (all: None), and
        frees the state of the last step's stores that are done; starts the state reads an
        in-backward step wants read in this forward."""
        self.offload.settle_failed_backward()
        backward = self.backward
        if self.pager.writing and not self.settling:
            self.pager.reap(busy=bool(self.deferred) or bool(backward.stepped))
        backward.read_tail(units)
        pending = self.deferred.grads
        if not pending or self.settling:
            return
        todo = (sorted(pending) if units is None else
                sorted(self.layout.holding(units) & pending.keys()))
        if not todo:
            return
        self.settling = True
        try:
            # Called from forward hooks too, inference_mode()'s among them: the state it makes
            # must stay usable by a training step.
            with torch.inference_mode(False), torch.no_grad():
                d = self.deferred
                self.run(todo, d.scale, d.clips, d.fill,
                         record=False,  # recorded when step() took the gradients
                         fp32_clips=d.fp32_clips)
        finally:
            self.settling = False
        if not pending:
            self.offload.pending_opts.discard(self.owner())

    def defer(self, scale: float | None) -> None:
        """Takes every chunk's gradients (and the step's scale, clips, fill) for updates
        applied at the first use of its units; the first one's inputs start coming in now."""
        chunks = self.layout.chunks
        pending = self.deferred.grads
        for i, chunk in enumerate(chunks):
            pending[i] = self.take_grads(chunk)
            self.had_grad.update(self.with_grads(chunk, pending[i]))
        fill = self.fill
        for shard in self.offload.shards:
            shard.clear_grad(set_to_none=True)  # taken with the locals' gradients
        clips, self.clips = self.clips, []
        fp32_clips, self.fp32_clips = self.fp32_clips, []
        self.deferred.keep(scale, clips, fill, fp32_clips)
        # A view taken outside the hooks (``w = p.data``) reads and writes the unit's memory
        # itself, unseen: its chunk is updated now, as a plain step shows through the view.
        self.settle(self.offload.viewed())
        if pending:  # held until applied, even if the caller drops this optimizer
            self.offload.pending_opts.add(self.owner())
        # The first update waits for nothing: its state and gradients come in now, while
        # the caller gets the next batch.
        if pending:
            first = chunks[min(pending)]
            self.pager.page_in(first)
            if self.offload.grads is not None and not self.host.grads_in_ram(first):
                self.offload.grads.start_bring_in(first.units)

    def run(self, todo: list[int], scale: float | None, clips: list[torch.Tensor],
            fill: frozenset[int], record: bool, fp32_clips: Fp32Clips | None = None) -> None:
        """Updates chunks ``todo`` in order (gradients times ``clips``, and ``fp32_clips``
        once unscaled), pipelined: chunk i+1's
        state, gradients and parameters come in while chunk i is updated, and chunk i-1's state
        goes out. After the last, the next deferred chunk's state starts coming in."""
        chunks = self.layout.chunks
        sched = self.offload.scheduler if self.offload.mover is not None else None
        done = 0
        try:
            for k in range(len(todo)):
                self._run_chunk(todo, k, sched, scale, clips, fill, record, fp32_clips or [])
                done += 1  # updated: a failure from here on must not update it again
                self.consume_grads(chunks[todo[k]])
                self.pager.page_out(chunks[todo[k]])
        except BaseException:
            self.host.forget(chunks)  # copies taken ahead: a retry takes them afresh
            # The chunks not updated wait deferred with their gradients, so that retrying
            # the call that failed updates each of them once (and those done, not again).
            pending = self.deferred.grads
            for i in todo[done:]:
                if i not in pending:
                    pending[i] = self.take_grads(chunks[i])
                    self.deferred.resume = True
            self.deferred.keep(scale, clips, fill, fp32_clips or [])
            raise
        # The last stores go on beside what follows the step: the next forward's acquires
        # free them (see settle), where a failed one raises from a call that a retry redoes
        # whole. Waiting here left the disk's last writes unhidden, and a store that failed
        # here failed a step() already complete, which a retry would apply again.

    def _run_chunk(self, todo: list[int], k: int, sched: Any, scale: float | None,
                   clips: list[torch.Tensor], fill: frozenset[int], record: bool,
                   fp32_clips: Fp32Clips) -> None:
        """Updates chunk ``todo[k]`` (see ``run``): its state, gradients and parameters in,
        the next chunk's on their way."""
        chunks = self.layout.chunks
        pending = self.deferred.grads
        grads_pager = self.offload.grads
        i = todo[k]
        chunk = chunks[i]
        self.pager.state_in(chunk)  # read ahead, except the first
        if sched is not None:  # held while the next chunk is prefetched: it must stay
            sched.acquire(chunk.units, force=True, record=False)
        try:
            nxt = chunks[todo[k + 1]] if k + 1 < len(todo) else None
            ahead = nxt or next((chunks[j] for j in sorted(pending) if j > i), None)
            if chunk.masters and chunk.host_grads is None and grads_pager is None:
                self.host.grads_out(chunk, pending.get(i))  # before the next chunk's
            if ahead is not None:
                # Earlier chunks' stores first: their pages go to the state read next.
                self.pager.drain()
                self.pager.page_in(ahead)
                if grads_pager is not None and not self.host.grads_in_ram(ahead):
                    grads_pager.start_bring_in(ahead.units)
                if sched is not None and nxt is not None:
                    sched.prefetch(nxt.units)
                if nxt is not None and nxt.masters and grads_pager is None:
                    # Its gradients leave the device while this chunk is updated.
                    self.host.grads_out(nxt, pending.get(todo[k + 1]))
            grads = pending.get(i)
            if grads is not None:
                for p, g in zip(chunk.params, grads):
                    p.grad = g
            if self.host.grads_in_ram(chunk):
                self.host.grads_from_ram(chunk, clips)
            elif grads_pager is not None:
                grads_pager.bring_in(chunk.units)
            self.step_chunk(chunk, scale, clips, fill, record, fp32_clips)
            # Deferred until updated: a deferred update that fails (a read of its gradients,
            # in the forward that settles it) stays deferred, and is not taken for a step that
            # failed part way (see run), which would skip the caller's next step().
            pending.pop(i, None)
            if grads is not None:  # used up: the user's zero_grad may already have run
                for p in chunk.params:
                    p.grad = None
        finally:
            if sched is not None:
                sched.release(chunk.units)

    def step_chunk(self, chunk: Chunk, scale: float | None, clips: list[torch.Tensor],
                   fill: frozenset[int], record: bool, fp32_clips: Fp32Clips = ()) -> None:
        """Updates the chunk with the gradients it has (``p.grad``, or its masters' host
        copies); those in ``fill`` that have none get zeros; ``record``: note which had one.
        ``scale``: they are divided by it, then multiplied by ``fp32_clips`` (in fp32 for
        fp16 and bf16 parameters: DeepSpeed's unscale and clip)."""
        for p in chunk.params:
            for c in clips:  # clip_grad_norm_ of gradients that were on NVMe
                if p.grad is not None:
                    p.grad.mul_(c.to(p.grad.device))
        if chunk.masters:
            self.host.wait_grads(chunk)
        for i, p in enumerate(chunk.params):
            q = chunk.masters.get(i)
            g = p.grad if q is None else chunk.host_grads.get(i)  # type: ignore[union-attr]
            if g is None and id(p) in fill:
                g = torch.zeros_like(p if q is None else q, memory_format=torch.preserve_format)
                if q is None:
                    p.grad = g
            elif g is not None and record:
                self.had_grad.add(id(p))
            if q is not None:
                q.grad = g
            if g is not None:
                if scale is not None:
                    g.mul_(1.0 / scale)
                for ids, c in fp32_clips:
                    if id(p) in ids:
                        g.mul_(c.to(g.device))
        chunk.host_grads, chunk.grads_event = None, None
        if not chunk.masters:
            chunk.inner.step()  # offload()'s step hooks bring the chunk's parameters in and out
            return
        self.host.step(chunk)

    def with_grads(self, chunk: Chunk, grads: Grads) -> set[int]:
        """Ids of the chunk's parameters that have a gradient for the step: in ``grads`` (taken
        from ``p.grad``), or, where those wait in the gradient pager (None), stored there."""
        if grads is not None:
            return {id(p) for p, g in zip(chunk.params, grads) if g is not None}
        pager = self.offload.grads
        return {id(p) for p in pager.stored(chunk.units)} if pager is not None else set()

    def take_grads(self, chunk: Chunk) -> Grads:
        """The chunk's gradients, kept for its deferred update (None: they wait on NVMe)."""
        if self.offload.grads is not None:
            return None
        grads = [p.grad for p in chunk.params]
        for p in chunk.params:
            p.grad = None
        return grads

    def consume_grads(self, chunk: Chunk) -> None:
        if self.offload.grads is not None:
            self.offload.grads.consume(chunk.units)

    def overflow(self) -> bool:
        """True when any gradient is inf or NaN (fp16 loss scaling)."""
        if self.offload.grads is not None:
            return not self.offload.grads.all_finite()
        return any(p.grad is not None and not bool(torch.isfinite(p.grad).all())
                   for c in self.layout.chunks for p in c.params)

    def deferred_units(self) -> list[Unit]:
        """The units of the chunks whose update is deferred: their stored gradients are taken."""
        return [u for i in self.deferred.grads for u in self.layout.chunks[i].units]

"""Gradients paged off the compute device: to NVMe (``Policy(grads="nvme")``), or to pinned
host RAM with CUDA compute (``grads="cpu"``).

When a unit's backward is done, ``p.grad`` goes back to None and the mover thread adds those
gradients to what earlier micro-batches stored (``stored + new``: the sum AccumulateGrad makes)
and writes them to their home, while backward goes on; gradients never pile up where compute
runs. On CUDA the mover's copies run on its own stream after an event of the compute stream,
which is never synchronised. The paged optimizer reads them back chunk by chunk for its step
(the host step reads a RAM home in place), which consumes them.
"""

from __future__ import annotations

import collections
from typing import Callable

import torch

from ..aio.pages import PagePool
from ..core.homes import Home, RamHome
from ..core.mover import Mover, Ticket, timed_wait
from ..core.stats import Stats
from ..core.units import Unit


class GradPager:
    """One model's paged gradients: a buffer per unit, summed into its home as each unit's
    backward ends, brought back for a step, which consumes them (see the module's text)."""

    DEPTH = 2  # units whose gradients may wait for the mover at once

    def __init__(self, units: list[Unit], home: Callable[[int], Home], mover: Mover,
                 stats: Stats) -> None:
        """``home(nbytes)``: where one unit's gradients are stored (an NVMe extent, or a pinned
        RAM buffer of exactly that size)."""
        self.pending: collections.deque[Ticket] = collections.deque()  # stores
        self.incoming: dict[int, Ticket] = {}  # loads for the step, by unit
        self.mover = mover
        self.stats = stats
        self.buffers: dict[int, Unit] = {}
        self._params: dict[int, list[torch.nn.Parameter]] = {}  # see _grad_params
        self.has: dict[int, list[bool]] = {}  # per parameter: a gradient is stored
        self.finite: dict[int, bool] = {}  # per unit: its stored gradients hold no inf/NaN
        # Per unit: clip coefficients of a plain optimizer's clip_grad_norm_ not yet applied to
        # its stored gradients; they multiply them as they come in (or before more are added).
        self.clips: dict[int, list[torch.Tensor]] = {}
        for u in units:
            grads = [(f"{n}.grad", torch.empty_like(p, device=mover.device,
                                                    memory_format=torch.contiguous_format))
                     for n, p in zip(u.names, u.params) if p.requires_grad]
            if not grads:
                continue
            g = Unit(u.id, f"gradients of {u.name}", grads)
            g.kind = "grads"
            g.home = home(g.nbytes)
            if g.home.tier == "nvme" and not mover.cuda:  # O_DIRECT straight in: no staging
                g.adopt_flat(g.home.swap.align)
            g.free()
            self.buffers[u.id] = g
            self._params[u.id] = [p for p in u.params if p.requires_grad]
            self.has[u.id] = [False] * len(grads)
        # Pages of gradients written out, for the next unit's: one unit's worth at most.
        self.pool = PagePool(max((g.flat.numel() for g in self.buffers.values()
                                  if g.flat is not None), default=0))
        self.in_ram = any(isinstance(g.home, RamHome) for g in self.buffers.values())

    def _grad_params(self, u: Unit) -> list[torch.nn.Parameter]:
        """The parameters whose gradients the unit's buffer holds, in its segments' order: those
        that required grad at offload, whatever ``requires_grad`` says now (a parameter frozen
        after a step keeps its stored gradient for that step's deferred update)."""
        return self._params.get(u.id, [])

    def stored(self, units: list[Unit]) -> list[torch.nn.Parameter]:
        """The parameters of ``units`` whose gradients are stored."""
        return [p for u in units if u.id in self.has
                for p, h in zip(self._grad_params(u), self.has[u.id]) if h]

    def page_out(self, u: Unit) -> None:
        """Hands the unit's fresh gradients to the mover thread, which adds them to the stored
        ones and writes them out while backward goes on. At most ``DEPTH`` units' gradients
        wait in memory for it."""
        g = self.buffers.get(u.id)
        if g is None:
            return
        params = self._grad_params(u)
        fresh = [p.grad for p in params]
        if all(f is None for f in fresh):
            return
        for p in params:
            p.grad = None
        has = self.has[u.id]
        prior = list(has)
        clips = self.clips.pop(u.id, [])
        for i, f in enumerate(fresh):
            has[i] = has[i] or f is not None

        def job() -> None:
            g.allocate(self.pool)  # every byte is read or copied below
            if any(prior):
                self.mover.move_now(g, write=False)
            for f, seg, old in zip(fresh, g.segments, prior):
                for c in clips if old else ():
                    seg.param.data.mul_(c)
                if f is not None:
                    if old:
                        seg.param.data.add_(f)
                    else:
                        seg.param.data.copy_(f)
            self.finite[u.id] = all(bool(torch.isfinite(s.param.data).all()) for s in g.segments)
            self.mover.move_now(g, write=True)
            g.free(self.pool)

        self.pending.append(self.mover.submit(job, "grads"))
        while len(self.pending) > self.DEPTH:
            timed_wait(self.pending.popleft(), self.stats)

    def store_set_by_hand(self, units: list[Unit]) -> None:
        """Stores what ``p.grad`` holds outside backward (set by hand: gradient surgery, a
        custom all-reduce) as backward's own gradients are stored: added to what is there."""
        for u in units:
            if any(p.grad is not None for p in self._grad_params(u)):
                self.page_out(u)
        self.flush()

    def flush(self) -> None:
        """Waits until every gradient handed out is stored."""
        while self.pending:
            timed_wait(self.pending.popleft(), self.stats)

    def start_bring_in(self, units: list[Unit]) -> None:
        """Starts reading the units' gradients back (the step's next chunk)."""
        self.flush()
        for u in units:
            g = self.buffers.get(u.id)
            if g is not None and any(self.has[u.id]) and u.id not in self.incoming:
                g.allocate(self.pool)
                self.incoming[u.id] = self.mover.load(g)

    def bring_in(self, units: list[Unit]) -> None:
        """Sets ``p.grad`` of the units' parameters from NVMe, for the optimizer step."""
        self.start_bring_in(units)
        for u in units:
            if u.id in self.incoming:
                timed_wait(self.incoming.pop(u.id), self.stats)
        for u in units:
            g = self.buffers.get(u.id)
            if g is None or not any(self.has[u.id]):
                continue
            for p, seg, h in zip(self._grad_params(u), g.segments, self.has[u.id]):
                p.grad = seg.param.data if h else None
                for c in self.clips.get(u.id, ()) if h else ():
                    p.grad.mul_(c)  # a copy brought in: what is stored stays unclipped

    def put_back(self, units: list[Unit]) -> None:
        """Undoes ``bring_in`` without using the gradients up: they stay stored on NVMe."""
        for u in units:
            g = self.buffers.get(u.id)
            if g is None:
                continue
            for p in self._grad_params(u):
                p.grad = None
            g.free(self.pool)

    def merge(self, u: Unit) -> None:
        """For a step during the last micro-batch's backward: adds what earlier micro-batches
        stored to the unit's fresh gradients (``stored + new``, as ``page_out``), in memory;
        ``p.grad`` is then the sum, and nothing of the unit counts as stored any more."""
        if not any(self.has.get(u.id, ())):
            return
        params = self._grad_params(u)
        fresh = [p.grad for p in params]
        self.bring_in([u])
        for p, f in zip(params, fresh):
            stored = p.grad  # a view of the unit's buffer, which is freed below
            if stored is None:
                p.grad = f
            elif f is None:
                p.grad = stored.clone()
            else:
                p.grad = f.add_(stored)  # = stored + new: addition is commutative, bit for bit
        self.has[u.id] = [False] * len(params)
        # Nothing may keep viewing the buffer: paged out again (a step() that finds these
        # gradients in p.grad stores them), it would be refilled under them.
        self.buffers[u.id].free(self.pool)

    def consume(self, units: list[Unit]) -> None:
        """After the step: the gradients are used up."""
        self.put_back(units)
        for u in units:
            if u.id in self.buffers:
                self.has[u.id] = [False] * len(self.has[u.id])
                self.finite.pop(u.id, None)
                self.clips.pop(u.id, None)

    def clear(self, units: list[Unit] | None = None, keep: list[Unit] = ()) -> None:
        """Forgets the stored gradients of ``units`` (all: None), except those of ``keep`` (a
        deferred step's): what zero_grad means for gradients that ``p.grad`` does not show."""
        self.flush()
        ids = set(self.has) if units is None else {u.id for u in units} & self.has.keys()
        ids -= {u.id for u in keep}
        for uid in ids:
            if uid in self.incoming:  # a read of what is dropped
                timed_wait(self.incoming.pop(uid), self.stats)
                self.buffers[uid].free(self.pool)
            self.has[uid] = [False] * len(self.has[uid])
            self.finite.pop(uid, None)
            self.clips.pop(uid, None)

    def host_grads(self, units: list[Unit], clips: list[torch.Tensor]
                   ) -> dict[int, torch.Tensor]:
        """The stored gradients of ``units`` in a RAM home, by parameter id, for a step on the
        host: the home's own memory, or, where clip coefficients are pending (the pager's,
        then ``clips``), a copy multiplied by them in the gradients' dtype, as
        ``clip_grad_norm_`` multiplies ``p.grad``; what is stored stays unclipped."""
        self.flush()
        host = torch.device("cpu")
        clips = [c.to(host) for c in clips]  # once: each .to() of a GPU scalar waits for it
        out = {}
        for u in units:
            g = self.buffers.get(u.id)
            if g is None:
                continue
            if u.id in self.incoming:  # read back for a merge that did not happen: not needed,
                timed_wait(self.incoming.pop(u.id), self.stats)  # but done before it is freed
            coefs = [c.to(host) for c in self.clips.get(u.id, [])] + clips
            for k, (p, h) in enumerate(zip(self._grad_params(u), self.has[u.id])):
                if not h:
                    continue
                t = g.home.view(g, k)  # type: ignore[union-attr]
                if coefs:
                    t = t.clone()
                    for c in coefs:
                        t.mul_(c)
                out[id(p)] = t
        return out

    def close(self) -> None:
        self.flush()
        self.pool.clear()
        for g in self.buffers.values():
            if isinstance(g.home, RamHome):
                g.home.release()  # pinned: unregistered now, not when the state goes

    def all_finite(self) -> bool:
        self.flush()
        return all(self.finite.values())

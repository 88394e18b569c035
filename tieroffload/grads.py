"""Gradients paged to NVMe (``Policy(grads="nvme")``).

When a unit's backward is done its gradients are added to what earlier micro-batches left on
NVMe (``stored + new``: the same sum AccumulateGrad makes) and written there, and ``p.grad`` goes
back to None, so gradients never pile up in RAM. The paged optimizer reads them back chunk by
chunk for its step, which consumes them.
"""

from __future__ import annotations

import torch

from .swap import SwapSpace
from .tiers import Mover, NvmeHome, Stats, Unit, timed_wait


class GradPager:
    def __init__(self, units: list[Unit], swap: SwapSpace, mover: Mover, stats: Stats) -> None:
        self.mover = mover
        self.stats = stats
        self.buffers: dict[int, Unit] = {}
        self.has: dict[int, list[bool]] = {}  # per parameter: a gradient is stored
        self.finite: dict[int, bool] = {}  # per unit: its stored gradients hold no inf/NaN
        for u in units:
            grads = [(f"{n}.grad", torch.empty_like(p, memory_format=torch.contiguous_format))
                     for n, p in zip(u.names, u.params) if p.requires_grad]
            if not grads:
                continue
            g = Unit(u.id, f"gradients of {u.name}", grads)
            g.home = NvmeHome(swap, g.nbytes)
            g.free()
            self.buffers[u.id] = g
            self.has[u.id] = [False] * len(grads)

    def _grad_params(self, u: Unit) -> list[torch.nn.Parameter]:
        return [p for p in u.params if p.requires_grad]

    def page_out(self, u: Unit) -> None:
        """Adds the unit's fresh gradients to the stored ones and writes them out."""
        g = self.buffers.get(u.id)
        if g is None:
            return
        params = self._grad_params(u)
        has = self.has[u.id]
        if not any(p.grad is not None for p in params):
            return
        g.allocate()
        if any(has):
            timed_wait(self.mover.load(g), self.stats)
        for i, (p, seg) in enumerate(zip(params, g.segments)):
            if p.grad is None:
                continue
            buf = seg.param.data
            if has[i]:
                buf.add_(p.grad)
            else:
                buf.copy_(p.grad)
                has[i] = True
            p.grad = None
        self.finite[u.id] = all(bool(torch.isfinite(s.param.data).all()) for s in g.segments)
        timed_wait(self.mover.store(g), self.stats)
        g.free()

    def bring_in(self, units: list[Unit]) -> None:
        """Sets ``p.grad`` of the units' parameters from NVMe, for the optimizer step."""
        tickets = []
        for u in units:
            g = self.buffers.get(u.id)
            if g is not None and any(self.has[u.id]):
                g.allocate()
                tickets.append(self.mover.load(g))
        for t in tickets:
            timed_wait(t, self.stats)
        for u in units:
            g = self.buffers.get(u.id)
            if g is None or not any(self.has[u.id]):
                continue
            for p, seg, h in zip(self._grad_params(u), g.segments, self.has[u.id]):
                p.grad = seg.param.data if h else None

    def consume(self, units: list[Unit]) -> None:
        """After the step: the gradients are used up."""
        for u in units:
            g = self.buffers.get(u.id)
            if g is None:
                continue
            for p in self._grad_params(u):
                p.grad = None
            g.free()
            self.has[u.id] = [False] * len(self.has[u.id])
            self.finite.pop(u.id, None)

    def clear(self) -> None:
        for uid in self.has:
            self.has[uid] = [False] * len(self.has[uid])
        self.finite.clear()

    def all_finite(self) -> bool:
        return all(self.finite.values())

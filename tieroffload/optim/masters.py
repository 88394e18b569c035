"""fp32 master copies and the host step: a chunk's fp16/bf16 parameters (and, for the host
step, every parameter on the compute device) are stepped as fp32 copies where the optimizer's
state lives, their gradients copied there and the results copied back rounded."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..compat.tensors import version
from ..core.devices import HostBuffers, Transfers
from ..core.units import Unit

if TYPE_CHECKING:
    from ..hooks.state import OffloadState
    from .layout import Chunk

LOW_PRECISION = (torch.float16, torch.bfloat16)


class HostStep:
    """The chunks' fp32 masters: takes them, makes a write from outside reach the master before
    the step (``sync``), copies the gradients to them (``grads_out``, ``grads_from_ram``) and
    the stepped values back (``back``), through host buffers it owns (pinned for CUDA)."""

    def __init__(self, offload: OffloadState, host: torch.device) -> None:
        self.offload = offload
        self.host = host
        self.xfer = Transfers(offload.device)
        self.grad_bufs: HostBuffers | None = None
        self.copy_bufs: HostBuffers | None = None
        self.grad_slot = 0
        self.back_event: Any = None

    def needs_master(self, p: torch.Tensor) -> bool:
        """An fp32 copy where the optimizer steps: for fp16/bf16 parameters, and for every
        parameter the host steps for a device."""
        return p.dtype in LOW_PRECISION or p.device.type != self.host.type  # cuda == cuda:0

    def make_masters(self, ps: list[nn.Parameter], units: list[Unit]) -> dict[int, nn.Parameter]:
        """The masters of a chunk's parameters ``ps`` that need one, by position, taken from
        their values now."""
        if not any(self.needs_master(p) for p in ps):
            return {}
        with self.offload.resident(units):
            return {i: nn.Parameter(p.detach().to(self.host, torch.float32, copy=True),
                                    requires_grad=p.requires_grad)
                    for i, p in enumerate(ps) if self.needs_master(p)}

    def size_buffers(self, chunks: list[Chunk]) -> None:
        """The host step's buffers, sized for the largest chunk: two of fp32 gradients (one
        chunk's in use while the next one's arrive) and one of working copies on their way
        back; pinned for CUDA."""
        sized = [[c.params[i] for i in c.masters] for c in chunks if c.masters]
        if not sized or self.host.type == "cuda":  # masters on the GPU: no host step
            return

        def span(ts: list[torch.Tensor], itemsize: int | None) -> int:
            return sum(-(-t.numel() * (itemsize or t.element_size()) // 64) * 64 for t in ts)
        pin = self.xfer.cuda
        stats = self.offload.stats
        self.grad_bufs = HostBuffers(max(span(ts, 4) for ts in sized), 2, pin, stats)
        self.copy_bufs = HostBuffers(max(span(ts, None) for ts in sized), 1, pin, stats)

    def step(self, chunk: Chunk) -> None:
        """Steps the chunk's inner optimizer over its masters, their parameters resident and
        written back after."""
        with self.offload.resident(chunk.units, writeback=True):
            self.sync(chunk)
            chunk.inner.step()
            self.back(chunk)
            chunk.versions = {i: version(chunk.params[i]) for i in chunk.masters}

    def sync(self, chunk: Chunk) -> None:
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

    def grads_out(self, chunk: Chunk, grads: list[torch.Tensor | None] | None) -> None:
        """Starts copying the gradients of the chunk's master-backed parameters (``grads``, or
        their ``p.grad``) to host fp32 buffers; ``wait_grads`` waits for them."""
        have = [(i, g) for i in chunk.masters
                if (g := (grads[i] if grads is not None else chunk.params[i].grad)) is not None]
        if self.grad_bufs is None:  # fp32 masters on the GPU (optimizer="gpu"), beside them
            chunk.host_grads = {i: g.to(torch.float32, copy=True) for i, g in have}
            chunk.grads_event = None
            return
        views = self.grad_bufs.views(self.grad_slot, [g for _, g in have], torch.float32)
        self.grad_slot += 1
        ev = None
        for (_, g), v in zip(have, views):
            ev = self.xfer.to_host(g, v)
        chunk.host_grads = {i: v for (i, _), v in zip(have, views)}
        chunk.grads_event = ev

    def wait_grads(self, chunk: Chunk) -> None:
        """The chunk's master gradients are on the host after this (copied now if not yet)."""
        if chunk.host_grads is None:
            self.grads_out(chunk, None)
        self.xfer.wait(chunk.grads_event)

    def grads_in_ram(self, chunk: Chunk) -> bool:
        """The host steps the chunk with gradients paged to pinned RAM (``grads="cpu"`` with
        CUDA): it reads them where they are, with no trip back to the device."""
        pager = self.offload.grads
        return (self.grad_bufs is not None and pager is not None and pager.in_ram
                and len(chunk.masters) == len(chunk.params))

    def grads_from_ram(self, chunk: Chunk, clips: list[torch.Tensor]) -> None:
        """Sets ``chunk.host_grads`` from the RAM home of its paged gradients: each one times
        the clip coefficients in its own dtype (as torch clips ``p.grad``), then in fp32."""
        stored = self.offload.grads.host_grads(chunk.units, clips)  # type: ignore[union-attr]
        have = [(i, stored[id(chunk.params[i])]) for i in chunk.masters
                if id(chunk.params[i]) in stored]
        views = self.grad_bufs.views(self.grad_slot, [g for _, g in have], torch.float32)
        self.grad_slot += 1
        for (_, g), v in zip(have, views):
            v.copy_(g)
        chunk.host_grads = {i: v for (i, _), v in zip(have, views)}
        chunk.grads_event = None

    def back(self, chunk: Chunk) -> None:
        """The updated masters, rounded to their parameters' dtype on the host, go back to
        the parameters (on the side stream for CUDA; the compute stream waits for them)."""
        if self.copy_bufs is None:  # fp32 masters on the GPU (optimizer="gpu")
            for i, q in chunk.masters.items():
                chunk.params[i].copy_(q)
                q.grad = None
            return
        self.xfer.wait(self.back_event)  # the buffer's last copies are done
        idx = list(chunk.masters)
        views = self.copy_bufs.views(0, [chunk.params[i] for i in idx])
        ev = None
        for i, v in zip(idx, views):
            q = chunk.masters[i]
            v.copy_(q)
            ev = self.xfer.to_device(v, chunk.params[i])
            q.grad = None
        self.back_event = ev
        if self.offload.mover is not None:  # the unit is written home next: values first
            self.xfer.wait(ev)

    def forget(self, chunks: list[Chunk]) -> None:
        """Drops the gradient copies taken ahead: a retry takes them afresh."""
        for c in chunks:
            c.host_grads, c.grads_event = None, None

    def held(self) -> list[tuple[int, int]]:
        """The ranges of its host buffers."""
        return [r for b in (self.grad_bufs, self.copy_bufs) if b is not None for r in b.held()]

    def close(self) -> None:
        for bufs in (self.grad_bufs, self.copy_bufs):
            if bufs is not None:
                bufs.close()

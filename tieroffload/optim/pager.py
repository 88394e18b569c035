"""Paging each chunk's optimizer state (its moments and fp32 masters) between host memory and
NVMe, as one ``Unit`` per chunk moved by a ``Mover``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..aio.pages import PagePool
from ..aio.swap import SwapSpace, stable_tag
from ..core.homes import NvmeHome
from ..core.mover import NBUF, Mover, timed_wait
from ..core.units import State, Unit
from .layout import CHUNK_BYTES, Chunk

if TYPE_CHECKING:
    from ..hooks.state import OffloadState


class StatePager:
    """Pages the chunks' state (``optimizer="nvme"``; other tiers keep it where it is). At most
    one read or store is in flight per chunk (``chunk.pending``); a chunk's memory goes to the
    pool only once its store completes, and a chunk wanted again while its store is on its way
    stays (``chunk.keep``). A failed read is read once more before it raises; a failed store
    leaves the state resident and dirty, written again later. Owns the swap space, engine and
    mover it makes (``close``)."""

    def __init__(self, offload: OffloadState, model: nn.Module, tier: str,
                 host: torch.device, host_step: bool) -> None:
        self.offload = offload
        self.tier = tier
        self.swap: SwapSpace | None = None
        self.mover = offload.mover
        self.owned: list[Any] = []  # engine, mover and swap made here, closed by close()
        # Pages of a chunk's state written out, for the next chunk read: one chunk at most.
        self.pool = PagePool(0)
        self.writing: list[Chunk] = []  # chunks whose state is being written, oldest first
        if tier != "nvme":
            return
        policy = offload.policy
        engine = offload.engine
        if self.mover is None or host_step:
            # Not offloaded, or a host state (its mover moves host memory): our own.
            if engine is None:
                engine = policy.io.engine()
                self.owned.append(engine)
            self.mover = Mover(host, CHUNK_BYTES, NBUF, offload.stats, checksum=policy.checksum)
            self.owned.append(self.mover)
        self.swap = offload.swap
        if self.swap is None:
            names = [n for n, _ in model.named_parameters()]
            if not policy.nvme_dir:
                raise ValueError('optimizer="nvme" needs nvme_dir in the policy')
            self.swap = SwapSpace(policy.nvme_dir, 0, stable_tag(names) + "-optim", engine)
            self.owned.insert(0, self.swap)

    def page_in(self, chunk: Chunk) -> None:
        """Starts bringing the chunk's state back (no wait). State still being written is
        still here: it stays once written, with nothing to read."""
        u = chunk.state_unit
        if chunk in self.writing:
            chunk.keep = True
        if u is None or u.state is not State.AWAY:
            return
        u.allocate(self.pool)  # the load overwrites every byte
        u.move_to(State.FETCHING)
        chunk.pending = self.mover.load(u)

    def wait(self, chunk: Chunk, retry: bool = True) -> None:
        """Waits for the chunk's state read or store. A read that failed is read once more,
        now, before its error is raised: started ahead of its use (in the forward before, or
        chunks ahead in backward), its error would fail whatever met it next, inside backward
        after chunks had stepped a torn step, where the disk may have recovered since."""
        if chunk in self.writing:
            self.writing.remove(chunk)
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
                    u.move_to(State.AWAY)
                    if retry and isinstance(e, Exception):
                        self.page_in(chunk)
                        self.wait(chunk, retry=False)
                        return
                else:  # memory holds the only copy, as a unit's failed write leaves it
                    u.move_to(State.RESIDENT)
                    u.dirty = True
                raise
            if u.state is State.FETCHING:
                u.move_to(State.RESIDENT)
            elif not keep:  # a store finished: the memory can go
                u.free(self.pool)
                u.move_to(State.AWAY)
            else:  # wanted again while its store was on its way: it stays
                u.move_to(State.RESIDENT)

    def page_out(self, chunk: Chunk) -> None:
        """Starts writing the chunk's state to NVMe; its memory is freed once written."""
        if self.tier != "nvme":
            return
        tensors = chunk.state_tensors()
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
        chunk.state_unit.dirty = False
        chunk.pending = self.mover.store(chunk.state_unit)
        chunk.state_unit.move_to(State.WRITING)  # freed once wait() sees the store done
        self.writing.append(chunk)

    def state_in(self, chunk: Chunk) -> None:
        """Makes the chunk's state resident: waits for its last store (the update reads the
        state back), starts its read unless one is already on its way, and waits for it."""
        if chunk in self.writing:
            self.wait(chunk)
        self.page_in(chunk)
        self.wait(chunk)

    def drain(self, keep: int = 0) -> None:
        """Waits for the state stores in flight but the newest ``keep``; the memory of those
        done goes to the pool."""
        self.free_stored()
        while len(self.writing) > keep:
            self.wait(self.writing[0])

    def free_stored(self) -> None:
        """Gives the memory of the chunks whose store is done to the pool (no wait)."""
        for chunk in [c for c in self.writing if c.pending is None or c.pending.done()]:
            self.wait(chunk)

    def reap(self, busy: bool) -> None:
        """``free_stored``; once no store is left and no step is under way (``busy``: one
        is), the pages kept for the next chunk's read go back: until the next step they serve
        nothing."""
        self.free_stored()
        if not self.writing and not busy:
            self.pool.clear()
            if self.offload.grads is not None:
                self.offload.grads.pool.clear()

    def resident(self, chunk: Chunk) -> _Resident:
        """Context: the chunk's state is in memory inside the block, and away after it."""
        return _Resident(self, chunk)

    def put_away(self, chunk: Chunk) -> None:
        """Pages the chunk's state out and waits until it is written."""
        self.page_out(chunk)
        self.wait(chunk)

    def replace(self, chunk: Chunk, saved_of: Callable[[nn.Parameter], dict | None]) -> None:
        """Replaces one chunk's state with ``saved_of(param)`` (a checked dict of its state,
        or None: no state, as before the first step) and pages it out: one chunk in memory at
        a time. Tensors of the same name, shape and dtype are filled in place, so the paged
        layout stays valid; any other change makes a new one."""
        self.wait(chunk)
        if chunk.state_unit is not None and chunk.state_unit.state is State.AWAY:
            chunk.state_unit.allocate()  # what is kept is refilled below, the rest dropped
            chunk.state_unit.move_to(State.RESIDENT)
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
        if chunk.state_unit is not None and not chunk.state_tensors():
            chunk.state_unit.free()  # no state left: nothing to page
            chunk.state_unit.home.release()
            chunk.state_unit = None
        self.page_out(chunk)
        self.wait(chunk)

    def abandon(self, chunks: list[Chunk]) -> None:
        """Waits out the reads and stores on their way, their errors ignored: the state is
        about to be replaced whole."""
        for chunk in chunks:
            if chunk.pending is not None:
                try:
                    self.wait(chunk, retry=False)
                except Exception:  # of bytes the load that follows replaces
                    pass
        self.writing.clear()

    def held(self, chunks: list[Chunk]) -> tuple[list[tuple[int, int]], int]:
        """Host memory the chunks' state holds, as (ranges mapped, bytes from malloc)."""
        ranges, heap = [], 0
        for c in chunks:
            if c.state_unit is not None:
                r, h = c.state_unit.held()
            else:
                r, h = [], sum(t.untyped_storage().nbytes() for _, t in c.state_tensors()
                               if t.device.type == "cpu")
            ranges += r
            heap += h
        return ranges, heap

    def own_mover_held(self) -> list[tuple[int, int]]:
        """The staging buffers of the mover made here (none where it is the model's)."""
        return self.mover.held() if self.mover is not None and self.mover in self.owned else []

    def reserve(self, sizes: list[int]) -> None:
        """Reserves the swap space for the chunks' state: a full disk fails here, not in the
        middle of a step."""
        if self.tier == "nvme":
            self.swap.reserve(sizes)

    def close(self) -> None:
        """Closes the swap space, engine and mover made here; the state in them is lost."""
        for thing in self.owned:
            thing.close()
        self.owned.clear()
        self.pool.clear()


class _Resident:
    """The block of ``StatePager.resident``: reads the chunk's state in, and on leaving frees
    it (a store that failed before: writes it again instead)."""

    def __init__(self, pager: StatePager, chunk: Chunk) -> None:
        self.pager, self.chunk = pager, chunk

    def __enter__(self) -> None:
        self.pager.wait(self.chunk)
        self.pager.page_in(self.chunk)
        self.pager.wait(self.chunk)
        self.paged = self.chunk.state_unit is not None

    def __exit__(self, *exc: object) -> None:
        if self.paged:
            if self.chunk.state_unit.dirty:  # a store failed: written again, not dropped
                self.pager.page_out(self.chunk)
                return
            u = self.chunk.state_unit
            u.free(self.pager.pool)
            u.move_to(State.AWAY)

"""Where a unit's bytes live when it is not resident: a RAM buffer or an NVMe extent."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..aio.engine import Future
from ..aio.swap import SwapSpace
from .devices import pinned_empty
from .stats import Stats

if TYPE_CHECKING:
    from .mover import Mover
    from .units import Unit


class Home:
    """Where a unit's bytes live when it is not resident."""

    tier: str

    def load(self, unit: Unit, mover: Mover) -> None:
        raise NotImplementedError

    def store(self, unit: Unit, mover: Mover) -> None:
        raise NotImplementedError

    def release(self) -> None:
        """Gives the home's space back."""


class RamHome(Home):
    """A flat buffer in RAM (pinned when a GPU is present, counted in ``stats.pinned``): for
    params="cpu" and grads="cpu" with CUDA compute."""

    tier = "cpu"

    def __init__(self, nbytes: int, pin: bool, stats: Stats) -> None:
        self.buf = pinned_empty(nbytes, pin, stats)

    def view(self, unit: Unit, k: int) -> torch.Tensor:
        """Segment ``k`` of ``unit`` as it is stored here (its dtype and shape)."""
        seg = unit.segments[k]
        p = seg.param
        return self.buf[seg.start:seg.end].view(p.dtype).view(p.shape)

    def load(self, unit: Unit, mover: Mover) -> None:
        for seg in unit.segments:
            seg.view().copy_(self.buf[seg.start:seg.end], non_blocking=True)

    def store(self, unit: Unit, mover: Mover) -> None:
        for seg in unit.segments:
            self.buf[seg.start:seg.end].copy_(seg.view(), non_blocking=True)
        mover.sync_device()

    def release(self) -> None:
        self.buf = None


class NvmeHome(Home):
    """An extent of a swap file. Moves go through the mover's staging buffers in chunks: the
    read of chunk k+1 is in flight while chunk k is copied out."""

    tier = "nvme"

    def __init__(self, swap: SwapSpace, nbytes: int) -> None:
        self.swap = swap
        self.nbytes = nbytes
        self.offset = swap.alloc(nbytes)

    def _chunks(self, mover: Mover) -> list[tuple[int, int]]:
        step = mover.chunk
        return [(a, min(a + step, self.nbytes)) for a in range(0, self.nbytes, step)]

    def _padded(self, n: int) -> int:
        return -(-n // self.swap.align) * self.swap.align

    def load(self, unit: Unit, mover: Mover) -> None:
        f = self.swap.file
        if unit.flat is not None:
            f.pread(unit.flat, self.offset).result()
            return
        chunks = self._chunks(mover)
        pending: dict[int, Future] = {}

        def issue(k: int) -> None:
            if k < len(chunks):
                a, b = chunks[k]
                buf = mover.staging_for(k)
                pending[k] = f.pread(buf, self.offset + a, self._padded(b - a))

        for k in range(min(mover.nbuf - 1, len(chunks))):
            issue(k)
        for k, (a, b) in enumerate(chunks):
            issue(k + mover.nbuf - 1)
            pending.pop(k).result()
            mover.scatter(unit, mover.staging_for(k), a, b)

    def store(self, unit: Unit, mover: Mover) -> None:
        f = self.swap.file
        if unit.flat is not None:
            f.pwrite(unit.flat, self.offset).result()
            return
        inflight: dict[int, Future] = {}
        for k, (a, b) in enumerate(self._chunks(mover)):
            slot = k % mover.nbuf
            if slot in inflight:
                inflight.pop(slot).result()
            buf = mover.staging_for(k)
            mover.gather(unit, buf, a, b)
            n = self._padded(b - a)
            if n > b - a:
                buf[b - a:n].zero_()
            inflight[slot] = f.pwrite(buf, self.offset + a, n)
        for fut in inflight.values():
            fut.result()

    def release(self) -> None:
        self.swap.free(self.offset, self.nbytes)

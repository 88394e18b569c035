"""Where a unit's bytes live when it is not resident: a RAM buffer or an NVMe extent. A home
moves them itself, through the staging buffers where it needs them (``staging.Staging``)."""

from __future__ import annotations

import torch

from ..aio.engine import Future
from ..aio.swap import SwapSpace
from .devices import pinned_empty
from .staging import Staging
from .stats import Stats
from .units import Unit


class Home:
    """Where a unit's bytes live when it is not resident."""

    tier: str

    def load(self, unit: Unit, staging: Staging) -> None:
        raise NotImplementedError

    def store(self, unit: Unit, staging: Staging) -> None:
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

    def load(self, unit: Unit, staging: Staging) -> None:
        for seg in unit.segments:
            seg.view().copy_(self.buf[seg.start:seg.end], non_blocking=True)

    def store(self, unit: Unit, staging: Staging) -> None:
        for seg in unit.segments:
            self.buf[seg.start:seg.end].copy_(seg.view(), non_blocking=True)
        staging.sync()

    def release(self) -> None:
        self.buf = None


class NvmeHome(Home):
    """An extent of a swap file. A unit with its own aligned buffer moves by one request;
    others go through the staging buffers in chunks: the read of chunk k+1 is in flight while
    chunk k is copied out."""

    tier = "nvme"

    def __init__(self, swap: SwapSpace, nbytes: int) -> None:
        self.swap = swap
        self.nbytes = nbytes
        self.offset = swap.alloc(nbytes)

    def _padded(self, n: int) -> int:
        return -(-n // self.swap.align) * self.swap.align

    def load(self, unit: Unit, staging: Staging) -> None:
        f = self.swap.file
        if unit.flat is not None:
            f.pread(unit.flat, self.offset).result()
            return
        chunks = staging.chunks(self.nbytes)
        pending: dict[int, Future] = {}

        def issue(k: int) -> None:
            if k < len(chunks):
                a, b = chunks[k]
                buf = staging.buffer(k)
                pending[k] = f.pread(buf, self.offset + a, self._padded(b - a))

        for k in range(min(staging.nbuf - 1, len(chunks))):
            issue(k)
        for k, (a, b) in enumerate(chunks):
            issue(k + staging.nbuf - 1)
            pending.pop(k).result()
            staging.scatter(unit, staging.buffer(k), a, b)

    def store(self, unit: Unit, staging: Staging) -> None:
        f = self.swap.file
        if unit.flat is not None:
            f.pwrite(unit.flat, self.offset).result()
            return
        inflight: dict[int, Future] = {}
        for k, (a, b) in enumerate(staging.chunks(self.nbytes)):
            slot = k % staging.nbuf
            if slot in inflight:
                inflight.pop(slot).result()
            buf = staging.buffer(k)
            staging.gather(unit, buf, a, b)
            n = self._padded(b - a)
            if n > b - a:
                buf[b - a:n].zero_()
            inflight[slot] = f.pwrite(buf, self.offset + a, n)
        for fut in inflight.values():
            fut.result()

    def release(self) -> None:
        self.swap.free(self.offset, self.nbytes)

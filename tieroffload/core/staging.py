"""The staging buffers through which a unit's bytes go between an NVMe home and parameters that
are not one aligned buffer (a GPU's, or scattered ones): ``nbuf`` buffers of ``chunk`` bytes,
pinned on CUDA, filled and drained on the mover's side stream. Their memory is the fixed
overhead of NVMe offload."""

from __future__ import annotations

import torch

from .devices import pinned_empty
from .stats import Stats
from .units import Unit

STAGING_CHUNK = 16 << 20  # staging chunk: NVMe sees I/Os this large
NBUF = 4  # staging buffers: the fixed overhead is STAGING_CHUNK * NBUF


class Staging:
    """``nbuf`` buffers of ``chunk`` bytes, made as first needed, and the copies between them
    and a unit's parameters on ``stream`` (None on the CPU: plain copies). A buffer is handed
    out again only once the copy that last read it is done."""

    def __init__(self, chunk: int, nbuf: int, stats: Stats,
                 stream: torch.cuda.Stream | None = None) -> None:
        self.chunk = chunk
        self.nbuf = nbuf
        self.stats = stats
        self.stream = stream
        self.cuda = stream is not None
        self._buffers: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = []

    @property
    def overhead(self) -> int:
        """Bytes of staging memory held at most."""
        return self.chunk * self.nbuf

    def held(self) -> list[tuple[int, int]]:
        """The host ranges of the buffers made so far (on CUDA, pinned ones)."""
        return [(t.data_ptr(), t.numel()) for t in self._buffers]

    def chunks(self, nbytes: int) -> list[tuple[int, int]]:
        """``[a, b)`` ranges of at most ``chunk`` bytes covering ``nbytes``."""
        return [(a, min(a + self.chunk, nbytes)) for a in range(0, nbytes, self.chunk)]

    def buffer(self, k: int) -> torch.Tensor:
        """The buffer for chunk ``k`` of a move (buffers are used round robin)."""
        slot = k % self.nbuf
        while len(self._buffers) <= slot:
            self._buffers.append(pinned_empty(self.chunk, self.cuda, self.stats))
            self._events.append(None)
        ev = self._events[slot]
        if ev is not None:  # the copy that last read this buffer must be done before reuse
            ev.synchronize()
            self._events[slot] = None
        return self._buffers[slot]

    def scatter(self, unit: Unit, buf: torch.Tensor, a: int, b: int) -> None:
        """Copies unit bytes [a, b) from a staging buffer into the parameters."""
        for seg in unit.segments:
            lo, hi = max(a, seg.start), min(b, seg.end)
            if lo < hi:
                seg.view()[lo - seg.start:hi - seg.start].copy_(buf[lo - a:hi - a],
                                                                non_blocking=self.cuda)
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(self.stream)
            self._events[self._buffers.index(buf)] = ev

    def gather(self, unit: Unit, buf: torch.Tensor, a: int, b: int) -> None:
        """Copies unit bytes [a, b) from the parameters into a staging buffer."""
        for seg in unit.segments:
            lo, hi = max(a, seg.start), min(b, seg.end)
            if lo < hi:
                buf[lo - a:hi - a].copy_(seg.view()[lo - seg.start:hi - seg.start],
                                         non_blocking=self.cuda)
        self.sync()

    def sync(self) -> None:
        """Waits for the copies queued on the stream (the host may then read what they wrote)."""
        if self.cuda:
            self.stream.synchronize()

    def close(self) -> None:
        """Drops the buffers (their memory goes once no copy holds them)."""
        self._buffers.clear()
        self._events.clear()

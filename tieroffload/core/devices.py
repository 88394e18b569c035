"""The host step's view of the compute device: copies to and from host memory on a side stream,
ordered by events, never by synchronising the compute stream. ``Transfers`` is the CUDA one
(pinned host buffers, a side stream); on the CPU the same calls are plain copies, so that the
host-step pipeline (gradients out, update on the host, working copies back) runs, and is
tested, wherever the compute is."""

from __future__ import annotations

import torch

from ..aio.buffers import aligned_empty
from .stats import Stats


class Transfers:
    """Copies between ``device`` and host memory for the host step.

    Invariants: a copy to the host starts after the work the compute stream had queued when it
    was asked for (so a gradient is final), and the host reads its destination only after
    ``wait``; a copy to the device is queued on the side stream and the compute stream waits for
    it on the GPU (an event), so later kernels see the new values with no host synchronisation.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> torch.cuda.Event | None:
        """Queues ``dst.copy_(src)`` (``src`` on the device, ``dst`` in host memory, cast to
        ``dst``'s dtype on the device first); returns the event to ``wait`` for."""
        if not self.cuda:
            dst.copy_(src)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            s = src if src.dtype == dst.dtype else src.to(dst.dtype)
            dst.copy_(s, non_blocking=True)
            src.record_stream(self.stream)  # its memory is not reused before the copy is done
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def to_device(self, src: torch.Tensor, dst: torch.Tensor) -> torch.cuda.Event | None:
        """Queues ``dst.copy_(src)`` (``src`` in host memory, of ``dst``'s dtype) and makes the
        compute stream wait for it; ``src`` may be reused once the returned event is done."""
        if not self.cuda:
            dst.copy_(src)
            return None
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(self.stream)
        torch.cuda.current_stream(self.device).wait_event(ev)
        return ev

    @staticmethod
    def wait(ev: torch.cuda.Event | None) -> None:
        """The host waits for one copy (not for the compute stream)."""
        if ev is not None:
            ev.synchronize()


def pinned_empty(nbytes: int, pin: bool, stats: Stats) -> torch.Tensor:
    """``aligned_empty``, with the bytes counted in ``stats.pinned`` while pinned: from here
    until the buffer and its last view are freed. Every page-locked buffer tieroffload holds
    (homes, staging, the host step's buffers, activation copies) is made here."""
    if not pin or nbytes == 0:
        return aligned_empty(nbytes, pin=False)
    buf = aligned_empty(nbytes, pin=True, on_free=lambda: stats.add_pinned(-nbytes))
    stats.add_pinned(nbytes)
    return buf


class HostBuffers:
    """Exact-size host memory for the host step, pinned where the compute is CUDA: ``slots``
    buffers of ``nbytes`` each, allocated once (registering pinned memory is slow). Slot k's
    contents are valid until slot k is taken again."""

    def __init__(self, nbytes: int, slots: int, pin: bool, stats: Stats) -> None:
        self.nbytes = -(-nbytes // 64) * 64
        self._bufs = [pinned_empty(self.nbytes, pin, stats) for _ in range(slots)]

    def held(self) -> list[tuple[int, int]]:
        """The host ranges of its buffers."""
        return [(b.data_ptr(), b.numel()) for b in self._bufs]

    def views(self, slot: int, like: list[torch.Tensor],
              dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """Tensors shaped as ``like`` (in ``dtype``, else each one's own) laid out in slot
        ``slot``, each 64-byte aligned."""
        buf = self._bufs[slot % len(self._bufs)]
        out, pos = [], 0
        for t in like:
            dt = dtype or t.dtype
            n = t.numel() * dt.itemsize
            if pos + n > buf.numel():
                raise ValueError(f"host buffer of {buf.numel()} bytes cannot hold {pos + n} "
                                 "bytes of one chunk")
            out.append(buf[pos:pos + n].view(dt).view(t.shape))
            pos = -(-(pos + n) // 64) * 64
        return out

    def close(self) -> None:
        self._bufs = []

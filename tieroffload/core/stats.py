"""What the movers and the scheduler count: bytes per tier and direction, waits, hits."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

_pinned_lock = threading.Lock()  # pinned buffers are freed on whichever thread drops them last


@dataclass
class Stats:
    """Bytes moved per tier and direction, time compute waited, prefetch hits and misses."""

    bytes_read: dict[str, int] = field(default_factory=lambda: {"cpu": 0, "nvme": 0})
    bytes_written: dict[str, int] = field(default_factory=lambda: {"cpu": 0, "nvme": 0})
    wait_s: float = 0.0
    hits: int = 0          # resident when needed
    late: int = 0          # prefetched, but still on its way when needed
    misses: int = 0        # not prefetched: fetched on demand
    evictions: int = 0
    reorders: int = 0      # execution left the recorded order: re-recorded
    wasted: int = 0        # prefetched, then evicted before use
    lent: int = 0          # acquires after which compute ran with a core lent to I/O
    prefetch: int = 0      # the prefetch depth now (units, or bytes for a size)
    adaptations: list = field(default_factory=list)  # changes of the depth, and why
    peak_resident: int = 0
    resident: int = 0
    pinned: int = 0        # page-locked host memory held now (see core.devices.pinned_empty)

    def add_pinned(self, nbytes: int) -> None:
        with _pinned_lock:
            self.pinned += nbytes

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["bytes_read"] = dict(self.bytes_read)
        d["bytes_written"] = dict(self.bytes_written)
        d["adaptations"] = list(self.adaptations)
        return d

"""What the movers and the scheduler count: bytes per tier and direction, waits, hits."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

_pinned_lock = threading.Lock()  # pinned buffers are freed on whichever thread drops them last

KINDS = ("params", "grads", "optimizer", "activations")  # what the bytes moved carry
TIERS = ("cpu", "nvme")


def _by_kind() -> dict[str, dict[str, int]]:
    return {t: dict.fromkeys(KINDS, 0) for t in TIERS}


@dataclass
class Stats:
    """Bytes moved per tier, direction and kind (what the bytes carry; ``bytes_read[tier]``
    is their sum), time compute waited (``wait_by_kind`` splits ``wait_s``), prefetch hits and
    misses; the ``window_*`` peaks are those since ``start_window`` (the lifetime's until it
    is first called)."""

    read_by_kind: dict[str, dict[str, int]] = field(default_factory=_by_kind)
    written_by_kind: dict[str, dict[str, int]] = field(default_factory=_by_kind)
    wait_s: float = 0.0
    wait_by_kind: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
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
    peak_pinned: int = 0
    window_peak_resident: int = 0
    window_peak_pinned: int = 0

    def add_pinned(self, nbytes: int) -> None:
        with _pinned_lock:
            self.pinned += nbytes
            self.peak_pinned = max(self.peak_pinned, self.pinned)
            self.window_peak_pinned = max(self.window_peak_pinned, self.pinned)

    def add_resident(self, nbytes: int) -> None:
        """Counts ``nbytes`` more (or fewer) resident on the compute device."""
        self.resident += nbytes
        self.peak_resident = max(self.peak_resident, self.resident)
        self.window_peak_resident = max(self.window_peak_resident, self.resident)

    @property
    def bytes_read(self) -> dict[str, int]:
        return {t: sum(k.values()) for t, k in self.read_by_kind.items()}

    @property
    def bytes_written(self) -> dict[str, int]:
        return {t: sum(k.values()) for t, k in self.written_by_kind.items()}

    def moved(self, tier: str, kind: str, nbytes: int, write: bool) -> None:
        """Counts ``nbytes`` of ``kind`` read from (or written to) ``tier``."""
        (self.written_by_kind if write else self.read_by_kind)[tier][kind] += nbytes

    def waited(self, kind: str, seconds: float) -> None:
        self.wait_s += seconds
        self.wait_by_kind[kind] += seconds

    def start_window(self) -> None:
        """The window peaks start again from what is held now."""
        with _pinned_lock:
            self.window_peak_pinned = self.pinned
        self.window_peak_resident = self.resident

    def as_dict(self) -> dict:
        """The figures (the window's peaks are read through ``hooks.window``)."""
        d = {k: v for k, v in self.__dict__.items() if not k.startswith("window_")}
        d["bytes_read"], d["bytes_written"] = self.bytes_read, self.bytes_written
        d["wait_by_kind"] = dict(d["wait_by_kind"])
        for k in ("read_by_kind", "written_by_kind"):
            d[k] = {t: dict(v) for t, v in d[k].items()}
        d["adaptations"] = list(self.adaptations)
        return d

"""The events of a traced step (``Monitor(trace_steps=...)``): every read and write with its
bytes, kind and tier, and every wait, timed with ``time.perf_counter``. Nothing is recorded
while no timeline is ``ACTIVE`` (one global check per move); ranges for ``torch.profiler``
are opened only while a profiler records."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from torch.profiler import record_function

from ..compat.profiler import profiling

ACTIVE: Timeline | None = None  # the timeline being recorded, if any


class Timeline:
    """Events as dicts: ``name``, ``cat`` ("io", "wait" or "compute"), ``lane``, ``start`` and
    ``end`` (perf_counter seconds; ``end`` None while an I/O is in flight) and ``args``."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.events: list[dict[str, Any]] = []

    def add(self, name: str, cat: str, lane: str, start: float, end: float | None,
            **args: Any) -> dict[str, Any]:
        ev = {"name": name, "cat": cat, "lane": lane, "start": start, "end": end, "args": args}
        self.events.append(ev)  # list.append is atomic: I/O threads add here too
        return ev


def io(kind: str, tier: str, write: bool, nbytes: int, start: float | None = None,
       end: float | None = None) -> dict[str, Any] | None:
    """Records a read or write on the active timeline (None when there is none), started at
    ``start`` (now if None); one still in flight (``end`` None) ends at ``io_done``. Call it
    where the bytes are counted in the stats, so that a step's events add up to its bytes."""
    tl = ACTIVE
    if tl is None:
        return None
    verb = "write" if write else "read"
    return tl.add(f"{verb} {kind}", "io", "io", time.perf_counter() if start is None else start,
                  end, kind=kind, tier=tier, bytes=nbytes, direction=verb)


def io_done(ev: dict[str, Any] | None) -> None:
    if ev is not None:
        ev["end"] = time.perf_counter()


def waited(kind: str, start: float, end: float) -> None:
    """Records a wait of compute (or of the thread that waited) for I/O of ``kind``."""
    tl = ACTIVE
    if tl is not None:
        tl.add(f"wait {kind}", "wait", f"wait ({threading.current_thread().name})", start, end,
               kind=kind)


def ranged(name: str) -> contextlib.AbstractContextManager:
    """A ``torch.profiler.record_function`` range while a profiler records, else nothing."""
    return record_function(name) if profiling() else contextlib.nullcontext()

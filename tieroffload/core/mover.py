"""The worker that moves units between their homes and the compute device, and the tickets
that say when a move is done (re-raising what the worker met)."""

from __future__ import annotations

import errno
import queue
import threading
import time
import zlib
from typing import Any, Callable

import torch

from ..aio.engine import Future, error_for
from . import timeline
from .staging import NBUF as NBUF  # the sizes callers give a mover, kept importable here
from .staging import STAGING_CHUNK as STAGING_CHUNK
from .staging import Staging
from .stats import Stats
from .units import Unit


class Ticket:
    """Completion of one move: ``wait()`` re-raises what the worker met; on CUDA the current
    stream is made to wait for the copies, so compute waits only for what it needs."""

    kind = "params"  # what the move carries (see stats.KINDS): its waits are counted so
    io: tuple[str, str, bool, int] | None = None  # see Mover.submit

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.cuda_event: torch.cuda.Event | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()

    def wait(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error
        if self.cuda_event is not None:
            torch.cuda.current_stream().wait_event(self.cuda_event)


class IOTicket(Ticket):
    """A move that is one async read or write straight into the unit's buffer: nothing to do
    but wait for the engine, so many of them can be in flight at once."""

    def __init__(self, future: Future, verify: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.future = future
        self.verify = verify  # checks what a read brought (Policy(checksum=True))

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> None:
        self.future.result()
        if self.verify is not None:
            self.verify()


class Mover:
    """One worker thread that runs loads and stores in order, on a side stream on CUDA, with
    ``nbuf`` staging buffers of ``chunk`` bytes (``staging.Staging``): the fixed memory
    overhead of NVMe offload."""

    def __init__(self, device: torch.device, chunk: int, nbuf: int, stats: Stats,
                 delay: Callable[[], None] | None = None, checksum: bool = False) -> None:
        self.device = device
        self.checksum = checksum  # CRC-32 of every unit written to NVMe, checked on read
        self.cuda = device.type == "cuda"
        self.stats = stats
        self.delay = delay  # tests inject I/O delays here
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.staging = Staging(chunk, nbuf, self.stats, self.stream)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tieroffload-mover", daemon=True)
        self._thread.start()

    @property
    def overhead(self) -> int:
        """Bytes of staging memory this mover holds at most."""
        return self.staging.overhead

    def held(self) -> list[tuple[int, int]]:
        """The host ranges of the staging buffers made so far (on CUDA, pinned ones)."""
        return self.staging.held()

    def submit(self, fn: Callable[[], None], kind: str = "params", nbytes: int = 0,
               tier: str = "cpu", write: bool = False) -> Ticket:
        """Runs ``fn`` on the worker. ``kind``: what it moves; ``nbytes``: the bytes it
        reads from or writes to ``tier`` itself, for a traced step's timeline (moves of units
        are traced by ``move_now``)."""
        ticket = Ticket()
        ticket.kind = kind
        ticket.io = (kind, tier, write, nbytes) if nbytes else None
        if self.cuda:
            # The copies must not start before compute is done with the memory they overwrite.
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        else:
            ready = None
        self._jobs.put((fn, ticket, ready))
        return ticket

    def load(self, unit: Unit) -> Ticket:
        """Brings the unit's bytes from its home (the storage must be allocated)."""
        return self._move(unit, write=False)

    def store(self, unit: Unit) -> Ticket:
        """Writes the unit's bytes to its home."""
        return self._move(unit, write=True)

    def move_now(self, unit: Unit, write: bool) -> None:
        """The move itself, on the calling thread (the worker's, for jobs that do more)."""
        summed = self.checksum and unit.home.tier == "nvme"
        if summed and write:
            unit.crc = crc_of(unit)
        t0 = time.perf_counter()
        with timeline.ranged(f"tieroffload.{'write' if write else 'read'}.{unit.kind}"):
            (unit.home.store if write else unit.home.load)(unit, self.staging)
        if summed and not write:
            self.verify(unit)
        timeline.io(unit.kind, unit.home.tier, write, unit.nbytes, t0, time.perf_counter())
        self._count(unit, write)

    def verify(self, unit: Unit) -> None:
        """Raises an EIO naming the unit, the file and the offset where the bytes read are
        not the bytes written (a hole, a bad block, another writer)."""
        if unit.crc is None or crc_of(unit) == unit.crc:
            return
        home = unit.home
        names = ", ".join(unit.names[:4]) + (f" and {len(unit.names) - 4} more"
                                             if len(unit.names) > 4 else "")
        raise error_for(errno.EIO, f"checksum mismatch: the {unit.nbytes} bytes of "
                        f"{unit.name!r} ({names}) read back differ from those written",
                        home.swap.path, home.offset)

    def _count(self, unit: Unit, write: bool) -> None:
        self.stats.moved(unit.home.tier, unit.kind, unit.nbytes, write)

    def _move(self, unit: Unit, write: bool) -> Ticket:
        home = unit.home
        if unit.flat is None or home.tier != "nvme" or self.delay is not None:
            return self.submit(lambda: self.move_now(unit, write), unit.kind)
        # A unit with its own aligned buffer moves by one async request, issued now, so many
        # can be in flight (tests that inject delays go through the worker instead).
        self._count(unit, write)
        if self.checksum and write:
            unit.crc = crc_of(unit)
        io = home.swap.file.pwrite if write else home.swap.file.pread
        verify = (lambda: self.verify(unit)) if self.checksum and not write else None
        ev = timeline.io(unit.kind, home.tier, write, unit.nbytes)
        future = io(unit.flat, home.offset)
        if ev is not None:
            future.add_done_callback(lambda f: timeline.io_done(ev))
        ticket = IOTicket(future, verify)
        ticket.kind = unit.kind
        return ticket

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            fn, ticket, ready = item
            try:
                if self.delay is not None:
                    self.delay()
                t0 = time.perf_counter()
                if self.cuda:
                    with torch.cuda.stream(self.stream):
                        self.stream.wait_event(ready)
                        fn()
                        ticket.cuda_event = torch.cuda.Event()
                        ticket.cuda_event.record(self.stream)
                else:
                    fn()
                if ticket.io is not None:  # counted where it was submitted
                    timeline.io(*ticket.io, t0, time.perf_counter())
            except BaseException as e:  # handed to whoever waits on the ticket
                ticket.finish(e)
            else:
                ticket.finish()

    def close(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        self.staging.close()


def crc_of(unit: Unit) -> int:
    """CRC-32 of the unit's bytes as they are now (its flat buffer, or each parameter's)."""
    if unit.flat is not None:
        return zlib.crc32(unit.flat.numpy())
    crc = 0
    for seg in unit.segments:  # a copy: numpy() would pin the storage's size
        crc = zlib.crc32(seg.view().cpu().clone().numpy(), crc)
    return crc


def timed_wait(ticket: Ticket, stats: Any, kind: str | None = None) -> None:
    """Waits on ``ticket``, adding the time to ``stats.wait_s`` (and, for a ``Stats``, to
    its ``kind``'s share: the ticket's own, unless given)."""
    kind = kind or getattr(ticket, "kind", "params")  # any object with wait() will do
    t0 = time.perf_counter()
    with timeline.ranged(f"tieroffload.wait.{kind}"):
        ticket.wait()
    t1 = time.perf_counter()
    if isinstance(stats, Stats):
        stats.waited(kind, t1 - t0)
    else:
        stats.wait_s += t1 - t0
    timeline.waited(kind, t0, t1)

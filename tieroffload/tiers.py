"""Where a unit's bytes live (RAM, pinned when a GPU is present, or an NVMe extent) and the
worker that moves them to and from the parameters' storage on the compute device.

A unit is the set of parameters one module owns, stored contiguously in its home so that NVMe
sees one large I/O. On the compute device each parameter keeps its own storage, which is freed
with ``untyped_storage().resize_(0)`` and refilled in place: tensors that autograd saved (views of
a weight) stay valid across a release and a refetch.
"""

from __future__ import annotations

import enum
import errno
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import _native, aio
from .swap import SwapSpace


class State(enum.Enum):
    AWAY = "away"          # only in its home
    FETCHING = "fetching"  # storage allocated, bytes on their way
    RESIDENT = "resident"
    WRITING = "writing"    # evicted, its bytes on their way home; freed once written


@dataclass
class Segment:
    """One parameter inside a unit: bytes [start, end) of the unit, and its resident bytes.
    The storage may hold more than the parameter's elements (an FSDP shard's padding): the
    segment covers the storage from the parameter's first byte."""

    param: torch.nn.Parameter
    start: int
    end: int

    def view(self) -> torch.Tensor:
        p = self.param.data
        flat = p.view(-1).view(torch.uint8)
        if flat.numel() == self.end - self.start:
            return flat
        return flat.new_empty(0).set_(p.untyped_storage(), p.storage_offset() * p.element_size(),
                                      (self.end - self.start,))


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

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["bytes_read"] = dict(self.bytes_read)
        d["bytes_written"] = dict(self.bytes_written)
        d["adaptations"] = list(self.adaptations)
        return d


class Ticket:
    """Completion of one move: ``wait()`` re-raises what the worker met; on CUDA the current
    stream is made to wait for the copies, so compute waits only for what it needs."""

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

    def __init__(self, future: aio.Future) -> None:
        super().__init__()
        self.future = future

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> None:
        self.future.result()


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
    """A flat buffer in RAM (pinned when a GPU is present): for params="cpu" with CUDA compute."""

    tier = "cpu"

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.buf = aio.aligned_empty(nbytes, pin=pin)

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
        pending: dict[int, aio.Future] = {}

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
        inflight: dict[int, aio.Future] = {}
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


PAGE = 4096


class PagePool:
    """Physical pages of evicted units, moved aside (``mremap``) for the next unit fetched.

    Memory given back with ``madvise`` returns as fresh pages that the kernel faults in and
    zeroes again on every fetch: on a machine with few cores that work competes with compute
    (a pass over 3 GiB of weights ran 1.3x to 1.8x slower than reading them). Moving the pages
    of an evicted unit over the address of the next unit costs a few page-table updates
    instead, and both addresses stay valid. ``cap`` bounds the bytes parked at once; where the
    kernel refuses (before Linux 5.7) the pool stays empty and units are discarded as before.
    """

    MAX_PIECES = 4

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.ranges: list[tuple[int, int]] = []  # (address, bytes), parked
        self.nbytes = 0
        self.supported = True
        self._lock = threading.Lock()  # the mover thread parks gradients

    def park(self, addr: int, nbytes: int) -> int:
        """Takes the pages of [addr, addr+nbytes), one mapping, or as many of its first pages
        as the cap leaves room for; returns the bytes taken (0 where the kernel refuses): the
        caller discards the rest."""
        with self._lock:
            take = min(nbytes, (self.cap - self.nbytes) // PAGE * PAGE)
            if not self.supported or take <= 0:
                return 0
            moved = _native.park(addr, take)
            if moved < 0:
                self.supported = moved != -errno.EINVAL  # else the range spans two mappings
                return 0
            self.ranges.append((moved, take))
            self.nbytes += take
            return take

    def fill(self, addr: int, nbytes: int) -> list[int]:
        """Moves parked pages over [addr, addr+nbytes): a range of that size if there is one
        (one move, which also joins the mappings earlier pieces left), else the largest ranges,
        at most ``MAX_PIECES`` of them (the rest of the unit faults in fresh). Returns the
        lengths of the pieces placed, in order: each is one mapping, to be parked on its own."""
        with self._lock:
            same = [r for r in self.ranges if r[1] == nbytes]
            self.ranges.sort(key=lambda r: r[1])
            if same:
                self.ranges.remove(same[0])
                self.ranges.append(same[0])
            pieces: list[int] = []
            done = 0
            while done < nbytes and self.ranges and len(pieces) < self.MAX_PIECES:
                src, n = self.ranges.pop()
                take = min(n, nbytes - done)
                _native.place(src, addr + done, take)
                if take < n:
                    self.ranges.append((src + take, n - take))
                self.nbytes -= take
                pieces.append(take)
                done += take
            return pieces

    def clear(self) -> None:
        """Gives every parked page back to the OS."""
        with self._lock:
            for addr, n in self.ranges:
                _native.unmap(addr, n)
            self.ranges.clear()
            self.nbytes = 0


class Unit:
    """The parameters that one module owns, moved and accounted together."""

    def __init__(self, uid: int, name: str, params: list[tuple[str, torch.nn.Parameter]],
                 sizes: list[int] | None = None,
                 on_rebind: Callable[[], None] | None = None) -> None:
        """``sizes``: bytes each parameter's storage holds, where that is more than its
        elements (FSDP's padded shards). ``on_rebind``: called after the parameters were moved
        into new storage, for tensors that must follow them (FSDP's own views of its shards)."""
        self.id = uid
        self.name = name
        self.names = [n for n, _ in params]
        self.on_rebind = on_rebind
        self.segments: list[Segment] = []
        pos = 0
        for i, (_, p) in enumerate(params):
            n = sizes[i] if sizes is not None else p.numel() * p.element_size()
            self.segments.append(Segment(p, pos, pos + n))
            pos = -(-(pos + n) // 64) * 64  # every parameter starts 64-byte aligned
        self.nbytes = self.segments[-1].end if self.segments else 0
        self.flat: torch.Tensor | None = None  # see adopt_flat
        self._pieces: list[int] = []  # mappings of flat's pages placed from a pool, in order
        self.home: Home | None = None
        self.state = State.RESIDENT
        self.ticket: Ticket | None = None
        self.pins = 0
        self.dirty = False
        self.initialized = True  # False for a model built on the meta device, until loaded
        self.last_use = 0

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [s.param for s in self.segments]

    @property
    def reading(self) -> bool:
        """Its read has started and not yet arrived."""
        return self.state is State.FETCHING and self.ticket is not None and not self.ticket.done()

    def adopt_flat(self, align: int) -> None:
        """CPU compute with an NVMe home: the parameters become views of one page-aligned
        buffer, which O_DIRECT fills and drains with no staging copy, and which is released
        with madvise (its address, and every view autograd saved, stay valid)."""
        padded = -(-max(self.nbytes, 1) // max(align, PAGE)) * max(align, PAGE)
        self.flat = aio.aligned_empty(padded, pin=False)
        for s in self.segments:
            p = s.param
            n = p.numel() * p.element_size()
            dst = self.flat[s.start:s.start + n]
            if p.untyped_storage().nbytes() >= n:
                dst.copy_(p.data.reshape(-1).view(torch.uint8))
            p.data = dst.view(p.dtype).view(p.shape)

    def allocate(self, pool: PagePool | None = None) -> None:
        """Gives the parameters storage again. With a ``pool`` (only where every byte will be
        overwritten: it holds another unit's old values) a flat unit takes parked pages; else
        its pages come back, as zeros, as they are written."""
        if self.flat is not None:
            addr, total = self.flat.data_ptr(), self.flat.numel()
            if pool is not None and pool.ranges:
                self._pieces = pool.fill(addr, total)
            placed = sum(self._pieces)
            if placed < total:
                # Pieces placed and parked before split the rest into several mappings, which
                # the kernel would not park as one (a unit then faulted in most of its pages).
                _native.renew(addr + placed, total - placed)
            return
        for s in self.segments:
            s.param.untyped_storage().resize_(s.end - s.start)

    def free(self, pool: PagePool | None = None) -> None:
        """Returns the storage; a flat unit's pages go to ``pool`` where it takes them."""
        if self.flat is not None:
            addr, total = self.flat.data_ptr(), self.flat.numel()
            placed = sum(self._pieces)
            pieces = self._pieces + ([total - placed] if placed < total else [])
            self._pieces = []
            for n in pieces:
                kept = pool.park(addr, n) if pool is not None else 0
                if kept < n:
                    _native.discard(addr + kept, n - kept)
                addr += n
            return
        for s in self.segments:
            s.param.untyped_storage().resize_(0)

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, {self.nbytes} bytes, {self.state.value})"


class Mover:
    """One worker thread that runs loads and stores in order, with ``nbuf`` staging buffers of
    ``chunk`` bytes (pinned on CUDA): the fixed memory overhead of NVMe offload."""

    def __init__(self, device: torch.device, chunk: int, nbuf: int, stats: Stats,
                 delay: Callable[[], None] | None = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.chunk = chunk
        self.nbuf = nbuf
        self.stats = stats
        self.delay = delay  # tests inject I/O delays here
        self._staging: list[torch.Tensor] = []
        self._staging_events: list[torch.cuda.Event | None] = []
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tieroffload-mover", daemon=True)
        self._thread.start()

    @property
    def overhead(self) -> int:
        """Bytes of staging memory this mover holds at most."""
        return self.chunk * self.nbuf

    def staging_for(self, k: int) -> torch.Tensor:
        slot = k % self.nbuf
        while len(self._staging) <= slot:
            self._staging.append(aio.aligned_empty(self.chunk, pin=self.cuda))
            self._staging_events.append(None)
        ev = self._staging_events[slot]
        if ev is not None:  # the copy that last read this buffer must be done before reuse
            ev.synchronize()
            self._staging_events[slot] = None
        return self._staging[slot]

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
            self._staging_events[self._staging.index(buf)] = ev

    def gather(self, unit: Unit, buf: torch.Tensor, a: int, b: int) -> None:
        """Copies unit bytes [a, b) from the parameters into a staging buffer."""
        for seg in unit.segments:
            lo, hi = max(a, seg.start), min(b, seg.end)
            if lo < hi:
                buf[lo - a:hi - a].copy_(seg.view()[lo - seg.start:hi - seg.start],
                                         non_blocking=self.cuda)
        self.sync_device()

    def sync_device(self) -> None:
        if self.cuda:
            self.stream.synchronize()

    def submit(self, fn: Callable[[], None]) -> Ticket:
        ticket = Ticket()
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
        (unit.home.store if write else unit.home.load)(unit, self)
        self._count(unit, write)

    def _count(self, unit: Unit, write: bool) -> None:
        (self.stats.bytes_written if write else self.stats.bytes_read)[unit.home.tier] += \
            unit.nbytes

    def _move(self, unit: Unit, write: bool) -> Ticket:
        home = unit.home
        if unit.flat is None or not isinstance(home, NvmeHome) or self.delay is not None:
            return self.submit(lambda: self.move_now(unit, write))
        # A unit with its own aligned buffer moves by one async request, issued now, so many
        # can be in flight (tests that inject delays go through the worker instead).
        self._count(unit, write)
        io = home.swap.file.pwrite if write else home.swap.file.pread
        return IOTicket(io(unit.flat, home.offset))

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            fn, ticket, ready = item
            try:
                if self.delay is not None:
                    self.delay()
                if self.cuda:
                    with torch.cuda.stream(self.stream):
                        self.stream.wait_event(ready)
                        fn()
                        ticket.cuda_event = torch.cuda.Event()
                        ticket.cuda_event.record(self.stream)
                else:
                    fn()
            except BaseException as e:  # handed to whoever waits on the ticket
                ticket.finish(e)
            else:
                ticket.finish()

    def close(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        self._staging.clear()


def timed_wait(ticket: Ticket, stats: Any) -> None:
    """Waits on ``ticket``, adding the time to ``stats.wait_s``."""
    t0 = time.perf_counter()
    ticket.wait()
    stats.wait_s += time.perf_counter() - t0

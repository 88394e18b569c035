"""Units: the parameters one module owns, moved and accounted together, and the states a unit
goes through (``State``), changed only by ``Unit.move_to`` along ``TRANSITIONS``. Nothing here
moves bytes between tiers: homes (``homes``) and the mover (``mover``) do, and this module
imports neither (``Move`` and ``Place`` say what a unit holds of them).

A unit is the set of parameters one module owns, stored contiguously in its home so that NVMe
sees one large I/O. On the compute device each parameter keeps its own storage, which is freed
with ``untyped_storage().resize_(0)`` and refilled in place: tensors that autograd saved (views of
a weight) stay valid across a release and a refetch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from ..aio.buffers import aligned_empty
from ..aio.pages import PAGE, PagePool, discard, renew
from ..compat.tensors import plain_tensors, version


class State(enum.Enum):
    """Where a unit's bytes are. See ``TRANSITIONS`` for the moves between states."""

    AWAY = "away"          # only in its home: no storage
    FETCHING = "fetching"  # storage allocated, its bytes on their way (or none to read)
    RESIDENT = "resident"  # in memory, no move on its way
    FLUSHING = "flushing"  # resident and usable, a copy of its bytes on its way home
    WRITING = "writing"    # evicted, its bytes on their way home; freed once written


# Every move a unit makes, and who makes it (docs/design.md, "Unit states").
TRANSITIONS: dict[State, frozenset[State]] = {
    # a read starts (the scheduler, the paged optimizer); bytes all replaced, no read (the
    # paged optimizer's load)
    State.AWAY: frozenset({State.FETCHING, State.RESIDENT}),
    # the read arrived; the read failed, the storage given back
    State.FETCHING: frozenset({State.RESIDENT, State.AWAY}),
    # freed, its home holding its bytes; evicted with a write; written behind
    State.RESIDENT: frozenset({State.AWAY, State.WRITING, State.FLUSHING}),
    # the write waited for (done or failed); evicted while the write goes on
    State.FLUSHING: frozenset({State.RESIDENT, State.WRITING}),
    # wanted again, or the write failed (bytes kept); the write done, the storage freed
    State.WRITING: frozenset({State.RESIDENT, State.AWAY}),
}

USABLE = frozenset({State.RESIDENT, State.FLUSHING})  # compute may read and write its bytes


class Move(Protocol):
    """A move of a unit's bytes on its way (``mover.Ticket``)."""

    def done(self) -> bool: ...

    def wait(self) -> None: ...


class Place(Protocol):
    """Where a unit's bytes live when it is not resident (``homes.Home``)."""

    tier: str

    def release(self) -> None: ...


@dataclass
class Segment:
    """One parameter inside a unit: bytes [start, end) of the unit, and its resident bytes.
    The storage may hold more than the parameter's elements (an FSDP shard's padding): the
    segment covers the storage from the parameter's first byte."""

    param: torch.nn.Parameter
    start: int
    end: int

    def view(self) -> torch.Tensor:
        with plain_tensors():  # the engine's access: no guard
            p = self.param.data
        flat = p.view(-1).view(torch.uint8)
        if flat.numel() == self.end - self.start:
            return flat
        return flat.new_empty(0).set_(p.untyped_storage(), p.storage_offset() * p.element_size(),
                                      (self.end - self.start,))


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
        self.kind = "params"  # what its bytes are, as stats count them (see stats.KINDS)
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
        self.home: Place | None = None
        self._state = State.RESIDENT
        self.ticket: Move | None = None  # the read or write on its way, where one is
        self.pins = 0
        self.dirty = False
        self.writes = 0  # writes from outside the hooks, counted (see Guards.wrote)
        self.initialized = True  # False for a model built on the meta device, until loaded
        self.last_use = 0
        self.crc: int | None = None  # of the bytes last written home (Policy(checksum=True))
        self._versions: list[int] | None = None  # see snapshot

    @property
    def state(self) -> State:
        return self._state

    def move_to(self, to: State) -> None:
        """Makes the unit's state ``to``; raises where ``TRANSITIONS`` has no such move."""
        if to not in TRANSITIONS[self._state]:
            allowed = ", ".join(sorted(s.name for s in TRANSITIONS[self._state]))
            raise RuntimeError(f"tieroffload: unit {self.name!r}: {self._state.name} -> "
                               f"{to.name} is not a transition (from {self._state.name}: "
                               f"{allowed})")
        self._state = to

    @property
    def usable(self) -> bool:
        """Its bytes are in memory and current: resident, or resident with a copy of them on
        its way home."""
        return self._state in USABLE

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [s.param for s in self.segments]

    def snapshot(self) -> None:
        """Records its parameters' version counters: its bytes in memory equal its home's."""
        self._versions = [version(p) for p in self.params]

    @property
    def changed(self) -> bool:
        """Its bytes in memory may differ from its home's: marked ``dirty``, or written in
        place since ``snapshot`` by code that no hook sees (``nn.Embedding(max_norm=...)``
        renormalises rows of its weight inside forward)."""
        return self.dirty or (self._versions is not None
                              and self._versions != [version(p) for p in self.params])

    @property
    def reading(self) -> bool:
        """Its read has started and not yet arrived."""
        return self.state is State.FETCHING and self.ticket is not None and not self.ticket.done()

    def wants_touch(self) -> bool:
        """An operation outside the hooks must bring it in first: it is not held resident."""
        return self.pins == 0 or not self.usable

    def storage_ptrs(self) -> set[int]:
        """The addresses of the storages its parameters view (one, where flat)."""
        if self.flat is not None:
            return {self.flat.untyped_storage().data_ptr()}
        with plain_tensors():
            return {s.param.untyped_storage().data_ptr() for s in self.segments}

    def held(self) -> tuple[list[tuple[int, int]], int]:
        """Where its bytes lie in host memory: the range of its flat buffer, which we mapped
        (how much of it is in RAM is the kernel's to say), else the bytes of host storage its
        parameters have now (from malloc; 0 on a GPU or once freed)."""
        if self.flat is not None:
            return [(self.flat.data_ptr(), self.flat.numel())], 0
        with plain_tensors():
            return [], sum(s.param.untyped_storage().nbytes() for s in self.segments
                           if s.param.device.type == "cpu")

    def adopt_flat(self, align: int) -> None:
        """CPU compute with an NVMe home: the parameters become views of one page-aligned
        buffer, which O_DIRECT fills and drains with no staging copy, and which is released
        with madvise (its address, and every view autograd saved, stay valid)."""
        padded = -(-max(self.nbytes, 1) // max(align, PAGE)) * max(align, PAGE)
        self.flat = aligned_empty(padded, pin=False)
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
                renew(addr + placed, total - placed)
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
                    discard(addr + kept, n - kept)
                addr += n
            return
        for s in self.segments:
            s.param.untyped_storage().resize_(0)

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, {self.nbytes} bytes, {self.state.value})"



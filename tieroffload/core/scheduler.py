"""Which units are resident, which to fetch next, which to evict.

The first iteration records the order in which units are needed (forward, then backward). Later
iterations follow that trace: each acquire prefetches along it until the prefetch window (units
or bytes) is on its way, counting only units not already resident, and when room is needed the
resident unit whose next use is farthest away goes (Belady's rule, which the trace makes
possible). Resident units do not use up the window: backward starts on the units forward left
resident, and the disk must not idle while compute goes through them. When execution leaves the
trace (a branch, a different input) the scheduler fetches on demand and records the new order for
the next iteration, so a wrong trace costs time, never correctness.

The prefetch depth adapts between iterations: when most late units had their reads start on
an idle disk (the window, too shallow, held them back) and the budget has room, it deepens;
when prefetched units were evicted before their use (the budget cannot hold the window) it
backs off. Each change is kept in ``stats``.
"""

from __future__ import annotations

import bisect
import collections
import logging

from ..aio.pages import PagePool
from ..utils.sizes import format_bytes
from .mover import Mover, timed_wait
from .stats import Stats
from .units import State, Unit

log = logging.getLogger("tieroffload")


class Scheduler:
    """Residency of a model's units under a byte budget: acquires and releases (pins),
    prefetch along the recorded order, eviction by Belady's rule, write-behind, and the
    adaptation of the prefetch window. Moves units only through ``Unit.move_to``."""

    def __init__(self, units: list[Unit], mover: Mover, budget: int, prefetch_units: int,
                 prefetch_bytes: int | None, stats: Stats, adapt: bool = True) -> None:
        self.units = units
        self._total = sum(u.nbytes for u in units)
        self.mover = mover
        self.budget = budget
        self.prefetch_units = prefetch_units
        self.prefetch_bytes = prefetch_bytes
        self.stats = stats
        self.trace: list[int] | None = None
        self._positions: dict[int, list[int]] = {}
        self.recording: list[int] = []
        self.cursor = 0
        self.on_track = False
        self.clock = 0
        self.adapt = adapt
        self.iteration = 0
        self._seen = (0, 0, 0)  # (starved, late, wasted) at the last adaptation
        # Late units whose read started with no other in flight. A read that queued behind
        # others was late for the disk's bandwidth, which a deeper window does not add to: it
        # only takes room from the units the budget keeps between iterations, and in inference
        # every unit of depth is one more unit read per pass.
        self._starved = 0
        self._window_full = False  # the last prefetch stopped at the window's end
        self.waited = False  # the last acquire waited for a read of its units
        # Fetched ahead, not used yet: unit -> its read started with no other in flight, the
        # window having held it back at the acquire before (not the budget: a deeper window
        # would not have started it sooner).
        self._prefetched: dict[int, bool] = {}
        # Pages of evicted units, for the next fetch; resident and parked bytes together stay
        # within the budget.
        self.pool = PagePool(0)
        self._writing: collections.deque[Unit] = collections.deque()  # evicted, being written
        # A write behind that failed, met when its unit was written again: raised by
        # ``raise_failed_write`` (see ``write_behind``).
        self._failed_write: BaseException | None = None
        stats.prefetch = self.prefetch_bytes if self.prefetch_bytes is not None \
            else self.prefetch_units

    # -- the trace -----------------------------------------------------------------------------

    def begin_iteration(self) -> None:
        """Called when the root module's forward starts."""
        if self.recording and not (self.on_track and self.cursor == len(self.trace or [])):
            self.trace = self.recording
            self._positions = {}
            for i, uid in enumerate(self.trace):
                self._positions.setdefault(uid, []).append(i)
        if self.adapt and self.on_track and self.trace:
            self._adapt()
        self.recording = []
        self.cursor = 0
        self.on_track = self.trace is not None
        self.iteration += 1

    def _adapt(self) -> None:
        """Deepens the prefetch after an iteration where most late units were starved (their
        reads started on an idle disk) if the budget has room for one more unit; makes it
        shallower when prefetched units were evicted unused."""
        now = (self._starved, self.stats.late, self.stats.wasted)
        starved, late, wasted = (a - b for a, b in zip(now, self._seen))
        self._seen = now
        avg = max(1, self._total // max(len(self.units), 1))
        in_use = 2 * max(u.nbytes for u in self.units)  # what the module computing holds
        units, nbytes = self.prefetch_units, self.prefetch_bytes
        if wasted > 0:
            if nbytes is not None:
                nbytes = max(avg, nbytes * 2 // 3)
            else:
                units = max(1, units - 1)
            why = f"{wasted} prefetched units were evicted before use"
        elif 2 * starved > late:
            if nbytes is not None:
                nbytes = nbytes * 3 // 2
                room = nbytes + in_use <= self.budget
            else:
                units = min(units + 1, len(set(self.trace)))
                room = units * avg + in_use <= self.budget
            if not room:
                return
            why = (f"{starved} of {late} late units had their reads start on an idle disk "
                   "(the window held them back)")
        else:
            return
        if (units, nbytes) == (self.prefetch_units, self.prefetch_bytes):
            return
        old = self.stats.prefetch
        self.prefetch_units, self.prefetch_bytes = units, nbytes
        self.stats.prefetch = nbytes if nbytes is not None else units
        self.stats.adaptations.append({"iteration": self.iteration, "from": old,
                                       "to": self.stats.prefetch, "why": why})
        log.info("tieroffload: prefetch %s -> %s at iteration %d: %s", old,
                 self.stats.prefetch, self.iteration, why)

    def _advance(self, uid: int) -> None:
        self.recording.append(uid)
        if not self.on_track:
            return
        if self.cursor < len(self.trace) and self.trace[self.cursor] == uid:
            self.cursor += 1
        else:
            self.on_track = False
            self.stats.reorders += 1

    def _next_use(self, uid: int) -> int:
        """Distance from the cursor to the unit's next use in the (cyclic) trace."""
        pos = self._positions.get(uid)
        if not pos:
            return 1 << 60
        i = bisect.bisect_left(pos, self.cursor)
        nxt = pos[i] if i < len(pos) else pos[0] + len(self.trace)
        return nxt - self.cursor

    # -- residency -----------------------------------------------------------------------------

    def acquire(self, units: list[Unit], force: bool = False, record: bool = True) -> None:
        """Pins ``units``, starts their reads and the window's along the trace, then waits
        for them: they are resident on return. ``force`` may exceed the budget (a plain
        optimizer step needs every parameter at once); uses outside forward and backward
        (state dicts, steps) pass ``record=False``."""
        for u in units:
            if record:
                self._advance(u.id)
            u.pins += 1
        try:
            for u in units:
                self._start(u, force)
            # The window's reads start before the wait for these units, not after it: the disk
            # then has the units behind them queued while it reads these, at no cost in memory
            # (the window does not count the units acquired).
            if record:
                self._prefetch(units)
            self.waited = any(u.reading for u in units)
            for u in units:
                if u.state is not State.FLUSHING:  # readable while its write goes on
                    self._finish(u)
        except BaseException:
            self.release(units)  # a failed acquire holds nothing: a retry starts afresh
            raise

    def behind(self) -> bool:
        """The next unit along the trace is still being read (compute may wait for it)."""
        if not self.on_track or not self.trace:
            return False
        return self.units[self.trace[self.cursor % len(self.trace)]].reading

    def release(self, units: list[Unit]) -> None:
        for u in units:
            u.pins -= 1

    def _start(self, u: Unit, force: bool) -> None:
        """Counts the unit's hit, late read or miss, and starts its read if it is away; the
        caller waits for it (``_finish``)."""
        self.clock += 1
        u.last_use = self.clock
        idle_start = self._prefetched.pop(u.id, False)
        if u.usable:
            self.stats.hits += 1
            return
        if u.state is State.WRITING:  # evicted, not yet freed: its bytes are still here
            self.stats.hits += 1
            self._writing.remove(u)
            self._finish(u)
            return
        if u.state is State.FETCHING:
            if u.ticket is None or u.ticket.done():
                self.stats.hits += 1
            else:
                self.stats.late += 1
                self._starved += idle_start
            return
        self.stats.misses += 1
        self._make_room(u.nbytes, force=force, target=u)
        self._start_fetch(u)

    def _start_fetch(self, u: Unit) -> None:
        u.allocate(self.pool if u.initialized else None)  # a load overwrites every byte
        self._account(u.nbytes)
        u.move_to(State.FETCHING)
        if u.initialized:
            u.ticket = self.mover.load(u)
        else:
            u.ticket = None

    def _finish(self, u: Unit) -> None:
        """Waits for the unit's move. A failed read leaves it AWAY (its memory given back, the
        next acquire reads it afresh); a failed write leaves it RESIDENT and dirty (its values
        are still here, written again at its next eviction). Either way the error is raised.
        A unit that arrives, or whose write is done, is as its home: ``Unit.snapshot``."""
        moved = u.state in (State.FETCHING, State.WRITING)
        if u.ticket is not None:
            ticket, u.ticket = u.ticket, None
            try:
                timed_wait(ticket, self.stats)
            except BaseException:
                if u.state is State.FETCHING:
                    u.free()
                    u.move_to(State.AWAY)
                    self._account(-u.nbytes)
                else:
                    u.move_to(State.RESIDENT)
                    u.dirty = True
                raise
        if u.state is not State.RESIDENT:
            u.move_to(State.RESIDENT)
        if moved:
            u.snapshot()

    def _account(self, delta: int) -> None:
        self.stats.add_resident(delta)

    def _victim(self, target: Unit | None) -> Unit | None:
        """The unpinned resident unit to evict: farthest next use on the trace, else least
        recently used. With a prefetch ``target``, only one needed later than the target."""
        best, best_key = None, None
        for u in self.units:
            if not u.usable or u.pins > 0 or u is target or u.home is None:
                continue
            key = self._next_use(u.id) if self.on_track else -u.last_use
            if best_key is None or key > best_key:
                best, best_key = u, key
        if best is not None and target is not None and self.on_track:
            if best_key <= self._next_use(target.id):
                return None
        return best

    def _make_room(self, nbytes: int, force: bool, target: Unit | None,
                   prefetching: bool = False) -> bool:
        while self.stats.resident + nbytes > self.budget:
            if self._writing and self._reap(block=False):
                continue
            victim = self._victim(target if prefetching else None)
            if victim is None and self._writing and not prefetching:
                self._reap(block=True)  # a prefetch never waits: it is tried again later
                continue
            if victim is None and not prefetching:
                # A prefetch on its way that compute does not want now (the order changed:
                # a backward that raised left a trace whose next units are another pass's):
                # it arrives, and is evicted like any other.
                arriving = next((u for u in self.units if u.state is State.FETCHING
                                 and u.pins == 0 and u is not target), None)
                if arriving is not None:
                    self._finish(arriving)
                    continue
            if victim is None:
                if prefetching:
                    return False
                if force:
                    return True
                pinned = sum(u.nbytes for u in self.units if u.pins > 0)
                raise MemoryError(
                    f"tieroffload: {target.name!r} needs {nbytes} bytes but the budget of "
                    f"{self.budget} bytes ({format_bytes(self.budget)}) holds {self.stats.resident}"
                    f" bytes of units in use ({pinned} pinned); raise the budget")
            self.evict(victim)
        return True

    def evict(self, u: Unit) -> None:
        """Frees the unit's storage; one that changed is written back first, asynchronously:
        it stays in memory (and counted) until written, so compute does not wait for the
        write unless the budget needs its memory at once."""
        if u.state is State.FLUSHING:
            if not u.changed:  # its home gets what it holds: freed once that write is done
                u.move_to(State.WRITING)
                self._writing.append(u)
                return
            self._finish(u)  # written again since: that write goes after this one
        if u.state is State.FETCHING:
            self._finish(u)
        if self._prefetched.pop(u.id, None) is not None:
            self.stats.wasted += 1
        if u.changed:
            u.ticket = self.mover.store(u)
            u.dirty = False
            u.initialized = True
            u.move_to(State.WRITING)
            self._writing.append(u)
            return
        self._free(u)

    def _free(self, u: Unit) -> None:
        self.pool.cap = self.budget - (self.stats.resident - u.nbytes)
        u.free(self.pool)
        u.move_to(State.AWAY)
        self._account(-u.nbytes)
        self.stats.evictions += 1

    def _reap(self, block: bool) -> bool:
        """Frees units whose write is done (with ``block``, waits for the oldest first);
        True when any memory came back."""
        freed = False
        while self._writing and (block or self._writing[0].ticket.done()):
            u = self._writing.popleft()
            self._finish(u)
            self._free(u)
            freed, block = True, False
        return freed

    def drain(self) -> None:
        """Waits for every write of an evicted unit, and those written behind (before the swap
        space goes)."""
        while self._writing:
            self._reap(block=True)
        for u in self.units:
            if u.state is State.FLUSHING:
                self._finish(u)

    def write_behind(self, units: list[Unit]) -> None:
        """Starts writing the changed ones of ``units`` home now, while they stay resident
        and readable: an eviction later frees them with no write to wait for. After an update
        in backward this spreads the parameters' writes over backward, where evictions would
        send all the updated units to the disk at once, ahead of the reads compute waits for.
        A unit written again before its eviction is written once more then.

        An earlier write of a unit that failed is not raised here, inside backward after an
        update (no retry could redo that backward): the unit is written again now, and the
        error waits for ``raise_failed_write`` at the next forward."""
        for u in units:
            if u.state is State.FLUSHING and u.ticket.done():
                try:
                    self._finish(u)  # an earlier one, done: the unit may have changed since
                except Exception as e:  # left resident and dirty: written again below
                    self._failed_write = self._failed_write or e
            if u.state is State.RESIDENT and u.home is not None and u.changed:
                u.dirty = False
                u.initialized = True
                u.snapshot()  # a write from here on shows as a change
                u.ticket = self.mover.store(u)
                u.move_to(State.FLUSHING)

    def raise_failed_write(self) -> None:
        """Raises, once, the error of a write behind that failed (its unit was written again
        since)."""
        error, self._failed_write = self._failed_write, None
        if error is not None:
            raise error

    def flush(self, u: Unit) -> None:
        """Writes a resident unit's values to its home."""
        if u.state is State.FLUSHING:  # one write at a time to a home: the newer goes last
            self._finish(u)
        timed_wait(self.mover.store(u), self.stats)
        u.dirty = False
        u.initialized = True
        u.snapshot()

    def _prefetch(self, acquiring: list[Unit]) -> None:
        """Starts reads along the trace, up to the window's depth in units still to read
        (past resident ones, not counting the ``acquiring`` ones), as the budget allows."""
        # With every unit in memory there is nothing to read, and the walk past resident units
        # would go round the whole trace at every acquire.
        if not self.on_track or not self.trace or self.stats.resident >= self._total:
            return
        held_back, self._window_full = self._window_full, False
        budget_bytes = self.prefetch_bytes
        seen: set[int] = set()
        n = len(self.trace)
        for step in range(n):
            if len(seen) >= self.prefetch_units:
                self._window_full = True
                return
            uid = self.trace[(self.cursor + step) % n]
            u = self.units[uid]
            if uid in seen or u.state in (State.RESIDENT, State.FLUSHING, State.WRITING) \
                    or u in acquiring:
                continue
            seen.add(uid)
            if budget_bytes is not None:
                budget_bytes -= u.nbytes
                if budget_bytes < 0:
                    self._window_full = True
                    return
            if u.state is State.FETCHING:
                continue
            if not self._make_room(u.nbytes, force=False, target=u, prefetching=True):
                return
            idle = held_back and not any(
                w.reading for w in (*acquiring, *(self.units[i] for i in self._prefetched)))
            self._start_fetch(u)
            self._prefetched[u.id] = idle

    def prefetch(self, units: list[Unit]) -> None:
        """Starts fetching ``units`` where the budget has room without evicting a unit in use
        (the paged optimizer's next chunk)."""
        for u in units:
            # Off the trace (a step), any unpinned unit may make room: the trace's order
            # would keep the units that the next forward needs first, and refuse.
            if u.state is State.AWAY and self._make_room(u.nbytes, force=False, target=None,
                                                         prefetching=True):
                self._start_fetch(u)

    def trim(self) -> None:
        """Evicts unpinned units until the budget holds again (after a forced acquire)."""
        self._make_room(0, force=True, target=None)

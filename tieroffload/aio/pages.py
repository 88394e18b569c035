"""Host pages freed and refilled in place: given back to the OS, mapped afresh, or moved aside
(mremap) for the next buffer that needs them. Knows nothing of tensors."""

from __future__ import annotations

import errno
import threading

from .. import _native

discard = _native.discard  # (addr, nbytes): the pages go to the OS and read as zeros
renew = _native.renew  # (addr, nbytes): one fresh mapping, reading as zeros


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

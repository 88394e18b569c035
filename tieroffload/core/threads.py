"""Compute threads on the CPU: one core lent to the I/O path while compute is behind it.

On a machine with few cores, compute on every core can slow the reads that feed it: the
kernel's (or, in a virtual machine, the host's) side of each read needs a core, and an intra-op
thread that loses its core holds the others at the end of every parallel region. When compute
had to wait for its unit and the next unit along the trace is still being read, the pass is
I/O-bound for now: compute then runs on one thread fewer, which costs it little (it waits
anyway) and gives the reads a core. It gets every thread back at the first acquire that finds
the next unit in. A wait is needed to start: a unit merely still on its way when compute
reaches the module before it often arrives in time, and lending then would only slow compute.
"""

from __future__ import annotations

import torch


class CoreLender:
    """Sets torch's intra-op thread count to one fewer than the user's while lent, and back."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._threads: int | None = None  # the user's count while a core is lent

    @property
    def lent(self) -> bool:
        return self._threads is not None

    def lend(self, waited: bool, behind: bool) -> None:
        """Lends a core when compute ``waited`` for its unit and is ``behind`` (the next unit
        is still being read); keeps it lent while behind; gives it back when not."""
        if not behind:
            self.give_back()
        elif waited and self.enabled and self._threads is None:
            n = torch.get_num_threads()
            if n > 1:
                self._threads = n
                torch.set_num_threads(n - 1)

    def give_back(self) -> None:
        if self._threads is not None:
            torch.set_num_threads(self._threads)
            self._threads = None

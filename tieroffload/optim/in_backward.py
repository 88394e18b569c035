"""``overlap="backward"``: each chunk steps during backward as soon as its gradients are final,
its state read ahead of backward, so the state's I/O overlaps backward's compute."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..core.units import State, Unit
from .deferred import Updater
from .hyper import HyperCheck
from .layout import Chunk, Layout
from .pager import StatePager

if TYPE_CHECKING:
    from ..hooks.state import OffloadState


class BackwardSteps:
    """Counts the backward passes (micro-batches) since the last ``step()``, and with
    ``overlap="backward"`` steps each chunk in the last of ``accumulation_steps`` once all its
    units have their gradients. Keeps which chunks stepped (``stepped``), a step torn by a
    backward that raised after some had (``torn``), and a state store that failed after they
    had (``failed_store``, raised by the next ``step()``)."""

    def __init__(self, offload: OffloadState, layout: Layout, pager: StatePager,
                 updater: Updater, hyper: HyperCheck, overlap: bool | str,
                 accumulation_steps: int) -> None:
        self.offload = offload
        self.layout = layout
        self.pager = pager
        self.updater = updater
        self.hyper = hyper
        self.overlap = overlap
        self.accumulation_steps = accumulation_steps
        self.backwards = 0  # backward passes begun since the last step()
        self.ready: dict[int, set[int]] = {}  # chunk -> units with grads
        self.stepped: set[int] = set()  # chunks stepped this backward
        self.stepped_at = 0  # the backward (its count) in which they stepped
        # The forward before a stepping backward reads the state of the chunks from this
        # index on as it reaches them (see window_start).
        self.tail: int | None = None
        self.used: list[dict[str, Any]] | None = None  # the hyperparameters they stepped with
        self.writing_own = False  # an in-backward step writes its chunk's parameters
        self.torn: list[int] = []  # chunks stepped by a backward that then raised
        # A state store that failed inside backward, after chunks had stepped: raised by the
        # next step(), which a retry redoes whole (the state stays resident until written).
        self.failed_store: BaseException | None = None

    def grads_ready(self, u: Unit) -> bool:
        """See ``PagedOptimizer.grads_ready``."""
        i = self.layout.unit_chunk.get(u.id)
        if (self.overlap != "backward" or i is None
                or self.backwards < self.accumulation_steps):
            return False
        if i in self.stepped and self.stepped_at == self.backwards:
            raise RuntimeError(
                f"tieroffload: {u.names[0]!r} got a second gradient in one micro-batch, after "
                'overlap="backward" had stepped its chunk with the first: a second backward '
                "through the same graph (retain_graph=True) before step(), or a module used in "
                "two reentrant checkpoint segments (use_reentrant=True), gives one per pass; "
                "call step() between backwards, use use_reentrant=False, or overlap=True")
        if i in self.stepped:
            raise RuntimeError(
                f'tieroffload: overlap="backward" steps each chunk during backward number '
                f"{self.accumulation_steps} (accumulation_steps) after a step(), so step() must "
                "follow it; pass accumulation_steps=N for N micro-batches, or use overlap=True")
        grads = self.offload.grads
        if grads is not None:
            grads.merge(u)
        chunks = self.layout.chunks
        chunk = chunks[i]
        ready = self.ready.setdefault(i, set())
        ready.add(u.id)
        if len(ready) < len(chunk.units):
            return True
        del self.ready[i]
        if not self.stepped:  # refused before the first chunk steps: nothing is torn
            self.hyper.check(self.layout.param_groups, in_backward=True)
            self.used = self.layout.hyperparameters()
        self.layout.sync_groups(chunk, self.used)
        with torch.no_grad():
            self.pager.state_in(chunk)
            # Stepped from here: a state read that failed (twice, see StatePager.wait) changed
            # nothing, and a backward that raised before the first chunk stepped can be retried.
            self.stepped.add(i)
            self.stepped_at = self.backwards
            # the step hooks bring the parameters in and out
            self.writing_own = True  # its own writes to the chunk pass check_write
            try:
                self.updater.step_chunk(chunk, None, [], self.updater.fill, record=True)
            finally:
                self.writing_own = False
            for p in chunk.params:
                p.grad = None
            self.updater.consume_grads(chunk)
            if self.offload.mover is not None and not self.offload.mover.cuda:
                # Backward needs these parameters no more: written now, while it computes,
                # not all at once when the budget needs their memory (see write_behind).
                self.offload.scheduler.write_behind(chunk.units)
            # The stores of the chunks before have had this chunk's backward to finish: their
            # pages go to the state read next (backward runs from the last chunk). One may go
            # on behind that read: waiting for it held the read back, and backward with it.
            try:
                self.pager.drain(keep=1)
            except Exception as e:  # raised by step(): from here no retry could redo backward
                self.failed_store = self.failed_store or e
            if i > 0 and i - 1 not in self.stepped:
                self.bring_in(chunks[i - 1])
                self.read_ahead(i - 1)
            self.pager.page_out(chunk)
        return True

    def finish(self) -> None:
        """The step() after a stepping backward: steps the chunks backward did not (they got
        no gradient), with the hyperparameters backward used; raises where one has changed
        since (after stepping: the step is whole)."""
        chunks = self.layout.chunks
        todo = [i for i in range(len(chunks)) if i not in self.stepped]
        used, self.used = self.used, None
        self.stepped.clear()
        self.ready.clear()
        for i in todo:
            self.layout.sync_groups(chunks[i], used)
        self.updater.run(todo, None, [], self.updater.fill, record=True)
        changed = self.changed_since(used)
        if changed:
            raise RuntimeError(changed)

    def failed(self, uncount: bool) -> None:
        """See ``PagedOptimizer.backward_failed``."""
        if self.stepped:
            self.torn = sorted(self.stepped)
        elif uncount:
            self.backwards = max(0, self.backwards - 1)
        self.stepped.clear()
        self.ready.clear()
        self.used = None

    def abandon(self) -> None:
        """Forgets a torn step, a failed store and the chunks stepped in a backward."""
        self.torn, self.failed_store = [], None
        self.stepped.clear()
        self.ready.clear()
        self.used = None

    def take_failed_store(self) -> None:
        """Raises (once) the error of a state store that failed inside backward."""
        error, self.failed_store = self.failed_store, None
        if error is not None:
            raise error

    def check_torn(self) -> None:
        if self.torn:
            raise RuntimeError(
                f'tieroffload: a backward with overlap="backward" raised after {len(self.torn)}'
                f" of {len(self.layout.chunks)} chunks had stepped: their parameters hold that "
                "step's update and the others do not, which no retry can undo; load the last "
                "checkpoint (tieroffload.load_checkpoint(path, model, opt)) to go on")

    def check_unstepped(self) -> None:
        """Refuses a zero_grad() between a stepping backward and step()."""
        if self.stepped:
            raise RuntimeError(
                f'tieroffload: zero_grad() after a backward in which overlap="backward" '
                f"stepped {len(self.stepped)} of {len(self.layout.chunks)} chunks, before "
                "step(): the update is taken already, so the batch cannot be skipped; call "
                "step() to finish it (skipping batches needs overlap=True)")

    def check_write(self, u: Unit) -> None:
        """See ``PagedOptimizer.check_write``."""
        i = self.layout.unit_chunk.get(u.id)
        if i is not None and i in self.stepped and not self.writing_own:
            raise RuntimeError(
                f"tieroffload: writing {u.names[0]!r} between backward and step(): "
                'overlap="backward" has stepped its chunk during backward already, so the '
                "write would replace this step's update instead of being updated by it; write "
                "before backward or after step(), or use overlap=True")

    def changed_since(self, used: list[dict[str, Any]] | None) -> str | None:
        """Says which hyperparameter changed since chunks stepped in backward with ``used``."""
        for gi, (then, g) in enumerate(zip(used or [], self.layout.param_groups)):
            for k, old in then.items():
                new = g.get(k)
                same = (torch.equal(old, new) if isinstance(old, torch.Tensor)
                        and isinstance(new, torch.Tensor) else old == new)
                if not same:
                    return (f"tieroffload: param group {gi}'s {k!r} changed from {old!r} to "
                            f'{new!r} between backward and step(); with overlap="backward" '
                            "every chunk stepped during backward with the first (this step "
                            "used it throughout): set hyperparameters before backward (a "
                            "scheduler stepped after opt.step() does), or use overlap=True")
        return None

    def forward_begins(self) -> None:
        """Before the forward whose backward is the last of ``accumulation_steps``, the first
        chunk that backward steps starts in."""
        chunks = self.layout.chunks
        if (self.overlap == "backward" and self.backwards + 1 == self.accumulation_steps
                and chunks):
            self.bring_in(chunks[-1])
            self.tail = self.window_start()

    def backward_begins(self) -> None:
        self.backwards += 1
        self.tail = None

    def read_tail(self, units: list[Unit] | None) -> None:
        """In the forward before a stepping backward: starts reading the state of the units'
        chunks from ``tail`` on (backward steps those first)."""
        if self.tail is not None and units is not None and torch.is_grad_enabled():
            for i in {self.layout.unit_chunk.get(u.id, -1) for u in units}:
                if i >= self.tail:
                    self.pager.page_in(self.layout.chunks[i])

    def window(self) -> int:
        """Bytes of state an in-backward step may hold, the chunk stepping and the stores on
        their way included: twice the largest chunk's. Reading ahead within it keeps the disk
        busy where one chunk at a time left it idle between small chunks; where the chunks are
        as large as the largest, one is read ahead, as before."""
        return 2 * max((c.state_unit.nbytes for c in self.layout.chunks
                        if c.state_unit is not None), default=0)

    def window_start(self) -> int:
        """The first of the last chunks whose state fits the window together: backward steps
        them first, so the forward before reads them, where the disk has time to spare."""
        chunks = self.layout.chunks
        room, i = self.window(), len(chunks)
        while i > 0 and chunks[i - 1].state_unit is not None \
                and chunks[i - 1].state_unit.nbytes <= room:
            room -= chunks[i - 1].state_unit.nbytes
            i -= 1
        return i

    def read_ahead(self, i: int) -> None:
        """In backward, after ``bring_in(chunks[i])``: starts the state reads of the chunks
        before it, which backward steps next, while the state held fits ``window``."""
        chunks = self.layout.chunks
        room = self.window() - sum(
            c.state_unit.nbytes for c in chunks
            if c.state_unit is not None and c.state_unit.state is not State.AWAY)
        for j in range(i - 1, -1, -1):
            u = chunks[j].state_unit
            if j in self.stepped or u is None or u.state is not State.AWAY:
                continue
            if u.nbytes > room:
                return
            self.pager.page_in(chunks[j])
            room -= u.nbytes

    def bring_in(self, chunk: Chunk) -> None:
        """Starts reading what an in-backward step of ``chunk`` needs from NVMe: its state, and
        its gradients from earlier micro-batches."""
        self.pager.page_in(chunk)
        if self.offload.grads is not None:
            self.offload.grads.start_bring_in(chunk.units)

"""When a view taken outside the hooks is gone: a unit held for one (``p.data``,
``p.detach()``; see ``Guards.untouch``) may go as soon as no tensor views its storage any more,
instead of at the next forward. PEFT's ``merge_and_unload`` writes each layer's weight through
``weight.data`` in turn: each unit then goes before the next comes, within the budget."""

from __future__ import annotations

from typing import Callable

from ..compat.tensors import plain_tensors, storage_key, storage_users
from ..core.units import State, Unit


def users(u: Unit) -> int:
    """References to the storages of ``u``'s parameters (each parameter, its unit's flat
    buffer, and every view of them)."""
    with plain_tensors():
        storages = {storage_key(s): s for s in (p.untyped_storage() for p in u.params)}
        return sum(storage_users(s) for s in storages.values())


class ViewLedger:
    """The storage users each held unit had before the operation that holds it."""

    def __init__(self) -> None:
        self.base: dict[int, int] = {}  # unit id -> users before the view was taken

    def before(self, u: Unit, held: list[Unit]) -> None:
        """Records ``u``'s users before an operation that may hold it for a view; only while
        no move of it is under way (a move's own references would count)."""
        if u not in held and u.state in (State.AWAY, State.RESIDENT):
            self.base[u.id] = users(u)
        elif u not in held:
            self.base.pop(u.id, None)

    def forget(self, u: Unit) -> None:
        """``u`` is held some other way (inside ``materialize``): not let go here."""
        self.base.pop(u.id, None)

    def gone(self, held: list[Unit]) -> list[Unit]:
        """The units of ``held`` (with repeats) whose views are all gone."""
        done = {u.id for u in dict.fromkeys(held)
                if u.id in self.base and users(u) <= self.base[u.id]}
        for uid in done:
            del self.base[uid]
        return [u for u in held if u.id in done]

    def let_go(self, held: list[Unit], keep: list[Unit], release: Callable[[list[Unit]], None]
               ) -> list[Unit]:
        """Releases (``release``) the units of ``held`` whose views are gone, but those of
        ``keep`` (the operation under way uses them); returns what stays held."""
        gone = self.gone([u for u in held if u not in keep])
        if not gone:
            return held
        release(gone)
        return [u for u in held if u not in gone]

    def clear(self) -> None:
        self.base.clear()

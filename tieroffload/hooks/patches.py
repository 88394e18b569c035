"""The changes tieroffload makes to torch (and to accelerate) outside the models it offloads:
each is a ``Patch``, put in place by the first model offloaded and undone, to the very objects
it replaced, by the last one closed. Importing tieroffload changes nothing.

Modules register their patches here at import (``register``); a layer above hooks (the clip
functions in ``optim``) registers into this one, so the hooks layer never imports it. A patch
that only some models need (accelerate's clip) is held by those models alone (``Patch.hold``).
docs/design.md ("Patches of torch") lists them and why."""

from __future__ import annotations

from typing import Callable

Undo = Callable[[], None]


class Patch:
    """One change outside the models: ``install`` makes it and returns what undoes it. It is
    in place while at least one holder holds it (a count: nested holds are fine)."""

    def __init__(self, name: str, install: Callable[[], Undo]) -> None:
        self.name = name
        self._install = install
        self._undo: Undo | None = None
        self.holders = 0

    def hold(self) -> None:
        self.holders += 1
        if self.holders == 1:
            self._undo = self._install()

    def let_go(self) -> None:
        if self.holders <= 0:
            raise RuntimeError(f"tieroffload: patch {self.name!r} let go more often than held")
        self.holders -= 1
        if self.holders == 0:
            undo, self._undo = self._undo, None
            if undo is not None:
                undo()


_every_model: list[Patch] = []  # held while any model is offloaded
_models = 0  # models offloaded and not closed


def register(name: str, install: Callable[[], Undo]) -> Patch:
    """Registers a patch that every offloaded model needs: in place from now on if a model is
    offloaded already, else from the first ``offload``."""
    patch = Patch(name, install)
    _every_model.append(patch)
    for _ in range(_models):
        patch.hold()
    return patch


def model_opened() -> None:
    """A model was offloaded: the patches are in place while it is open."""
    global _models
    _models += 1
    for patch in _every_model:
        patch.hold()


def model_closed() -> None:
    """A model was closed: after the last one, torch is as it was before the first."""
    global _models
    _models -= 1
    for patch in reversed(_every_model):
        patch.let_go()


def installed() -> list[str]:
    """The names of the patches in place now."""
    return [p.name for p in _every_model if p.holders > 0]

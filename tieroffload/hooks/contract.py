"""What the hooks ask of a paged optimizer (``optim.PagedOptimizer``), declared here so that
the hooks layer, below ``optim``, names the contract instead of calling into ``Any``. A paged
optimizer adds itself to its model's ``OffloadState.optimizers``; the hooks then tell it of
each pass and ask it before a write, a clip or a close."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch

from ..core.units import Unit

Held = tuple[list[tuple[int, int]], int]  # (address ranges mapped, bytes from malloc)


@runtime_checkable
class PagedOptimizer(Protocol):
    """The methods and attributes of a paged optimizer that the hooks use."""

    overlap: bool | str  # True, False or "backward" (steps chunks inside backward)

    def forward_begins(self) -> None:
        """A training forward of the model begins."""

    def backward_begins(self) -> None:
        """The backward of a fresh forward begins: one micro-batch more."""

    def check_zeroed(self) -> None:
        """Refuses a backward after a step that let the gradients go, with no zero_grad."""

    def grads_ready(self, u: Unit) -> bool:
        """``u``'s gradients are whole; True when it took them (stepped in backward)."""

    def backward_failed(self, uncount: bool = False) -> None:
        """The model's last backward raised (``uncount``: it had counted as a micro-batch)."""

    def abandon_step(self) -> None:
        """Forgets what a failed, torn or deferred step left undone (before a load)."""

    def grads_zeroed(self, ids: set[int], set_to_none: bool | None = None) -> None:
        """A zero_grad outside this optimizer cleared the gradients of parameters ``ids``
        (None: forgotten, as by ``drop_stored_grads``)."""

    def check_write(self, u: Unit) -> None:
        """Refuses a write to ``u`` this optimizer cannot follow."""

    @property
    def stepped_in_backward(self) -> bool:
        """Chunks stepped during backward and ``step()`` has not followed."""

    def used_grads_of(self, params: list[torch.Tensor]) -> bool:
        """Some of ``params`` had their gradients used up by a step inside backward."""

    def owns(self, params: list[torch.Tensor]) -> bool:
        """Every one of ``params`` is stepped by this optimizer."""

    def clip_params(self, params: list[torch.Tensor], max_norm: float, norm_type: float,
                    error_if_nonfinite: bool, fp32: bool = False) -> torch.Tensor:
        """``clip_grad_norm_`` over ``params``, which it owns (``fp32``: DeepSpeed's)."""

    def settle(self, units: list[Unit] | None = None) -> None:
        """Applies the deferred updates of ``units`` (all: None)."""

    def deferred_units(self) -> list[Unit]:
        """The units whose update is deferred (their stored gradients are taken)."""

    def held(self) -> dict[str, Held]:
        """Host memory it holds, by kind (see ``OffloadState.memory``)."""

    def close(self, apply: bool = True) -> None:
        """Applies what is deferred (``apply``) and lets everything go."""


def settle(optimizers: Iterable[PagedOptimizer], units: list[Unit] | None = None) -> None:
    """Applies the deferred updates of ``units`` (all: None) of each of ``optimizers``."""
    for opt in list(optimizers):
        opt.settle(units)

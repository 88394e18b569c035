"""Autograd engine internals: whether backward is running, and callbacks at its end."""

from __future__ import annotations

from typing import Callable

import torch

TESTED = ("2.13",)


def in_backward() -> bool:
    """True while the autograd engine runs a graph task on this thread (a forward run inside
    backward is a recomputation, as activation checkpointing does)."""
    return torch._C._current_graph_task_id() != -1


def at_backward_end(fn: Callable[[], None]) -> None:
    """Runs ``fn`` once the current backward pass has finished (call it during backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)

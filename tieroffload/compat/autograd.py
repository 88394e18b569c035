"""Autograd engine internals: whether backward is running (and which pass), callbacks at its
end, a tensor's node and whether a pass runs it."""

from __future__ import annotations

from typing import Any, Callable

import torch

TESTED = ("2.11", "2.13")


def in_backward() -> bool:
    """True while the autograd engine runs a graph task on this thread (a forward run inside
    backward is a recomputation, as activation checkpointing does)."""
    return graph_task() != -1


def graph_task() -> int:
    """The id of the backward pass running on this thread (-1 outside backward)."""
    return torch._C._current_graph_task_id()


def grad_node(t: torch.Tensor) -> Any:
    """The node that computes ``t``'s gradient: its grad_fn, or a leaf's AccumulateGrad."""
    return torch.autograd.graph._get_grad_fn_or_grad_acc(t)


def will_execute(node: Any) -> bool:
    """Whether the running backward pass executes ``node`` (call it during backward). A leaf's
    node under ``torch.autograd.grad``, which torch will not say, counts as executed."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # "A leaf node was passed ... running autograd.grad()"
        return True


def at_backward_end(fn: Callable[[], None]) -> None:
    """Runs ``fn`` once the current backward pass has finished (call it during backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def top_pack_hook() -> Callable[[torch.Tensor], Any] | None:
    """The pack hook on top of this thread's stack of default saved-tensor hooks, or None."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return None if top is None else top[0]


def saved_tensors_hooks_disabled() -> str | None:
    """Why saved-tensor hooks are off on this thread
    (``torch.autograd.graph.disable_saved_tensors_hooks``), or None where they are on."""
    if torch._C._autograd._saved_tensors_hooks_is_enabled():
        return None
    return torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() or "disabled"

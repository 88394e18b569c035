"""A step's timeline as a Chrome trace-event file (opens in https://ui.perfetto.dev and
``chrome://tracing``): the forward and backward of each module on the ``compute`` lane, each
read and write (its bytes, kind and tier) on ``io`` lanes, each wait on the lane of the thread
that waited, and the step's phases. Events on one lane never overlap, though they may nest:
reads in flight together go on lanes ``io 0``, ``io 1``, ... ."""

from __future__ import annotations

import json
import os
import time
import weakref
from typing import Any, Callable

import torch
from torch import nn

from ..compat.autograd import at_backward_end, grad_node, graph_task, will_execute
from ..compat.pytree import tree_flatten
from ..core import timeline


def _grad_tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


class StepTracer:
    """Records one step: makes a ``core.timeline.Timeline`` the active one and times each
    module's forward and backward with hooks that ``finish`` removes."""

    def __init__(self, model: nn.Module) -> None:
        self.timeline = timeline.Timeline()
        self._handles: list[Any] = []
        self._open: dict[int, list[dict[str, Any]]] = {}  # module id -> its forwards open
        self._bwd_open: list[dict[str, Any]] = []  # backward spans with no end seen yet
        # id(tensor) -> (the tensor, weakly; span ends; span starts) run by its one hook
        self._grad_fns: dict[int, tuple[weakref.ref, list, list]] = {}
        for name, module in model.named_modules():
            name = name or "<root>"
            self._handles.append(module.register_forward_pre_hook(self._pre(name)))
            self._handles.append(module.register_forward_hook(self._post(module),
                                                              always_call=True))
        timeline.ACTIVE = self.timeline

    def _pre(self, name: str) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            ev = self.timeline.add(f"forward {name}", "compute", "compute",
                                   time.perf_counter(), None, module=name)
            self._open.setdefault(id(module), []).append(ev)
        return hook

    def _post(self, module: nn.Module) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            stack = self._open.get(id(module))
            if not stack:
                return
            ev = stack.pop()
            ev["end"] = time.perf_counter()
            if torch.is_grad_enabled():
                ins = _grad_tensors(args)
                outs = [t for t in _grad_tensors(output) if all(t is not i for i in ins)]
                if outs:  # a module with no input needing grad ends with its parameters'
                    ins = ins or [p for p in module.parameters() if p.requires_grad]
                    self._watch_backward(ev["args"]["module"], outs, ins)
        return hook

    def _on_grad(self, t: torch.Tensor, fn: Callable[[], None], start: bool) -> None:
        """Runs ``fn`` when ``t``'s gradient is computed. One hook per tensor runs the ends of
        the spans that wait on it (innermost module first) before the starts (outermost
        first): a tensor both one module's input and another's output ends the one before
        the other begins, and a module starts before the modules inside it."""
        entry = self._grad_fns.get(id(t))
        if entry is None or entry[0]() is not t:
            entry = (weakref.ref(t), [], [])
            self._grad_fns[id(t)] = entry
            ends, starts = entry[1], entry[2]

            def hook(grad: torch.Tensor) -> None:
                for f in ends:
                    f()
                for f in reversed(starts):
                    f()

            h = t.register_hook(hook)
            if isinstance(t, nn.Parameter):  # outlives the step: removed by finish
                self._handles.append(h)
        (entry[2] if start else entry[1]).append(fn)

    def _watch_backward(self, name: str, outs: list[torch.Tensor],
                        ins: list[torch.Tensor]) -> None:
        """A span from the first gradient reaching ``outs`` to the last of ``ins`` (see
        ``hooks.passes._hook_backward``)."""
        nodes = [grad_node(t) for t in ins]
        state: dict[str, Any] = {"task": None, "left": 0, "ev": None}

        def first() -> None:
            if state["task"] == graph_task() or timeline.ACTIVE is not self.timeline:
                return
            state["task"], state["left"] = graph_task(), sum(map(will_execute, nodes))
            state["ev"] = self.timeline.add(f"backward {name}", "compute", "compute",
                                            time.perf_counter(), None, module=name)
            self._bwd_open.append(state["ev"])
            if len(self._bwd_open) == 1:
                at_backward_end(self._close_backward)

        def each_input() -> None:
            if state["task"] == graph_task() and state["left"] > 0:
                state["left"] -= 1
                if state["left"] == 0 and state["ev"] is not None:
                    state["ev"]["end"] = time.perf_counter()
                    self._bwd_open.remove(state["ev"])

        for t in outs:
            self._on_grad(t, first, start=True)
        for t in ins:
            self._on_grad(t, each_input, start=False)

    def _close_backward(self) -> None:
        """Spans whose end no gradient showed end with the backward pass."""
        now = time.perf_counter()
        for ev in self._bwd_open:
            ev["end"] = now
        self._bwd_open.clear()

    def finish(self, path: str | os.PathLike, step: int) -> None:
        """Stops recording and writes the trace of ``step`` to ``path``."""
        if timeline.ACTIVE is self.timeline:
            timeline.ACTIVE = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._grad_fns.clear()
        write_chrome_trace(self.timeline, path, step)


def _place(events: list[dict[str, Any]], base: str, nested: bool) -> dict[str, list]:
    """Splits one lane's events into sub-lanes where none overlap (``nested``: an event
    inside another may share its lane)."""
    lanes: list[list[float]] = []  # per sub-lane, the ends of the spans still open

    def fits(ends: list[float], ev: dict[str, Any]) -> bool:
        while ends and ends[-1] <= ev["start"]:
            ends.pop()
        return not ends or (nested and ev["end"] <= ends[-1])

    out: dict[str, list] = {}
    for ev in sorted(events, key=lambda e: (e["start"], -e["end"])):
        i = next((j for j, ends in enumerate(lanes) if fits(ends, ev)), len(lanes))
        if i == len(lanes):
            lanes.append([])
        lanes[i].append(ev["end"])
        name = base if i == 0 and base != "io" else f"{base} {i}"
        out.setdefault(name, []).append(ev)
    return out


def write_chrome_trace(tl: timeline.Timeline, path: str | os.PathLike, step: int) -> None:
    """Writes ``tl``'s events in Chrome's trace-event JSON (microseconds from its start)."""
    now = time.perf_counter()
    by_lane: dict[str, list[dict[str, Any]]] = {}
    for ev in list(tl.events):
        if ev["end"] is None:  # still in flight: shown up to now
            ev = dict(ev, end=now, args=dict(ev["args"], unfinished=True))
        by_lane.setdefault(ev["lane"], []).append(ev)
    lanes: dict[str, list] = {}
    for lane, evs in sorted(by_lane.items()):
        lanes.update(_place(evs, lane, nested=evs[0]["cat"] in ("compute", "phase")))
    order = sorted(lanes, key=lambda n: (not n.startswith("step"), not n.startswith("compute"),
                                         not n.startswith("wait"), n))
    out: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0,
                                  "args": {"name": f"tieroffload step {step}"}}]
    for tid, lane in enumerate(order, 1):
        out.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid,
                    "args": {"name": lane}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": tid,
                    "args": {"sort_index": tid}})
        for ev in lanes[lane]:
            out.append({"name": ev["name"], "cat": ev["cat"], "ph": "X", "pid": 1, "tid": tid,
                        "ts": (ev["start"] - tl.start) * 1e6,
                        "dur": max(0.0, ev["end"] - ev["start"]) * 1e6, "args": ev["args"]})
    with open(path, "w") as f:
        json.dump({"traceEvents": out, "displayTimeUnit": "ms",
                   "otherData": {"step": step, "source": "tieroffload.Monitor"}}, f)

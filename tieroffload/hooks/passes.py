"""Forward and backward hooks: units acquired before a module runs and released after it,
gradients handed on as each unit's backward ends, pins held from forward to backward, and
the phase of training the model is in (``Phase``)."""

from __future__ import annotations

import enum
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..compat.autograd import at_backward_end, grad_node, graph_task, in_backward, will_execute
from ..compat.pytree import tree_flatten
from ..core.stats import Stats
from ..core.threads import CoreLender
from ..core.units import Unit
from ..integrations import fsdp
from ..utils.dist import world_size
from .build import Layout
from .contract import PagedOptimizer, settle
from .guards import Guards, refuse_deepcopy, refuse_pickle
from .policy import BasePolicy

if TYPE_CHECKING:
    from .tiers import Tiers


def _grad_tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.requires_grad]

def _hook_backward(outs: list[torch.Tensor], ins: list[torch.Tensor],
                   before: Callable[[], None], after: Callable[[], None]) -> None:
    """In each backward pass, runs ``before`` at the first gradient that reaches ``outs`` and
    ``after`` once the pass has computed every gradient of ``ins`` it computes (the "any" and
    "all" modes of torch's ``register_multi_grad_hook``).

    Built without a reference cycle through autograd's nodes, which Python's collector cannot
    free: torch's "all" mode keeps every input's node in the hook it puts on that input, and so
    kept every graph alive (46.7 MiB and 66 k objects more over 100 steps of a 4-layer GPT).
    Here the inputs' nodes are held by the outputs' hooks only, and the outputs' nodes lead to
    the inputs', never back (``outs`` holds none of ``ins``)."""
    nodes = [grad_node(t) for t in ins]
    state = [-1, 0]  # the backward pass seen last, and the input gradients it has yet to give

    def first(grad: torch.Tensor) -> None:
        task = graph_task()
        if state[0] == task:
            return
        state[0], state[1] = task, sum(map(will_execute, nodes))
        before()

    def each_input(grad: torch.Tensor) -> None:
        if state[0] == graph_task() and state[1] > 0:
            state[1] -= 1
            if state[1] == 0:
                after()

    for t in outs:
        t.register_hook(first)
    for t in ins:
        t.register_hook(each_input)


class Phase(enum.Enum):
    """Where the model's training passes stand, as the paged optimizers count them."""

    IDLE = "idle"  # no training forward since the last backward began
    FORWARD = "forward"  # a training forward ran; no backward has begun since
    BACKWARD = "backward"  # the backward of that forward: a micro-batch for the optimizers
    EXTRA_BACKWARD = "extra backward"  # a backward with no forward before it (a retained
    # graph's second backward): no micro-batch


_NEXT = {
    Phase.IDLE: {Phase.FORWARD, Phase.EXTRA_BACKWARD},
    Phase.FORWARD: {Phase.FORWARD, Phase.BACKWARD},
    Phase.BACKWARD: {Phase.IDLE},  # its end ran, or it raised (settle_failed_backward)
    Phase.EXTRA_BACKWARD: {Phase.IDLE},
}
_IN_BACKWARD = (Phase.BACKWARD, Phase.EXTRA_BACKWARD)


class Passes:
    """Follows an offloaded model's forward and backward passes: acquires each module's units
    before it runs and releases them after, holds them from forward to backward (pins),
    hands each unit's gradients on as its backward ends, and keeps the ``phase``."""

    __deepcopy__ = refuse_deepcopy
    __reduce_ex__ = refuse_pickle

    def __init__(self, layout: Layout, tiers: Tiers, guards: Guards,
                 optimizers: weakref.WeakSet[PagedOptimizer], policy: BasePolicy,
                 cores: CoreLender, stats: Stats) -> None:
        self.layout = layout
        self.tiers = tiers
        self.guards = guards
        self.optimizers = optimizers
        self.policy = policy
        self.cores = cores
        self.stats = stats
        self.phase = Phase.IDLE
        self._fwd_pins: dict[int, int] = {}  # unit id -> forwards that acquired, not released
        self._bwd_pins: dict[int, int] = {}
        self._grads_seen: dict[int, int] = {}
        self._deferred: list[Unit] = []  # units whose gradients wait for the end of backward
        self._defer_grads = False
        self._trainable: set[int] = set()

    def _enter(self, phase: Phase) -> None:
        if phase not in _NEXT[self.phase]:
            raise RuntimeError(f"tieroffload: internal error: training phase "
                               f"{self.phase.value} cannot go to {phase.value}")
        self.phase = phase

    def install(self, model: nn.Module, handles: list[Any],
                undo: list[Callable[[], None]]) -> None:
        """The forward, backward and gradient hooks (``handles`` and ``undo`` remove them)."""
        # With several ranks, DDP reduces the gradients in a callback at the end of backward:
        # they are paged once backward is over, after it (see _end_backward).
        self._defer_grads = self.tiers.grads is not None and world_size() > 1
        h = handles
        h.append(model.register_forward_pre_hook(self._begin_iteration, prepend=True))
        h.append(model.register_forward_hook(self._end_forward))
        for module, units in self.layout.module_units.items():
            h.append(module.register_forward_pre_hook(self._pre_forward(units)))
            # always_call: released even when the forward raises (or stops early, as
            # non-reentrant checkpointing's recomputation does).
            h.append(module.register_forward_hook(self._post_forward(units), always_call=True))
        fsdp_units = {u.id for _, u in self.layout.fsdp_units}
        self._trainable = {id(p) for u in self.layout.units for p in u.params if p.requires_grad}
        for u in self.layout.units:
            for p in u.params:
                if p.requires_grad and u.id not in fsdp_units:
                    h.append(p.register_post_accumulate_grad_hook(self._grad_done(u)))
        for group, u in self.layout.fsdp_units:
            undo.append(fsdp.hook(group, lambda u=u: self._acquire([u]),
                                  lambda u=u: self.tiers.scheduler.release([u])))

    def _begin_iteration(self, module: nn.Module, args: Any) -> None:
        if not in_backward():  # not a recomputation inside backward
            self.tiers.scheduler.raise_failed_write()
            self.settle_failed_backward()
            self._release_fwd_pins()  # left by a forward that raised past its hooks
            self.guards.release_touched()
            if torch.is_grad_enabled():
                self._check_trainable()
                self._enter(Phase.FORWARD)
                for opt in list(self.optimizers):
                    opt.forward_begins()
            self.cores.give_back()  # a forward that raised kept it
        self.tiers.scheduler.begin_iteration()

    def _check_trainable(self) -> None:
        """Paged gradients and steps inside backward follow, per parameter, the gradients of
        those that required grad at offload (freezing one later is followed): a parameter made
        trainable since is refused before its first training forward."""
        if self.tiers.grads is None and not any(o.overlap == "backward" for o in self.optimizers):
            return
        for u in self.layout.units:
            for n, p in zip(u.names, u.params):
                if p.requires_grad and id(p) not in self._trainable:
                    raise RuntimeError(
                        f"tieroffload: parameter {n!r} requires grad but did not at offload(); "
                        f"gradients paged (grads={self.policy.grads!r}) or stepped inside "
                        'backward (overlap="backward") are set up at offload for the '
                        "parameters that require grad then: make it trainable before offload() "
                        "(freezing it later is followed), or close and offload again")

    def _end_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self.cores.give_back()  # the code between passes is the user's
        settle(self.optimizers)  # units the forward did not use: their updates precede backward

    def _pre_forward(self, units: list[Unit]) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            self._acquire(units)
            for u in units:
                self._fwd_pins[u.id] = self._fwd_pins.get(u.id, 0) + 1
        return hook

    def _acquire(self, units: list[Unit]) -> None:
        """Brings ``units`` in for compute, after any deferred optimizer update of theirs."""
        self.layout.check_loaded(units)
        settle(self.optimizers, units)
        self.tiers.scheduler.acquire(units)
        self._lend_core()

    def _lend_core(self) -> None:
        """Compute on one thread fewer while it is behind its reads (see ``threads``)."""
        if not self.cores.enabled:
            return
        self.cores.lend(self.tiers.scheduler.waited, self.tiers.scheduler.behind())
        self.stats.lent += self.cores.lent

    def _post_forward(self, units: list[Unit]) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for u in units:
                if self._fwd_pins.get(u.id, 0) <= 0:
                    continue  # already released by _begin_iteration
                self._fwd_pins[u.id] -= 1
                self.tiers.scheduler.release([u])
            if not torch.is_grad_enabled():
                return
            ins = _grad_tensors(args)
            outs = [t for t in _grad_tensors(output) if all(t is not i for i in ins)]
            if outs:
                # Grads reaching the outputs: this module's backward is about to run; grads
                # reaching all its inputs: its backward is done, its units may go.
                _hook_backward(outs, ins, lambda: self._pre_backward(units),
                               lambda: self._post_backward(units))
        return hook

    def _nothing_leaves(self) -> bool:
        """No unit can be evicted now: the budget holds them all, or all are held."""
        return (sum(u.nbytes for u in self.layout.units) <= self.layout.budget
                or all(u.pins > 0 for u in self.layout.units))

    def settle_failed_backward(self) -> None:
        """After a backward that raised (its end never ran): the optimizers are told (it is no
        micro-batch), and the gradients it accumulated into units it left part done are paged,
        so that a retry adds to them as AccumulateGrad adds to ``p.grad`` (in the same order,
        for the same bits)."""
        if not self.backward_raised():
            return
        counted = self.phase is Phase.BACKWARD
        self._enter(Phase.IDLE)
        for opt in list(self.optimizers):
            opt.backward_failed(uncount=counted)
        if self.tiers.grads is not None:
            for uid, seen in self._grads_seen.items():
                if seen:
                    self.tiers.grads.page_out(self.layout.units[uid])
        self._grads_seen.clear()
        self._deferred.clear()
        self._release_bwd_pins()

    def backward_raised(self) -> bool:
        """The last backward over the model raised (its end-of-backward callback never ran)."""
        return self.phase in _IN_BACKWARD and not in_backward()

    def _pre_backward(self, units: list[Unit]) -> None:
        if torch.is_grad_enabled() and not self._nothing_leaves():
            # create_graph=True: the graph of the gradients saves views of the weights, which
            # a later backward through it reads after their units may have gone.
            raise RuntimeError(
                "tieroffload: a backward with create_graph=True (a gradient penalty, a double "
                "backward) over offloaded parameters: the graph of the gradients keeps views of "
                "weights that are paged out after it; run it inside tieroffload.materialize("
                "model), or raise the budget to hold the whole model")
        if self.phase is Phase.FORWARD:
            for opt in list(self.optimizers):
                opt.check_zeroed()
        if self.phase not in _IN_BACKWARD:
            at_backward_end(self._end_backward)
        if self.phase is Phase.FORWARD:  # the backward of a forward, not one nested in it
            self._enter(Phase.BACKWARD)  # (reentrant checkpointing): a micro-batch
            for opt in list(self.optimizers):
                opt.backward_begins()
        elif self.phase is Phase.IDLE:
            self._enter(Phase.EXTRA_BACKWARD)
        self.tiers.scheduler.acquire(units)
        self._lend_core()
        for u in units:
            self._bwd_pins[u.id] = self._bwd_pins.get(u.id, 0) + 1

    def _post_backward(self, units: list[Unit]) -> None:
        for u in units:
            if self._bwd_pins.get(u.id, 0) > 0:
                self._bwd_pins[u.id] -= 1
                self.tiers.scheduler.release([u])

    def _grad_done(self, u: Unit) -> Callable:
        wanted = sum(p.requires_grad for p in u.params)

        def hook(p: torch.Tensor) -> None:
            seen = self._grads_seen.get(u.id, 0) + 1
            self._grads_seen[u.id] = seen
            if seen >= wanted:
                self._grads_seen[u.id] = 0
                self._grads_ready(u)
        return hook

    def _grads_ready(self, u: Unit) -> None:
        self.tiers.scheduler.release([u] * self._bwd_pins.pop(u.id, 0))
        taken = False
        for opt in list(self.optimizers):  # overlap="backward" steps here, before paging
            taken = opt.grads_ready(u) or taken
        if self.tiers.grads is not None and not taken:
            if self._defer_grads:
                self._deferred.append(u)
            else:
                self.tiers.grads.page_out(u)

    def _end_backward(self) -> None:
        if self.phase in _IN_BACKWARD:
            self._enter(Phase.IDLE)
        self.cores.give_back()
        for uid, seen in self._grads_seen.items():
            if seen:  # some parameters of the unit got no gradient this time
                self._grads_ready(self.layout.units[uid])
        self._grads_seen.clear()
        self._release_bwd_pins()
        if self._deferred:
            # Queued from a callback, this runs after every callback queued during backward,
            # DDP's (which writes the reduced gradients) included.
            at_backward_end(self._page_deferred)

    def _release_bwd_pins(self) -> None:
        for uid, n in self._bwd_pins.items():
            self.tiers.scheduler.release([self.layout.units[uid]] * n)
        self._bwd_pins.clear()

    def _release_fwd_pins(self) -> None:
        """Releases the pins of forwards whose post-forward hook never ran (a
        KeyboardInterrupt skips torch's always-call hooks)."""
        for uid, n in self._fwd_pins.items():
            self.tiers.scheduler.release([self.layout.units[uid]] * n)
        self._fwd_pins.clear()

    def _page_deferred(self) -> None:
        units, self._deferred = self._deferred, []
        for u in units:
            self.tiers.grads.page_out(u)


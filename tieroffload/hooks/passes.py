"""Forward and backward hooks: units acquired before a module runs and released after it,
gradients handed on as each unit's backward ends, pins held from forward to backward."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..compat import fsdp2
from ..compat.autograd import at_backward_end, grad_node, graph_task, in_backward, will_execute
from ..compat.pytree import tree_flatten
from ..core.units import Unit
from ..integrations import fsdp


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


class PassHooks:
    """The part of ``OffloadState`` that follows forward and backward passes."""

    def _install_hooks(self, model: nn.Module) -> None:
        h = self._handles
        h.append(model.register_forward_pre_hook(self._begin_iteration, prepend=True))
        h.append(model.register_forward_hook(self._end_forward))
        for module, units in self.module_units.items():
            h.append(module.register_forward_pre_hook(self._pre_forward(units)))
            # always_call: released even when the forward raises (or stops early, as
            # non-reentrant checkpointing's recomputation does).
            h.append(module.register_forward_hook(self._post_forward(units), always_call=True))
            h.append(module.register_state_dict_pre_hook(self._quiet_begin))
            h.append(module.register_state_dict_post_hook(self._state_dict_post()))
            h.append(module.register_load_state_dict_pre_hook(self._load_pre(units)))
            h.append(module.register_load_state_dict_post_hook(self._load_post(units)))
        fsdp_units = {u.id for _, u in self.fsdp_units}
        self._trainable = {id(p) for u in self.units for p in u.params if p.requires_grad}
        for u in self.units:
            for p in u.params:
                if p.requires_grad and u.id not in fsdp_units:
                    h.append(p.register_post_accumulate_grad_hook(self._grad_done(u)))
        for group, u in self.fsdp_units:
            self._undo.append(fsdp.hook(group, lambda u=u: self._acquire([u]),
                                        lambda u=u: self.scheduler.release([u])))
        owners = {fsdp2.owner(fp) for g, _ in self.fsdp_units for fp in g.fsdp_params}
        for module in owners:  # the modules that hold the DTensors: their state dicts
            units = list(dict.fromkeys(self.param_unit[id(p)] for p in module._parameters.values()
                                       if p is not None and id(p) in self.param_unit))
            h.append(module.register_state_dict_pre_hook(self._quiet_begin))
            h.append(module.register_state_dict_post_hook(self._state_dict_post()))
            h.append(module.register_load_state_dict_pre_hook(self._load_pre(units)))
            h.append(module.register_load_state_dict_post_hook(self._load_post(units)))

    def _begin_iteration(self, module: nn.Module, args: Any) -> None:
        if not in_backward():  # not a recomputation inside backward
            self.scheduler.raise_failed_write()
            self.settle_failed_backward()
            self._release_fwd_pins()  # left by a forward that raised past its hooks
            self.release_touched()
            if torch.is_grad_enabled():
                self._check_trainable()
                self._fresh_forward = True
                for opt in list(self.optimizers):
                    opt.forward_begins()
            self.cores.give_back()  # a forward that raised kept it
        self.scheduler.begin_iteration()

    def _check_trainable(self) -> None:
        """Paged gradients and steps inside backward follow, per parameter, the gradients of
        those that required grad at offload (freezing one later is followed): a parameter made
        trainable since is refused before its first training forward."""
        if self.grads is None and not any(o.overlap == "backward" for o in self.optimizers):
            return
        for u in self.units:
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
        self.settle()  # units the forward did not use: their updates precede backward

    def _pre_forward(self, units: list[Unit]) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            self._acquire(units)
            for u in units:
                self._fwd_pins[u.id] = self._fwd_pins.get(u.id, 0) + 1
        return hook

    def _acquire(self, units: list[Unit]) -> None:
        """Brings ``units`` in for compute, after any deferred optimizer update of theirs."""
        self.check_loaded(units)
        self.settle(units)
        self.scheduler.acquire(units)
        self._lend_core()

    def _lend_core(self) -> None:
        """Compute on one thread fewer while it is behind its reads (see ``threads``)."""
        if not self.cores.enabled:
            return
        self.cores.lend(self.scheduler.waited, self.scheduler.behind())
        self.stats.lent += self.cores.lent

    def settle(self, units: list[Unit] | None = None) -> None:
        """Applies the paged optimizers' deferred updates of ``units`` (all: None)."""
        for opt in list(self.optimizers):
            opt.settle(units)

    def _post_forward(self, units: list[Unit]) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for u in units:
                if self._fwd_pins.get(u.id, 0) <= 0:
                    continue  # already released by _begin_iteration
                self._fwd_pins[u.id] -= 1
                self.scheduler.release([u])
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
        return (sum(u.nbytes for u in self.units) <= self.budget
                or all(u.pins > 0 for u in self.units))

    def settle_failed_backward(self) -> None:
        """After a backward that raised (its end never ran): the optimizers are told (it is no
        micro-batch), and the gradients it accumulated into units it left part done are paged,
        so that a retry adds to them as AccumulateGrad adds to ``p.grad`` (in the same order,
        for the same bits)."""
        if not self.backward_raised():
            return
        self._bwd_callback_queued = False
        for opt in list(self.optimizers):
            opt.backward_failed(uncount=self._counted)
        self._counted = False
        if self.grads is not None:
            for uid, seen in self._grads_seen.items():
                if seen:
                    self.grads.page_out(self.units[uid])
        self._grads_seen.clear()
        self._deferred.clear()
        self._release_bwd_pins()

    def backward_raised(self) -> bool:
        """The last backward over the model raised (its end-of-backward callback never ran)."""
        return self._bwd_callback_queued and not in_backward()

    def _pre_backward(self, units: list[Unit]) -> None:
        if torch.is_grad_enabled() and not self._nothing_leaves():
            # create_graph=True: the graph of the gradients saves views of the weights, which
            # a later backward through it reads after their units may have gone.
            raise RuntimeError(
                "tieroffload: a backward with create_graph=True (a gradient penalty, a double "
                "backward) over offloaded parameters: the graph of the gradients keeps views of "
                "weights that are paged out after it; run it inside tieroffload.materialize("
                "model), or raise the budget to hold the whole model")
        if self._fresh_forward:
            for opt in list(self.optimizers):
                opt.check_zeroed()
        if not self._bwd_callback_queued:
            self._bwd_callback_queued = True
            at_backward_end(self._end_backward)
        if self._fresh_forward:  # the backward of a forward, not one nested in it (reentrant
            self._fresh_forward = False  # checkpointing): a micro-batch for the optimizers
            self._counted = True
            for opt in list(self.optimizers):
                opt.backward_begins()
        self.scheduler.acquire(units)
        self._lend_core()
        for u in units:
            self._bwd_pins[u.id] = self._bwd_pins.get(u.id, 0) + 1

    def _post_backward(self, units: list[Unit]) -> None:
        for u in units:
            if self._bwd_pins.get(u.id, 0) > 0:
                self._bwd_pins[u.id] -= 1
                self.scheduler.release([u])

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
        self.scheduler.release([u] * self._bwd_pins.pop(u.id, 0))
        taken = False
        for opt in list(self.optimizers):  # overlap="backward" steps here, before paging
            taken = opt.grads_ready(u) or taken
        if self.grads is not None and not taken:
            if self._defer_grads:
                self._deferred.append(u)
            else:
                self.grads.page_out(u)

    def _end_backward(self) -> None:
        self._bwd_callback_queued = False
        self._counted = False
        self.cores.give_back()
        for uid, seen in self._grads_seen.items():
            if seen:  # some parameters of the unit got no gradient this time
                self._grads_ready(self.units[uid])
        self._grads_seen.clear()
        self._release_bwd_pins()
        if self._deferred:
            # Queued from a callback, this runs after every callback queued during backward,
            # DDP's (which writes the reduced gradients) included.
            at_backward_end(self._page_deferred)

    def _release_bwd_pins(self) -> None:
        for uid, n in self._bwd_pins.items():
            self.scheduler.release([self.units[uid]] * n)
        self._bwd_pins.clear()

    def _release_fwd_pins(self) -> None:
        """Releases the pins of forwards whose post-forward hook never ran (a
        KeyboardInterrupt skips torch's always-call hooks)."""
        for uid, n in self._fwd_pins.items():
            self.scheduler.release([self.units[uid]] * n)
        self._fwd_pins.clear()

    def _page_deferred(self) -> None:
        units, self._deferred = self._deferred, []
        for u in units:
            self.grads.page_out(u)


"""A model's own figures, measured on a sample step: compute per module, bytes saved for
backward, the optimizer's update rate, the step's peak."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..utils import memory

Sample = Callable[[nn.Module], torch.Tensor]


@dataclass(frozen=True)
class Profile:
    """What a sample step of the model measured, everything resident."""

    params: int                  # number of parameters
    param_bytes: int
    largest_unit: int            # bytes of the largest module's own parameters
    units: int                   # modules that own parameters (offload's units)
    forward_s: float
    backward_s: float
    optimizer_s: float           # AdamW (fused where it exists) over all parameters
    activation_bytes: int        # saved for backward (by storage, at least the threshold)
    activation_records: int
    step_peak: int               # peak memory of forward and backward beyond the parameters
    module_forward_s: dict[str, float] = field(default_factory=dict)

    @classmethod
    def measure(cls, model: nn.Module, sample: Sample, threshold: int = 1 << 20,
                repeats: int = 3) -> Profile:
        """Runs ``sample(model)`` (which returns a loss) and its backward ``1 + repeats`` times
        with the model as it is (resident), timing the last ``repeats`` (medians). The model's
        gradients and the random generators' states are as they were afterwards."""
        params = list({id(p): p for p in model.parameters()}.values())
        pbytes = sum(p.numel() * p.element_size() for p in params)
        owned = [sum(p.numel() * p.element_size() for p in m._parameters.values()
                     if p is not None) for m in model.modules()]
        owned = [b for b in owned if b]
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            s = t.untyped_storage()
            if s.nbytes() >= threshold and not isinstance(t, nn.Parameter):
                saved[s.data_ptr()] = s.nbytes()
            return t

        pids = {p.untyped_storage().data_ptr() for p in params}
        times: dict[str, list[float]] = {}
        hooks = []
        for name, m in model.named_modules():
            if any(p is not None for p in m._parameters.values()):
                hooks.append(m.register_forward_pre_hook(
                    lambda m, a, n=name: times.setdefault(n, []).append(-time.perf_counter())))
                hooks.append(m.register_forward_hook(
                    lambda m, a, o, n=name: times[n].append(times[n].pop() + time.perf_counter())))
        fwd, bwd = [], []
        memory.return_freed_memory()
        step_peak = 0
        # The model comes back as it was: its gradients, and the random streams the sample
        # draws from (dropout), so that training afterwards is the training without it.
        grads = [(p, p.grad) for p in params]
        cuda = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
        rng = torch.random.fork_rng(devices=cuda)
        rng.__enter__()
        try:
            for i in range(1 + repeats):
                model.zero_grad(set_to_none=True)
                before = memory.start_peak(torch.device("cpu"))
                t0 = time.perf_counter()
                if i == 0:
                    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                        loss = sample(model)
                else:
                    loss = sample(model)
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                if i:
                    fwd.append(t1 - t0)
                    bwd.append(t2 - t1)
                if before is not None and i == repeats:
                    step_peak = memory.peak(torch.device("cpu")) - before
        finally:
            for h in hooks:
                h.remove()
            for p, g in grads:
                p.grad = g
            rng.__exit__(None, None, None)
        paged = [n for ptr, n in saved.items() if ptr not in pids]  # parameters' views are not
        act = sum(paged)
        grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        if not step_peak:  # no peak to read here: everything at once, as a bound
            step_peak = act + grads
        opt_s = _adam_seconds(sum(p.numel() for p in params))
        per_module = {n: statistics.median(v[1:]) for n, v in times.items() if len(v) > 1}
        return cls(sum(p.numel() for p in params), pbytes, max(owned, default=0), len(owned),
                   statistics.median(fwd),
                   statistics.median(bwd), opt_s, act, len(paged), step_peak,
                   per_module)


def _adam_seconds(n: int, probe: int = 4 << 20) -> float:
    """Seconds of one AdamW update of ``n`` fp32 parameters, measured on ``probe`` of them."""
    p = nn.Parameter(torch.zeros(probe))
    p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    opt.step()
    t0 = time.perf_counter()
    for _ in range(3):
        opt.step()
    return (time.perf_counter() - t0) / 3 * n / probe

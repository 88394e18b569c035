"""``Policy.auto``'s search: candidate placements ranked by predicted step time under the
budgets, the fastest few measured when a builder is given."""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..hooks.policy import BasePolicy
from ..hooks.state import close, offload, stats
from ..optim.paged import optimizer
from ..utils import memory
from ..utils.sizes import format_bytes, parse_bytes
from .constants import ADAM_STATE
from .cost import Prediction, param_budget, predict
from .machine import Machine
from .profile import Profile, Sample


@dataclass(frozen=True)
class Plan:
    """What ``Policy.auto`` chose and why."""

    policy: BasePolicy
    prediction: Prediction
    budgets: dict[str, int | None]
    profile: Profile
    machine: Machine
    candidates: int
    fitting: int
    naive: Prediction | None = None
    trials: tuple[tuple[BasePolicy, Measured], ...] = ()  # the placements measured, if any
    in_backward: Prediction | None = None  # the same with the optimizer's overlap="backward"

    def explain(self) -> str:
        p, pr, prof = self.policy, self.prediction, self.profile
        lines = [
            f"model: {prof.params / 1e6:.1f} M parameters, {format_bytes(prof.param_bytes)}; "
            f"Adam state {format_bytes(ADAM_STATE * prof.params)}; activations saved for "
            f"backward {format_bytes(prof.activation_bytes)}; compute forward "
            f"{prof.forward_s:.3f} s, backward {prof.backward_s:.3f} s, AdamW "
            f"{prof.optimizer_s:.3f} s",
            f"machine: disk read {self.machine.read_gbps:.2f} GB/s, write "
            f"{self.machine.write_gbps:.2f} GB/s; NVMe traffic costs compute "
            f"{self.machine.io_cost * 1e9:.2f} s per GB moved"
            + (f"; host to GPU {self.machine.h2d_gbps:.1f} GB/s" if self.machine.h2d_gbps
               else ""),
            f"placement: parameters on {p.params}, gradients on {p.grads}, optimizer state on "
            f"{p.optimizer}, activations {p.activations or 'resident'}; "
            + (f"prefetch {p.prefetch} units ahead, resident parameter budget "
               f"{format_bytes(param_budget(p, prof))}"
               if p.pages_params else "parameters all resident"),
            f"predicted step: {pr.step_s:.3f} s (forward {pr.phases['forward']:.3f}, backward "
            f"{pr.phases['backward']:.3f}, optimizer step {pr.phases['step']:.3f}); NVMe "
            f"{format_bytes(pr.bytes_read)} read and {format_bytes(pr.bytes_written)} written "
            f"per step; bottleneck: {pr.bottleneck}",
            "predicted peak memory: " + ", ".join(
                f"{tier} {format_bytes(v)}"
                + (f" of {format_bytes(self.budgets[tier])}" if self.budgets.get(tier) else "")
                for tier, v in pr.peak.items() if v or self.budgets.get(tier)),
            f"searched {self.candidates} placements, {self.fitting} fit the budgets",
        ]
        ib = self.in_backward
        if ib is not None and ib.step_s < pr.step_s:
            lines.append(f'with tieroffload.optimizer(..., overlap="backward") (each chunk steps '
                         f"during backward: single process, no loss scaling, no clipping): "
                         f"{ib.step_s:.3f} s predicted ({pr.step_s / ib.step_s:.2f}x faster), "
                         f"NVMe {format_bytes(ib.bytes_read)} read and "
                         f"{format_bytes(ib.bytes_written)} written per step")
        if self.naive is not None:
            lines.append(f"all on NVMe would take {self.naive.step_s:.3f} s "
                         f"({self.naive.step_s / pr.step_s:.2f}x this)")
        for q, m in self.trials:
            lines.append(f"measured: parameters {q.params}, optimizer {q.optimizer}, gradients "
                         f"{q.grads}, activations {q.activations or 'resident'}: "
                         f"{m.step_s:.3f} s, peak {format_bytes(m.peak)}"
                         + ("  <- chosen" if q is p else ""))
        return "\n".join(lines)


def candidates(cuda: bool, nvme: bool, prefetch: tuple[int, ...] = (1, 2, 4)
               ) -> list[dict[str, Any]]:
    """Every placement worth predicting."""
    tiers = (["gpu"] if cuda else []) + ["cpu"] + (["nvme"] if nvme else [])
    acts = [None] + (["cpu"] if cuda else []) + (["nvme"] if nvme else [])
    out = []
    for params, opt, grads, act, pf in itertools.product(tiers, tiers, tiers, acts, prefetch):
        if grads == "nvme" and params != "nvme":
            continue
        if grads == "gpu" and not cuda or grads == "cpu" and cuda:
            continue  # on the compute device or NVMe; pinned RAM with CUDA is not predicted
        out.append(dict(params=params, optimizer=opt, grads=grads, activations=act,
                        prefetch=pf))
    return out


def auto(model: nn.Module, *, sample: Sample, gpu_budget: int | str | None = None,
         cpu_budget: int | str | None = None, nvme_dir: str | tuple | list | None = None,
         bench: dict | str | None = None, device: str | None = None,
         activation_threshold: int | str = "1MiB", machine: Machine | None = None,
         profile: Profile | None = None, build: Callable[[], nn.Module] | None = None,
         trials: int = 3, policy_cls: type[BasePolicy] = BasePolicy) -> BasePolicy:
    """The placement with the least predicted step time whose predicted peak memory fits the
    budgets (bytes for everything the step holds: parameters, gradients, optimizer state,
    activations; default: 90% of the device's memory). Refuses, with the numbers, when none
    fits. ``machine`` and ``profile`` skip measuring them again (``bench`` is then unused).

    With ``build`` (a function that returns a fresh copy of the model), the ``trials``
    placements predicted fastest are also measured (one step after a warm-up each), and the
    fastest measured whose measured peak fits the budget wins: the cost model ranks, a short
    measurement settles what it cannot see (contention on this machine)."""
    dev = torch.device(device) if device else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"
    if machine is None:
        machine = Machine.measure(nvme_dir, bench)
    threshold = parse_bytes(activation_threshold)
    if profile is None:
        profile = Profile.measure(model, sample, threshold)
    budgets = {"cpu": parse_bytes(cpu_budget) if cpu_budget is not None
               else int(0.9 * (machine.ram - memory.rss())),
               "gpu": (parse_bytes(gpu_budget) if gpu_budget is not None
                       else int(0.9 * machine.gpu)) if cuda else None}
    nvme_dir_ok = nvme_dir is not None
    ranked: dict[tuple, tuple[float, int, BasePolicy, Prediction]] = {}  # best of each placement
    tried = fit = 0
    least: tuple[int, BasePolicy, Prediction] | None = None
    for c in candidates(cuda, nvme_dir_ok):
        for pb in _param_budgets(c, profile, budgets, cuda):
            kw = dict(c, device=str(dev), nvme_dir=nvme_dir, io=machine.io,
                      activation_threshold=threshold,
                      **({"gpu_budget": pb} if cuda else {"cpu_budget": pb}))
            try:
                pol = policy_cls(**kw)
            except ValueError:
                continue
            tried += 1
            pr = predict(pol, profile, machine)
            over = max(pr.peak[t] - (budgets[t] or 0) for t in budgets if budgets[t] is not None)
            if least is None or over < least[0]:
                least = (over, pol, pr)
            if over > 0:
                continue
            fit += 1
            key = (pr.step_s, sum(pr.peak.values()))
            where = (pol.params, pol.optimizer, pol.grads, pol.activations)
            if where not in ranked or key < ranked[where][:2]:
                ranked[where] = (*key, pol, pr)
    if not ranked:
        over, pol, pr = least
        raise MemoryError(
            "no placement fits: the smallest needs "
            + ", ".join(f"{t} {pr.peak[t]} bytes ({format_bytes(pr.peak[t])})"
                        for t in budgets if budgets[t] is not None)
            + " against budgets "
            + ", ".join(f"{t} {budgets[t]} bytes ({format_bytes(budgets[t])})"
                        for t in budgets if budgets[t] is not None)
            + (" (no nvme_dir was given)" if not nvme_dir_ok else ""))
    order = sorted(ranked.values(), key=lambda t: t[:2])
    _, _, pol, pr = order[0]
    measured: list[tuple[BasePolicy, Measured]] = []
    if build is not None and trials > 0:
        cap = budgets["gpu"] if cuda else budgets["cpu"]
        fits: list[tuple[float, int]] = []
        for _, _, cand, _ in order[:2 * trials]:  # more only while none measured fits
            if len(measured) >= trials and fits:
                break
            m = measure(build, sample, cand, steps=1)
            if m.peak <= cap:
                fits.append((m.step_s, len(measured)))
            measured.append((cand, m))
        if fits:
            pol = measured[min(fits)[1]][0]
            pr = next(t[3] for t in order if t[2] is pol)
    naive = None
    if nvme_dir_ok:
        naive_pol = dataclasses.replace(pol, params="nvme", optimizer="nvme", grads="nvme",
                                        activations="nvme")
        naive = predict(naive_pol, profile, machine)
    in_backward = predict(pol, profile, machine, "backward") if pol.pages_params else None
    object.__setattr__(pol, "plan", Plan(pol, pr, budgets, profile, machine, tried, fit, naive,
                                         tuple(measured), in_backward))
    return pol


def _param_budgets(c: dict[str, Any], profile: Profile, budgets: dict[str, int | None],
                   cuda: bool) -> list[int | None]:
    """Resident-parameter budgets to try for a placement: none when nothing is paged, else a
    few multiples of the largest unit up to all the parameters."""
    if not (c["params"] == "nvme" or (cuda and c["params"] == "cpu")):
        return [None]
    u, P = profile.largest_unit, profile.param_bytes
    steps = {min(P, k * u) for k in (2, 4, 8, 16, 64)} | {P}
    return sorted(s for s in steps if s >= 2 * u or s == P)


# -- measuring a policy --------------------------------------------------------------------------

@dataclass(frozen=True)
class Measured:
    """What ``measure`` saw over a few real steps of a policy."""

    step_s: float
    peak: int             # peak RSS (CPU) or allocated (GPU) above the start, bytes
    bytes_read: int
    bytes_written: int
    losses: list[float]


def measure(build: Callable[[], nn.Module], sample: Sample, policy: BasePolicy, steps: int = 3,
            lr: float = 1e-4, overlap: bool | str = True) -> Measured:
    """Builds a model, offloads it under ``policy``, and times ``steps`` AdamW training steps
    (the paged optimizer, with ``overlap``) after two warm-ups (the first makes the optimizer
    state; the paged optimizer applies it in the second's forward); peak memory is measured
    above the process before the model was built."""

    memory.return_freed_memory()
    device = policy.compute_device()
    cuda = device.type == "cuda"
    base = memory.start_peak(device)
    if base is None:
        raise RuntimeError("measuring peak memory needs /proc/self/clear_refs")
    model = offload(build(), policy)
    opt = optimizer(model, torch.optim.AdamW, lr=lr, overlap=overlap)
    times, losses = [], []
    try:
        for i in range(steps + 2):
            if i == 2:
                st0 = stats(model)
            t0 = time.perf_counter()
            loss = sample(model)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        st = stats(model)
        peak = memory.peak(device) - base
    finally:
        close(model, restore=False)
    moved = [sum(st[k].values()) - sum(st0[k].values()) for k in ("bytes_read", "bytes_written")]
    act = st.get("activations")
    if act is not None:
        moved[0] += act["bytes_read"] - st0["activations"]["bytes_read"]
        moved[1] += act["bytes_written"] - st0["activations"]["bytes_written"]
    return Measured(statistics.median(times), peak, moved[0] // steps, moved[1] // steps, losses)

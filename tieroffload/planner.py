"""``Policy.auto``: a cost model of a training step fed by measured figures, and the search over
placements that it makes cheap.

The figures: the disk's read and write GB/s (from ``tieroffload-bench nvme --json`` or
``bench.disk_gbps``), what NVMe traffic costs the compute (``io_cost``), host-to-device GB/s
where a GPU is present, and the model's own compute (forward and backward per module, the
optimizer's update rate, the bytes saved for backward, the step's peak) measured on a sample
step.

The model: a step is three phases (forward, backward, optimizer step). In each, transfers are
prefetched, so a phase takes the longer of its compute (plus the CPU time its transfers cost) and
its I/O (bytes read / read GB/s + bytes written / write GB/s: one device does both), plus the
first transfer, which nothing hides. Peak memory is the sum of what each placement keeps
resident, plus the sample step's own working memory.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from . import aio, memory
from .bench import disk_gbps
from .policy import IOConfig, Policy
from .sizes import format_bytes, parse_bytes

STAGING = 4 * (16 << 20)  # the mover's staging buffers (offload.CHUNK * offload.NBUF)
MACHINERY = 16 << 20      # engine, rings, worker threads and their bookkeeping
SLACK = 8 << 20           # allocator and interpreter
OPT_CHUNK = 16 << 20      # the paged optimizer's chunk of parameters (optimizer.CHUNK_BYTES)
ADAM_STATE = 8            # bytes of Adam state per fp32 parameter (two moments)


# -- the machine ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Machine:
    """Measured figures of this machine. GB/s are 1e9 bytes per second."""

    read_gbps: float
    write_gbps: float
    io_cost: float            # seconds of compute lost per byte moved (see ``io_cost``)
    io: IOConfig = field(default_factory=IOConfig)
    h2d_gbps: float | None = None
    ram: int = 0
    gpu: int | None = None

    @classmethod
    def measure(cls, nvme_dir: str | os.PathLike | None = None,
                bench: dict | str | os.PathLike | None = None, size: int = 256 << 20) -> Machine:
        """Reads disk figures from a bench result (its dict or JSON file) or measures them in
        ``nvme_dir`` (``size`` bytes, O_DIRECT, cold reads where allowed); measures the rest.
        Several directories are measured striped, as the swap space stripes them (on one
        device they share its bandwidth); the ranks of one node (``LOCAL_WORLD_SIZE``) share
        the drives, so each rank counts its share."""
        dirs = [] if nvme_dir is None else [os.fspath(d) for d in nvme_dir] \
            if isinstance(nvme_dir, (list, tuple)) else [os.fspath(nvme_dir)]
        nvme_dir = dirs[0] if dirs else None
        cost = 0.0
        if bench is not None:
            if not isinstance(bench, dict):
                with open(bench) as f:
                    bench = json.load(f)
            fig = bench["recommended_figures"]
            read, write = fig["read_gbps"], fig["write_gbps"]
            io = IOConfig.from_dict(bench["recommended"])
            if nvme_dir is not None:
                cost = io_cost(nvme_dir, io)
        elif nvme_dir is not None:
            io = IOConfig()
            read, write = disk_gbps(dirs, size, io)
            cost = io_cost(nvme_dir, io)
        else:  # no NVMe tier: its figures are never used
            io, read, write = IOConfig(), math.nan, math.nan
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        read, write = read / ranks, write / ranks
        gpu = h2d = None
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_properties(0).total_memory
            h2d = _h2d_gbps()
        return cls(read, write, cost, io, h2d, memory.ram_limit(), gpu)


def io_cost(directory: str, io: IOConfig | None = None, chunk: int = 16 << 20,
            span: int = 256 << 20) -> float:
    """Seconds of compute lost per byte that NVMe traffic moves while compute runs: a matmul
    loop is timed alone and then against a stream of writes and reads of fresh page-aligned
    buffers, the way offload's traffic looks (staging copies, page faults, the I/O itself)."""
    path = os.path.join(directory, f"tieroffload-probe-{os.getpid()}.bin")
    src = torch.ones(chunk, dtype=torch.uint8)
    a = torch.randn(768, 768)

    def compute(k: int) -> float:
        t0 = time.perf_counter()
        for _ in range(k):
            a @ a
        return time.perf_counter() - t0

    k = 8
    while compute(k) < 0.5:
        k *= 2
    alone = min(compute(k) for _ in range(2))
    moved = [0]
    stop = threading.Event()
    try:
        with (io or IOConfig()).engine() as eng, aio.open(path, "w+", engine=eng) as f:
            f.allocate(span)

            def traffic() -> None:
                off = 0
                while not stop.is_set():
                    b = aio.aligned_empty(chunk, pin=False)
                    b.copy_(src)
                    f.pwrite(b, off).result()
                    b = aio.aligned_empty(chunk, pin=False)
                    f.pread(b, (off + span // 2) % span).result()
                    moved[0] += 2 * chunk
                    off = (off + chunk) % span

            th = threading.Thread(target=traffic, daemon=True)
            th.start()
            time.sleep(0.05)
            m0 = moved[0]
            both = compute(k)
            m1 = moved[0]
            stop.set()
            th.join()
    finally:
        if os.path.exists(path):
            os.remove(path)
    return max(both - alone, 0.0) / max(m1 - m0, 1)


def _h2d_gbps(nbytes: int = 256 << 20) -> float:
    src = aio.aligned_empty(nbytes, pin=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * nbytes / (time.perf_counter() - t0) / 1e9


# -- the model -----------------------------------------------------------------------------------

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
        with the model as it is (resident), timing the last ``repeats`` (medians)."""
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
        act = sum(n for ptr, n in saved.items() if ptr not in pids)
        grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        if not step_peak:  # no peak to read here: everything at once, as a bound
            step_peak = act + grads
        opt_s = _adam_seconds(sum(p.numel() for p in params))
        per_module = {n: statistics.median(v[1:]) for n, v in times.items() if len(v) > 1}
        return cls(sum(p.numel() for p in params), pbytes, max(owned, default=0), len(owned),
                   statistics.median(fwd),
                   statistics.median(bwd), opt_s, act, len(saved), step_peak, per_module)


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


@dataclass(frozen=True)
class Prediction:
    step_s: float
    phases: dict[str, float]          # forward, backward, step
    compute_s: float
    io_s: float
    bytes_read: int
    bytes_written: int
    peak: dict[str, int]              # tier -> bytes above the process's start
    bottleneck: str


def predict(policy: Policy, profile: Profile, machine: Machine,
            overlap: bool | str = True) -> Prediction:
    """Step time and peak memory of one training step (forward, backward, paged AdamW step)
    under ``policy``, with the paged optimizer's ``overlap`` (``"backward"``: each chunk steps
    during backward, where parameters are paged)."""
    cuda = policy.compute_device().type == "cuda"
    P, n = profile.param_bytes, profile.params
    G = P
    S = ADAM_STATE * n
    A = profile.activation_bytes
    R, W = machine.read_gbps * 1e9, machine.write_gbps * 1e9
    budget = _param_budget(policy, profile)
    spill = policy.params == "nvme" and P > budget
    in_backward = overlap == "backward" and policy.pages_params

    # Bytes per phase: (read, written) on NVMe.
    fwd = [0, 0]
    bwd = [0, 0]
    step = [0, 0]
    if spill:
        keep = min(P, max(0, budget - profile.largest_unit))
        fwd[0] += P                    # the step before wrote them all back
        bwd[0] += P - keep             # the last ones of forward are still resident
        # The paged optimizer defers each chunk's update to the next forward, which reads the
        # parameters anyway: they are not read again for the step. The update still runs one
        # chunk at a time in forward's hooks, barely overlapped: its time stays a phase.
        step[1] += P                   # updated parameters go home
    if policy.activations == "nvme":
        fwd[1] += A
        bwd[0] += A
    if policy.grads == "nvme" and not in_backward:  # in backward, they wait for their step
        bwd[1] += G
        step[0] += G
    if policy.optimizer == "nvme":
        step[0] += S
        step[1] += S
    phases = {}
    depth = _prefetch_units(policy, profile)
    unit = P / max(profile.units, 1)
    work = [("forward", profile.forward_s, fwd), ("backward", profile.backward_s, bwd),
            ("step", profile.optimizer_s, step)]
    if in_backward:  # each chunk steps in backward's hooks: the step's work joins backward's
        work[1:] = [("backward", profile.backward_s + profile.optimizer_s,
                     [bwd[0] + step[0], bwd[1] + step[1]]), ("step", 0.0, [0, 0])]
    for name, compute, (r, w) in work:
        io = r / R + w / W
        cpu = 0.0 if cuda else (r + w) * machine.io_cost
        first = profile.largest_unit / R if name != "backward" and (r or w) else 0.0
        stall = 0.0
        if spill and name != "step":
            # A unit's read must hide behind the compute of the ``depth`` units before it.
            per_unit = compute / max(profile.units, 1)
            stall = profile.units * max(0.0, unit / R - depth * per_unit)
        phases[name] = max(compute + cpu, io) + first + stall
    compute_s = profile.forward_s + profile.backward_s + profile.optimizer_s
    read = fwd[0] + bwd[0] + step[0]
    written = fwd[1] + bwd[1] + step[1]
    io_s = read / R + written / W
    peak = _peak(policy, profile, budget)
    return Prediction(sum(phases.values()), phases, compute_s, io_s, read, written, peak,
                      "NVMe" if io_s > compute_s else "compute")


def _prefetch_units(policy: Policy, profile: Profile) -> float:
    units, nbytes = policy.prefetch_window()
    if nbytes is not None:
        return nbytes / max(profile.param_bytes / max(profile.units, 1), 1)
    return units


def _param_budget(policy: Policy, profile: Profile) -> int:
    cuda = policy.compute_device().type == "cuda"
    b = policy.gpu_budget if cuda else policy.cpu_budget
    if b is None:
        units, nbytes = policy.prefetch_window()
        b = (nbytes if nbytes is not None else units * profile.largest_unit) \
            + 2 * profile.largest_unit
    return b


def _peak(policy: Policy, profile: Profile, budget: int) -> dict[str, int]:
    """Bytes each tier holds at the step's peak, above the process before the model."""
    cuda = policy.compute_device().type == "cuda"
    P, n = profile.param_bytes, profile.params
    A = profile.activation_bytes
    dev = "gpu" if cuda else "cpu"
    peak = {"gpu": 0, "cpu": 0}
    if policy.pages_params:
        peak[dev] += min(P, budget)
        if policy.params == "cpu":
            peak["cpu"] += P
    else:
        peak[dev] += P
    # Staging buffers: on CUDA units move through NBUF chunks of them (on the CPU parameters,
    # gradients and optimizer state are page-aligned buffers that O_DIRECT fills directly).
    # Pages of a staging buffer count once touched: a unit smaller than the buffers touches
    # only its own size.
    chunk = min(OPT_CHUNK, budget // 4) if policy.params == "nvme" else OPT_CHUNK
    if cuda and policy.params in ("cpu", "nvme"):
        peak["cpu"] += min(STAGING, profile.largest_unit)
    # Gradients: all of them, or the units waiting for the pager.
    grads = P if policy.grads != "nvme" else 3 * profile.largest_unit
    opt_tier = "gpu" if policy.optimizer == "gpu" else "cpu"
    # Paged: the chunk being updated and the one in flight, next to the gradients. After
    # backward (the step at once) that is a peak of its own; deferred into the next forward
    # (paged parameters), it adds to that forward's.
    paged = min(ADAM_STATE * n, 2 * ADAM_STATE // 4 * chunk) if policy.optimizer == "nvme" \
        else 0
    peak[opt_tier] += ADAM_STATE * n if policy.optimizer != "nvme" else 0
    # Forward and backward: what the sample step measured (activations and gradients, which
    # backward trades one for the other), less what is paged.
    if policy.activations is None or (policy.activations == "cpu" and not cuda):
        work = profile.step_peak if policy.grads != "nvme" else \
            min(profile.step_peak, A + grads)
    else:
        avg = A // max(profile.activation_records, 1)
        units, nbytes = policy.prefetch_window()
        window = nbytes if nbytes is not None else units * avg
        work = min(profile.step_peak, grads + min(A, 2 * window + 2 * avg))
        if policy.activations == "cpu":
            peak["cpu"] += A
    peak[dev] += (work + paged if policy.pages_params else max(work, grads + paged)) + SLACK
    if "nvme" in (policy.params, policy.optimizer, policy.grads, policy.activations):
        peak["cpu"] += MACHINERY
    return peak


# -- the search ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """What ``Policy.auto`` chose and why."""

    policy: Policy
    prediction: Prediction
    budgets: dict[str, int | None]
    profile: Profile
    machine: Machine
    candidates: int
    fitting: int
    naive: Prediction | None = None
    trials: tuple[tuple[Policy, Measured], ...] = ()  # the placements measured, if any
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
               f"{format_bytes(_param_budget(p, prof))}"
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
            continue  # gradients are made on the compute device, or paged to NVMe
        out.append(dict(params=params, optimizer=opt, grads=grads, activations=act,
                        prefetch=pf))
    return out


def auto(model: nn.Module, *, sample: Sample, gpu_budget: int | str | None = None,
         cpu_budget: int | str | None = None, nvme_dir: str | tuple | list | None = None,
         bench: dict | str | None = None, device: str | None = None,
         activation_threshold: int | str = "1MiB", machine: Machine | None = None,
         profile: Profile | None = None, build: Callable[[], nn.Module] | None = None,
         trials: int = 3) -> Policy:
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
    ranked: dict[tuple, tuple[float, int, Policy, Prediction]] = {}  # best of each placement
    tried = fit = 0
    least: tuple[int, Policy, Prediction] | None = None
    for c in candidates(cuda, nvme_dir_ok):
        for param_budget in _param_budgets(c, profile, budgets, cuda):
            kw = dict(c, device=str(dev), nvme_dir=nvme_dir, io=machine.io,
                      activation_threshold=threshold,
                      **({"gpu_budget": param_budget} if cuda else {"cpu_budget": param_budget}))
            try:
                pol = Policy(**kw)
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
    measured: list[tuple[Policy, Measured]] = []
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
    step_s: float
    peak: int             # peak RSS (CPU) or allocated (GPU) above the start, bytes
    bytes_read: int
    bytes_written: int
    losses: list[float]


def measure(build: Callable[[], nn.Module], sample: Sample, policy: Policy, steps: int = 3,
            lr: float = 1e-4, overlap: bool | str = True) -> Measured:
    """Builds a model, offloads it under ``policy``, and times ``steps`` AdamW training steps
    (the paged optimizer, with ``overlap``) after two warm-ups (the first makes the optimizer
    state; the paged optimizer applies it in the second's forward); peak memory is measured
    above the process before the model was built."""
    from .offload import close, offload, stats
    from .optimizer import optimizer

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

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

from dataclasses import dataclass

from ..hooks.policy import BasePolicy
from .constants import ADAM_STATE, MACHINERY, OPT_CHUNK, SLACK, STAGING
from .machine import Machine
from .profile import Profile


@dataclass(frozen=True)
class Prediction:
    """The cost model's figures for one step of a placement: time per phase, compute and
    I/O time, bytes moved, peak bytes per tier and what bounds the step."""

    step_s: float
    phases: dict[str, float]          # forward, backward, step
    compute_s: float
    io_s: float
    bytes_read: int
    bytes_written: int
    peak: dict[str, int]              # tier -> bytes above the process's start
    bottleneck: str


def predict(policy: BasePolicy, profile: Profile, machine: Machine,
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
    budget = param_budget(policy, profile)
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


def _prefetch_units(policy: BasePolicy, profile: Profile) -> float:
    units, nbytes = policy.prefetch_window()
    if nbytes is not None:
        return nbytes / max(profile.param_bytes / max(profile.units, 1), 1)
    return units


def param_budget(policy: BasePolicy, profile: Profile) -> int:
    cuda = policy.compute_device().type == "cuda"
    b = policy.gpu_budget if cuda else policy.cpu_budget
    if b is None:
        units, nbytes = policy.prefetch_window()
        b = (nbytes if nbytes is not None else units * profile.largest_unit) \
            + 2 * profile.largest_unit
    return b


def _peak(policy: BasePolicy, profile: Profile, budget: int) -> dict[str, int]:
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
    # Paged: the chunk being updated, its store and the reads ahead, within three of the
    # largest chunk's state (a chunk holds one unit at least), next to the gradients. After
    # backward (the step at once) that is a peak of its own; deferred into the next forward
    # (paged parameters) or stepped in backward, it adds to that pass's.
    largest = max(chunk, profile.largest_unit)
    paged = min(ADAM_STATE * n, 3 * ADAM_STATE // 4 * largest) \
        if policy.optimizer == "nvme" else 0
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
        # What the resident step held besides its P bytes of gradients and the saved tensors
        # now paged: those under the threshold, which stay, and forward's temporaries.
        other = max(profile.step_peak - A - P, 0)
        work = min(profile.step_peak, grads + min(A, 2 * window + 2 * avg) + other)
        if policy.activations == "cpu":
            peak["cpu"] += A
    peak[dev] += (work + paged if policy.pages_params else max(work, grads + paged)) + SLACK
    if "nvme" in (policy.params, policy.optimizer, policy.grads, policy.activations):
        peak["cpu"] += MACHINERY
    return peak

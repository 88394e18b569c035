"""``tieroffload.initialize``: ``deepspeed.initialize`` for one process, over an offloaded model.

The engine is called like the model; ``backward(loss)`` divides the loss by the accumulation
steps (and multiplies it by the fp16 loss scale); ``step()`` after every micro-batch acts only
at accumulation boundaries: clipping, the optimizer's step (skipped on an fp16 overflow), the
schedule, ``zero_grad``, the monitor's record and the progress line. Checkpoints go through
``tieroffload.save_checkpoint`` as ``save_dir/tag`` with DeepSpeed's ``latest`` file.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import time
from typing import Any

import torch
from torch import nn

from ..checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ..hooks import close, offload
from ..hooks.build import BudgetTooSmall
from ..integrations.deepspeed import load_config
from ..monitor import Monitor
from ..optim import optimizer as paged_optimizer
from ..policy import Policy
from ..utils.dist import world_size
from .config import Plan, read_config
from .scaler import DeepSpeedLossScale
from .schedules import Schedule, make_schedule

log = logging.getLogger("tieroffload")


class Engine(nn.Module):
    """What ``tieroffload.initialize`` returns first: DeepSpeed's engine for one process. See
    the module docstring; ``module`` is the offloaded model, ``optimizer`` the paged optimizer,
    ``lr_scheduler`` the schedule, ``global_steps`` the optimizer steps taken (skipped ones
    included, as DeepSpeed counts)."""

    def __init__(self, module: nn.Module, plan: Plan, opt: torch.optim.Optimizer | None,
                 schedule: Schedule | None, monitor: Monitor | None) -> None:
        super().__init__()
        self.module = module
        self.plan = plan
        self.optimizer = opt
        self.lr_scheduler = schedule
        self.monitor = monitor
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._global_grad_norm: float | None = None
        self._losses: list[torch.Tensor] = []
        self._times = {"forward": 0.0, "backward": 0.0, "step": 0.0}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = self.module(*args, **kwargs)
        self._times["forward"] += time.perf_counter() - t0
        return out

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss`` divided by the accumulation steps (as DeepSpeed's
        ``scale_wrt_gas``), through the fp16 loss scale where there is one."""
        t0 = time.perf_counter()
        self._losses.append(loss.detach())
        if scale_wrt_gas and self.plan.accumulation > 1:
            loss = loss / self.plan.accumulation
        if self.optimizer is not None:
            loss = self.optimizer.scale_loss(loss)
        loss.backward(retain_graph=retain_graph)
        self._times["backward"] += time.perf_counter() - t0
        return loss

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the coming ``step()`` ends an accumulation (steps the optimizer)."""
        return (self.micro_steps + 1) % self.plan.accumulation == 0

    def step(self) -> None:
        """Counts a micro-batch; at an accumulation boundary, clips, steps the optimizer and the
        schedule, zeroes the gradients and reports."""
        if self.optimizer is None:
            raise RuntimeError("tieroffload.initialize: step() needs an optimizer: add an "
                               "optimizer section to the config")
        t0 = time.perf_counter()
        if self.is_gradient_accumulation_boundary():
            opt = self.optimizer
            if self.plan.clipping > 0:
                self._global_grad_norm = float(opt.clip_grad_norm_(self.plan.clipping, fp32=True))
            skipped = opt.skipped_steps
            opt.step()
            opt.zero_grad()
            if opt.skipped_steps > skipped:  # an fp16 overflow: the schedule waits too
                self.skipped_steps += 1
            elif self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.global_steps += 1
            self.global_samples += self.plan.batch
            self._times["step"] += time.perf_counter() - t0
            self._report()
        else:
            self._times["step"] += time.perf_counter() - t0
        self.micro_steps += 1

    def _report(self) -> None:
        losses, self._losses = self._losses, []
        loss = torch.stack([x.float() for x in losses]).mean() if losses else None
        if self.monitor is not None:
            self.monitor.step(loss=loss, lr=self.get_lr()[0], grad_norm=self._global_grad_norm)
        every = self.plan.steps_per_print
        if every and self.global_steps % every == 0:
            line = f"step={self.global_steps}, skipped={self.skipped_steps}, lr={self.get_lr()}"
            if loss is not None:
                line += f", loss={float(loss):.4f}"
            if self.plan.wall_clock:
                line += ", time (ms) | " + " | ".join(f"{k}: {v * 1e3:.1f}"
                                                      for k, v in self._times.items())
            log.info("%s", line)
        if not every or self.global_steps % every == 0:
            self._times = dict.fromkeys(self._times, 0.0)

    def get_lr(self) -> list[float]:
        return [] if self.optimizer is None else [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The gradients' total norm at the last step (with ``gradient_clipping`` set)."""
        return self._global_grad_norm

    def train_batch_size(self) -> int:
        return self.plan.batch

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.plan.micro_batch

    def gradient_accumulation_steps(self) -> int:
        return self.plan.accumulation

    def save_checkpoint(self, save_dir: str | os.PathLike, tag: Any = None,
                        client_state: dict[str, Any] | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """The model, the optimizer, the schedule, the counters and ``client_state`` in
        ``save_dir/tag`` (default tag ``global_step<n>``), and ``save_dir/latest`` naming it.
        Refused, before anything is written, between the micro-batches of an accumulation (the
        partial gradients are not saved), for a tag that is not a plain folder name, or where
        ``save_dir`` or its ``latest`` is not what they should be."""
        if exclude_frozen_parameters:
            raise ValueError("engine.save_checkpoint: exclude_frozen_parameters=True is not "
                             "supported: tieroffload saves every parameter")
        acc = self.plan.accumulation
        if self.micro_steps % acc or self._losses:
            raise RuntimeError(
                f"engine.save_checkpoint at micro-step {self.micro_steps}, inside an "
                f"accumulation of {acc} micro-batches (backward done, step() not yet at the "
                "boundary): its partial gradients are not saved, so a resumed run would step "
                "on part of the gradient; save after the step() that ends an accumulation "
                "(where engine.is_gradient_accumulation_boundary() was true)")
        tag = _plain_tag(f"global_step{self.global_steps}" if tag is None else str(tag),
                         "engine.save_checkpoint", "nothing was written")
        save_dir = os.fspath(save_dir)
        if not save_dir:
            raise CheckpointError("engine.save_checkpoint needs a save_dir (a directory), not ''")
        if os.path.lexists(save_dir) and not os.path.isdir(save_dir):
            raise CheckpointError(f"engine.save_checkpoint: save_dir {save_dir} is a file, not a "
                                  "directory: nothing was written; save elsewhere")
        latest = os.path.join(save_dir, "latest")
        for name in (latest, latest + ".tmp") if save_latest else ():
            if os.path.lexists(name) and _named_tag(save_dir, name) is None:
                raise CheckpointError(f"engine.save_checkpoint: {name} is not a regular file "
                                      "naming a checkpoint folder beside it (the 'latest' a "
                                      "save writes): nothing was written; move it or save "
                                      "elsewhere")
        os.makedirs(save_dir, exist_ok=True)
        extra = {"client_state": dict(client_state or {}),
                 "schedule": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
                 "counters": {k: getattr(self, k) for k in (
                     "global_steps", "global_samples", "micro_steps", "skipped_steps")}}
        save_checkpoint(os.path.join(save_dir, tag), self.module, self.optimizer, extra=extra)
        if save_latest:
            with open(latest + ".tmp", "w") as f:
                f.write(tag)
            os.replace(latest + ".tmp", latest)
        return True

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: Any = None,
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn: Any = None
                        ) -> tuple[str | None, dict[str, Any] | None]:
        """Restores what ``save_checkpoint`` saved (the tag named in ``load_dir/latest`` by
        default); returns ``(path, client_state)``, or ``(None, None)`` with a warning where
        there is no ``latest`` file. As DeepSpeed: ``load_optimizer_states=False`` keeps the
        optimizer's state, ``load_lr_scheduler_states=False`` the schedule's, and
        ``load_module_only=True`` both and the step counters."""
        if not load_module_strict or custom_load_fn is not None:
            raise ValueError("engine.load_checkpoint: load_module_strict=False and "
                             "custom_load_fn are not supported: tieroffload loads every "
                             "parameter, checked against the model")
        if tag is None:
            latest = os.path.join(load_dir, "latest")
            if not os.path.isfile(latest):
                log.warning("tieroffload.initialize: no checkpoint to load: %s has no 'latest' "
                            "file (pass tag=...)", os.fspath(load_dir))
                return None, None
            with open(latest) as f:
                tag = f.read(256).strip()
        tag = _plain_tag(str(tag), "engine.load_checkpoint", "nothing was loaded")
        path = os.path.join(load_dir, tag)
        opt = None if load_module_only or not load_optimizer_states else self.optimizer
        extra = load_checkpoint(path, self.module, opt)
        # gradients of micro-batches before the load (saves are at boundaries) are not its
        (self.module if self.optimizer is None else self.optimizer).zero_grad()
        if not load_module_only:
            for k, v in extra["counters"].items():
                setattr(self, k, v)
            if (load_lr_scheduler_states and self.lr_scheduler is not None
                    and extra["schedule"] is not None):
                self.lr_scheduler.load_state_dict(extra["schedule"])
        self._losses = []
        return path, extra["client_state"]


def _plain_tag(tag: str, who: str, then: str) -> str:
    """``tag``, a plain folder name inside the save folder, or a ``CheckpointError`` naming it:
    no separator or '..', not empty, not hidden, not 'latest', at most 255 bytes."""
    if (not tag or tag.startswith(".") or "/" in tag or "\\" in tag or ".." in tag
            or "\0" in tag or len(os.fsencode(tag)) > 255 or tag in ("latest", "latest.tmp")):
        raise CheckpointError(f"{who}: tag {tag!r:.80} is not a plain folder name inside the "
                              "save folder (no '/', '\\' or '..', not empty, not starting with "
                              f"'.', not 'latest'): {then}")
    return tag


def _named_tag(save_dir: str, name: str) -> str | None:
    """The tag a 'latest' file ``name`` written by a save holds (a regular file naming a
    checkpoint folder in ``save_dir``), or None where it is anything else: the user's."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        tag = os.read(fd, 256).decode(errors="replace").strip()
    finally:
        os.close(fd)
    try:
        _plain_tag(tag, "", "")
    except CheckpointError:
        return None
    return tag if os.path.isfile(os.path.join(save_dir, tag, "manifest.json")) else None


def _policy(plan: Plan) -> Policy:
    fields = dict(plan.policy)
    device = Policy(**{k: v for k, v in fields.items() if k == "device"}).compute_device()
    # stage 0-2 (or stage 3 with offload_param none) keep the parameters where compute runs
    fields.setdefault("params", "gpu" if device.type == "cuda" else "cpu")
    return Policy.from_dict(fields)


def _config_of(args: Any, config: Any, config_params: Any) -> Any:
    """The config as ``deepspeed.initialize`` finds it: ``config``, its older name
    ``config_params``, or the path in ``args.deepspeed_config`` (``args.deepscale_config``)."""
    if config is not None and config_params is not None:
        raise ValueError("tieroffload.initialize: config and config_params (its older name) "
                         "are both given: pass one")
    config = config if config is not None else config_params
    from_args = next((getattr(args, k) for k in ("deepspeed_config", "deepscale_config")
                      if getattr(args, k, None) is not None), None)
    if config is not None and from_args is not None:
        raise ValueError(f"tieroffload.initialize: a config is given both as config= and in "
                         f"args.deepspeed_config ({from_args!r}): pass one")
    config = config if config is not None else from_args
    if config is None:
        raise ValueError("tieroffload.initialize needs a DeepSpeed config: config= (a dict or "
                         "its JSON file), or args.deepspeed_config")
    return config


def _refuse_clients(optimizer: Any, lr_scheduler: Any, mpu: Any, mesh_param: Any) -> None:
    if optimizer is not None:
        raise ValueError("tieroffload.initialize: a client optimizer= is not supported: put it "
                         "in the config's optimizer section ({\"type\": \"AdamW\", \"params\": "
                         "{...}}), or build tieroffload.optimizer(model, YourClass) yourself")
    if lr_scheduler is not None:
        raise ValueError("tieroffload.initialize: a client lr_scheduler= is not supported: put "
                         "it in the config's scheduler section, or step your own torch "
                         "scheduler over the returned optimizer")
    if mpu is not None or mesh_param is not None:
        raise ValueError("tieroffload.initialize runs one process: mpu= and mesh_param= (model "
                         "parallelism) are not supported; use deepspeed.initialize")


def _touch(model: nn.Module, plan: Plan, policy: Policy, config: dict[str, Any],
           params: list | None) -> tuple[Any, Schedule | None, Monitor | None]:
    """Casts and offloads ``model`` and builds the optimizer, schedule and monitor over it."""
    if plan.dtype != torch.float32:
        model.to(plan.dtype)
    _offload(model, plan, policy)
    opt = None
    if plan.opt_cls is not None:
        scale: Any = None if plan.dtype != torch.float16 else (
            plan.loss_scale if isinstance(plan.loss_scale, float)
            else DeepSpeedLossScale(**plan.loss_scale))
        opt = paged_optimizer(model, plan.opt_cls, params, loss_scale=scale,
                              **plan.opt_kwargs)
    schedule = None if plan.schedule is None else make_schedule(opt, *plan.schedule)
    monitor = Monitor.from_deepspeed(config, model, opt) if plan.monitor else None
    return opt, schedule, monitor


def _offload(model: nn.Module, plan: Plan, policy: Policy) -> None:
    """Offloads ``model`` by ``policy``. A budget from ``stage3_max_live_parameters`` is a
    soft cap, as in DeepSpeed, which fetches a module larger than it anyway: where a module
    needs more, the budget is raised to the smallest the model runs under, with a warning."""
    soft = not any(p.is_meta for p in model.parameters())  # a refused offload made them real
    try:
        offload(model, policy)
    except BudgetTooSmall as e:
        if e.name not in plan.policy or not soft:
            raise
        log.warning("DeepSpeed zero_optimization.stage3_max_live_parameters gives %s=%d bytes, "
                    "below what a module needs at once (%s); DeepSpeed fetches such a module "
                    "anyway, so the budget is raised to %d bytes, the most any module needs",
                    e.name, getattr(policy, e.name), e, e.need)
        offload(model, dataclasses.replace(policy, **{e.name: e.need}))


def _undo(model: nn.Module, saved: list[tuple[dict[str, Any], str, Any, Any, Any]]) -> None:
    """Puts ``model`` back as it was before ``_touch``: closes its offload (if it got that
    far) and gives each parameter and buffer back its original tensor (original dtype, bits)
    and each parameter its original gradient."""
    if getattr(model, "_tieroffload", None) is not None:
        close(model)
    for table, name, t, data, (grad, grad_data) in saved:
        table[name] = t
        if isinstance(t, nn.Parameter):
            t.grad = None  # cast in place with the parameter (its .data), as the parameter
            t.data = data
            if grad is not None:
                grad.data = grad_data
                t.grad = grad


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: Any = None, dist_init_required: Any = None,
               collate_fn: Any = None, config: dict[str, Any] | str | os.PathLike | None = None,
               mesh_param: Any = None, config_params: Any = None, *, strict: bool = False
               ) -> tuple[Engine, Any, Any, Schedule | None]:
    """``deepspeed.initialize`` for one process, with its keywords: ``(engine, optimizer,
    dataloader, lr_scheduler)`` from a whole DeepSpeed config (``config``, ``config_params`` or
    ``args.deepspeed_config``: a dict or its JSON file). ``model`` is cast to the config's
    precision and offloaded by its ``zero_optimization`` section; the optimizer is a paged one
    over ``model_parameters`` (param groups; default all); the dataloader (with
    ``training_data``) yields micro-batches in DeepSpeed's order. The whole config is checked
    before the model is touched, and a failure after that puts the model back as it was. Keys
    nothing uses are logged as a warning; ``strict=True`` refuses them. See
    docs/integrations.md."""
    _refuse_clients(optimizer, lr_scheduler, mpu, mesh_param)
    config = load_config(_config_of(args, config, config_params))
    if world_size() > 1:
        raise ValueError(f"tieroffload.initialize runs one process, not {world_size()} ranks: "
                         "use deepspeed.initialize, or FSDP2 with tieroffload "
                         "(docs/distributed.md)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"tieroffload.initialize: model must be a torch.nn.Module, not "
                        f"{type(model).__name__}")
    plan, notes = read_config(config)
    if plan.unknown and strict:
        raise ValueError(f"DeepSpeed config key {plan.unknown[0]} is not used by "
                         "tieroffload.initialize (strict=True): remove it, or pass strict=False")
    if getattr(model, "_tieroffload", None) is not None:
        raise ValueError("tieroffload.initialize: the model is offloaded already; pass it "
                         "before tieroffload.offload (initialize offloads it by the config)")
    policy = _policy(plan)
    params = None if model_parameters is None else list(model_parameters)
    loader = None
    if training_data is not None:
        sampler = torch.utils.data.DistributedSampler(training_data, num_replicas=1, rank=0)
        loader = torch.utils.data.DataLoader(training_data, batch_size=plan.micro_batch,
                                             sampler=sampler, collate_fn=collate_fn,
                                             drop_last=plan.drop_last)
    if plan.unknown:
        log.warning("DeepSpeed settings tieroffload.initialize does not use: %s",
                    ", ".join(plan.unknown))
    if plan.decided:
        log.info("DeepSpeed settings tieroffload decides itself, not used: %s",
                 ", ".join(plan.decided))
    for note in notes:
        log.info("%s", note)
    # a cast is lossy: its original tensors (references, not copies) are kept, to put back if
    # anything below fails; close() alone restores an uncast model
    saved = [] if plan.dtype == torch.float32 else [
        (table, name, t, t.data, (t.grad, None if t.grad is None else t.grad.data))
        for m in model.modules()
        for table in (m._parameters, m._buffers) for name, t in table.items() if t is not None]
    try:
        opt, schedule, monitor = _touch(model, plan, policy, config, params)
    except BaseException:
        _undo(model, saved)
        raise
    return Engine(model, plan, opt, schedule, monitor), opt, loader, schedule

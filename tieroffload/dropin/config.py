"""A whole DeepSpeed config read into tieroffload's terms: the offload policy (through
``integrations.deepspeed``), precision and loss scaling, the optimizer, the schedule, batch
sizes, clipping, activation checkpointing, logging and the monitor. ``read_config`` returns a
``Plan`` that says what each key became, and the keys nothing uses."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..integrations.deepspeed import read_offload, settings
from ..optim.hyper import HyperCheck
from .schedules import check_schedule, make_schedule

MONITORS = ("tensorboard", "csv_monitor", "wandb")
MONITOR_KEYS = {"enabled", "output_path", "job_name", "project", "group", "team"}
FP16_KEYS = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "consecutive_hysteresis", "min_loss_scale"}
ACTIVATION_KEYS = {"partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                   "number_checkpoints", "synchronize_checkpoint_boundary", "profile"}
ADAM_KEYS = {"lr", "betas", "eps", "weight_decay", "amsgrad", "bias_correction",
             "adam_w_mode", "torch_adam"}
SGD_KEYS = {"lr", "momentum", "dampening", "weight_decay", "nesterov"}
TOP_KEYS = {"zero_optimization", "aio", "bf16", "fp16", "optimizer", "scheduler", "lr_scheduler",
            "gradient_accumulation_steps", "train_batch_size", "train_micro_batch_size_per_gpu",
            "gradient_clipping", "activation_checkpointing", "steps_per_print",
            "wall_clock_breakdown", "dataloader_drop_last", *MONITORS}


@dataclasses.dataclass
class Plan:
    """What a DeepSpeed config asks of ``tieroffload.initialize``. ``loss_scale``: None, a
    static scale, or the dynamic scale's settings. ``became``: each key that has an effect, and
    what it became; ``unknown`` / ``decided``: dotted names of keys nothing uses / keys
    tieroffload decides itself."""

    policy: dict[str, Any]
    stage: int
    dtype: torch.dtype
    loss_scale: float | dict[str, Any] | None
    opt_cls: type[torch.optim.Optimizer] | None
    opt_kwargs: dict[str, Any]
    schedule: tuple[str, dict[str, Any]] | None
    micro_batch: int
    accumulation: int
    batch: int
    clipping: float
    steps_per_print: int | None
    wall_clock: bool
    monitor: bool
    drop_last: bool
    became: dict[str, str]
    unknown: list[str]
    decided: list[str]




def _number(value: Any, key: str, low: float, whole: bool = False) -> Any:
    """``value`` checked: a JSON number (an int where ``whole``; never a bool) >= ``low``."""
    ok = (not isinstance(value, bool) and isinstance(value, int if whole else (int, float))
          and value >= low)
    if not ok:
        kind = "a whole number" if whole else "a number"
        raise ValueError(f"DeepSpeed {key} must be {kind} >= {low:g}, not {value!r}")
    return int(value) if whole else float(value)


def _flag(section: dict[str, Any], name: str, key: str, default: bool = False) -> bool:
    """``section[name]`` as a JSON bool (true / false; absent or null: ``default``): the string
    "false" is refused, not read as true."""
    value = section.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"DeepSpeed {key} must be true or false (a JSON bool), not {value!r}")
    return value


def _opt_params(params: dict[str, Any]) -> None:
    """The optimizer's params checked as torch's constructor checks them, each error naming its
    key: numbers are numbers (not strings or bools), in torch's ranges."""
    for k, v in params.items():
        key = f"optimizer.params.{k}"
        if k in ("lr", "eps", "weight_decay", "momentum", "dampening"):
            _number(v, key, 0)
        elif k == "betas":
            if not (isinstance(v, (list, tuple)) and len(v) == 2 and all(
                    not isinstance(b, bool) and isinstance(b, (int, float)) and 0 <= b < 1
                    for b in v)):
                raise ValueError(f"DeepSpeed {key} must be two numbers in [0, 1), such as "
                                 f"[0.9, 0.999], not {v!r}")
        else:
            _flag(params, k, key)


def _batch_sizes(config: dict[str, Any], world: int) -> tuple[int, int, int]:
    """(micro, accumulation, total), any two giving the third, checked as DeepSpeed checks."""
    names = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
    micro, acc, total = (None if config.get(k) is None else _number(config[k], k, 1, whole=True)
                         for k in names)
    if total is not None and micro is not None and acc is None:
        acc = total // micro // world
    elif total is not None and acc is not None and micro is None:
        micro = total // world // acc
    elif total is None and micro is not None:
        acc = acc or 1
        total = micro * acc * world
    elif total is not None and micro is None:  # with no accumulation given either
        acc, micro = 1, total // world
    elif total is None:
        raise ValueError("DeepSpeed config sets neither train_batch_size nor "
                         "train_micro_batch_size_per_gpu: set one (or both)")
    if micro < 1 or acc < 1 or total != micro * acc * world:
        raise ValueError(f"DeepSpeed train_batch_size {total} != train_micro_batch_size_per_gpu "
                         f"{micro} * gradient_accumulation_steps {acc} * world size {world}: "
                         "fix one of them, or leave one out to have it worked out")
    return micro, acc, total


def _precision(config: dict[str, Any], became: dict[str, str], unknown: list[str]
               ) -> tuple[torch.dtype, float | dict[str, Any] | None]:
    bf16, fp16 = settings(config, "bf16"), settings(config, "fp16")
    unknown += [f"bf16.{k}" for k in bf16 if k != "enabled"]
    unknown += [f"fp16.{k}" for k in fp16 if k not in FP16_KEYS]
    bf16_on = _flag(bf16, "enabled", "bf16.enabled")
    fp16_on = _flag(fp16, "enabled", "fp16.enabled")
    if bf16_on and fp16_on:
        raise ValueError("DeepSpeed bf16.enabled and fp16.enabled are both true: enable one")
    if bf16_on:
        became["bf16"] = "model cast to torch.bfloat16, fp32 master weights in the optimizer"
        return torch.bfloat16, None
    if not fp16_on:
        return torch.float32, None
    static = _number(fp16.get("loss_scale", 0), "fp16.loss_scale", 0)
    if static > 0:
        became["fp16"] = (f"model cast to torch.float16, fp32 masters, static loss scale "
                          f"{static:g}")
        return torch.float16, static
    power = _number(fp16.get("initial_scale_power", 16), "fp16.initial_scale_power", 0, True)
    if power > 64:
        raise ValueError(f"DeepSpeed fp16.initial_scale_power must be at most 64 (a scale of "
                         f"2**{power} is past every float), not {power}")
    scale = {"scale": 2.0 ** power,
             "window": _number(fp16.get("loss_scale_window", 1000), "fp16.loss_scale_window", 1,
                               True),
             "min_scale": _number(fp16.get("min_loss_scale", 1), "fp16.min_loss_scale", 0),
             "hysteresis": _number(fp16.get("hysteresis", 2), "fp16.hysteresis", 1, True),
             "consecutive": _flag(fp16, "consecutive_hysteresis", "fp16.consecutive_hysteresis")}
    became["fp16"] = (f"model cast to torch.float16, fp32 masters, dynamic loss scale from "
                      f"2**{power}, doubled after {scale['window']} good steps, halved after "
                      f"{scale['hysteresis']} overflows, at least {scale['min_scale']:g}")
    return torch.float16, scale


def _optimizer(config: dict[str, Any], became: dict[str, str]
               ) -> tuple[type[torch.optim.Optimizer] | None, dict[str, Any]]:
    section = settings(config, "optimizer")
    if not section:
        return None, {}
    kind = section.get("type")
    params = settings(section, "params")
    extra = sorted(set(section) - {"type", "params"})
    if extra:
        raise ValueError(f"DeepSpeed optimizer.{extra[0]} is not a setting of the optimizer "
                         "section: it has type and params")
    name = kind.lower() if isinstance(kind, str) else kind
    if name not in ("adam", "adamw", "sgd"):
        raise ValueError(f"DeepSpeed optimizer.type {kind!r} is not Adam, AdamW or SGD: use one "
                         "of those, or build tieroffload.optimizer(model, YourClass) yourself")
    allowed = SGD_KEYS if name == "sgd" else ADAM_KEYS
    wrong = sorted(set(params) - allowed)
    if wrong:
        raise ValueError(f"DeepSpeed optimizer.params.{wrong[0]} is not a setting of {kind}: "
                         f"it takes {', '.join(sorted(allowed))}")
    _opt_params(params)
    kwargs = dict(params)
    if name == "sgd":
        cls: type[torch.optim.Optimizer] = torch.optim.SGD
    else:
        torch_adam = bool(kwargs.pop("torch_adam", False))
        w_mode = bool(kwargs.pop("adam_w_mode", True)) or name == "adamw"
        if not kwargs.pop("bias_correction", True):
            raise ValueError("DeepSpeed optimizer.params.bias_correction false is not supported: "
                             "torch's Adam and AdamW always correct the bias")
        cls = torch.optim.AdamW if w_mode else torch.optim.Adam
        if not torch_adam:  # DeepSpeed's FusedAdam / CPUAdam defaults
            kwargs.setdefault("lr", 1e-3)
            kwargs.setdefault("weight_decay", 0.0)
        if "betas" in kwargs:
            kwargs["betas"] = tuple(kwargs["betas"])
    became["optimizer"] = (f"tieroffload.optimizer(model, torch.optim.{cls.__name__}, "
                           + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")")
    return cls, kwargs


def _schedule(config: dict[str, Any], became: dict[str, str]
              ) -> tuple[str, dict[str, Any]] | None:
    if config.get("scheduler") and config.get("lr_scheduler"):
        raise ValueError("DeepSpeed config has both scheduler and lr_scheduler: keep scheduler")
    key = "scheduler" if config.get("scheduler") else "lr_scheduler"
    section = settings(config, key)
    if not section:
        return None
    extra = sorted(set(section) - {"type", "params"})
    if extra:
        raise ValueError(f"DeepSpeed {key}.{extra[0]} is not a setting of the scheduler section: "
                         "it has type and params")
    params = dict(settings(section, "params"))
    check_schedule(section.get("type"), params)
    became[key] = (f"{section.get('type')}({', '.join(f'{k}={v!r}' for k, v in params.items())})"
                   ", stepped after each optimizer step (DeepSpeed's formula)")
    return section.get("type"), params


def _dry_run(opt_cls: type[torch.optim.Optimizer] | None, opt_kwargs: dict[str, Any],
             schedule: tuple[str, dict[str, Any]] | None) -> None:
    """Builds the optimizer over the paged optimizer's probe parameter (``HyperCheck``) and
    steps it, and the schedule over it, so that what torch's constructor, its step or the
    schedule refuse is refused here, before the model is touched."""
    if schedule is not None and opt_cls is None:
        raise ValueError("DeepSpeed scheduler needs an optimizer section in the config")
    if opt_cls is None:
        return
    try:
        probe = HyperCheck(opt_cls, opt_kwargs, torch.device("cpu"))
        probe.check([opt_kwargs])
        opt = probe.opt
    except (TypeError, ValueError) as e:
        raise ValueError(f"DeepSpeed optimizer.params: torch.optim.{opt_cls.__name__} refuses "
                         f"{opt_kwargs}: {e}") from None
    if schedule is not None:
        try:
            make_schedule(opt, *schedule)
        except TypeError as e:
            raise ValueError(f"DeepSpeed scheduler.params: {e}") from None


def _activations(config: dict[str, Any], became: dict[str, str], unknown: list[str],
                 notes: list[str]) -> str | None:
    section = settings(config, "activation_checkpointing")
    unknown += [f"activation_checkpointing.{k}" for k in section if k not in ACTIVATION_KEYS]
    unknown += [f"activation_checkpointing.{k}" for k in sorted(ACTIVATION_KEYS - {
        "partition_activations", "cpu_checkpointing"}) if section.get(k)]  # on: not honoured
    for k in ("partition_activations", "cpu_checkpointing"):
        _flag(section, k, f"activation_checkpointing.{k}")
    if section.get("partition_activations"):
        notes.append("activation_checkpointing.partition_activations: one rank holds all of "
                     "them, nothing to partition (no-op)")
    if section.get("cpu_checkpointing"):
        became["activation_checkpointing.cpu_checkpointing"] = (
            'Policy(activations="cpu"): tensors saved for backward paged to RAM (with CUDA '
            "compute; with CPU compute they are in RAM already)")
        return "cpu"
    return None


def read_config(config: dict[str, Any], world: int = 1) -> tuple[Plan, list[str]]:
    """The ``Plan`` of ``config`` and notes for the log (keys with no effect on one process)."""
    became: dict[str, str] = {}
    unknown = sorted(k for k in config if k not in TOP_KEYS)
    notes: list[str] = []
    policy, decided, offload_unknown = read_offload(config)
    unknown += offload_unknown
    zero = settings(config, "zero_optimization")
    stage = zero.get("stage", 3 if zero else 0)
    decided = [k for k in decided if k != "zero_optimization.stage"]
    if zero or config.get("aio"):
        places = ", ".join(f"{k}={v!r}" for k, v in policy.items()) or "defaults"
        became["zero_optimization"] = (f"stage {stage} on one process (nothing to partition): "
                                       f"Policy({places})")
    dtype, loss_scale = _precision(config, became, unknown)
    opt_cls, opt_kwargs = _optimizer(config, became)
    schedule = _schedule(config, became)
    _dry_run(opt_cls, opt_kwargs, schedule)
    micro, acc, total = _batch_sizes(config, world)
    became["batch sizes"] = (f"micro batch {micro} (the dataloader's), {acc} micro-batches a "
                             f"step, {total} samples a step; backward divides the loss by {acc}")
    clipping = _number(config.get("gradient_clipping", 0.0), "gradient_clipping", 0)
    if clipping:
        became["gradient_clipping"] = (f"optimizer.clip_grad_norm_({clipping:g}) at each "
                                       "accumulation boundary, before the step")
    activations = _activations(config, became, unknown, notes)
    if activations:
        policy["activations"] = activations
    steps = config.get("steps_per_print", 10)
    if steps is not None:
        steps = _number(steps, "steps_per_print", 1, whole=True)
        became["steps_per_print"] = f"a log line (INFO, logger 'tieroffload') every {steps} steps"
    wall = _flag(config, "wall_clock_breakdown", "wall_clock_breakdown")
    if wall:
        became["wall_clock_breakdown"] = "forward, backward and step times in that log line"
    monitor = False
    for key in MONITORS:
        section = settings(config, key)
        unknown += [f"{key}.{k}" for k in section if k not in MONITOR_KEYS]
        wrong = next((k for k in sorted(MONITOR_KEYS - {"enabled"}) if k in section
                      and not isinstance(section[k], str)), None)
        if wrong is not None:
            raise ValueError(f"DeepSpeed {key}.{wrong} must be a string (a path or a name), not "
                             f"{section[wrong]!r:.60}")
        if _flag(section, "enabled", f"{key}.enabled"):
            monitor = True
            became[key] = "tieroffload.Monitor.from_deepspeed: one record per step"
    drop_last = _flag(config, "dataloader_drop_last", "dataloader_drop_last")
    plan = Plan(policy=policy, stage=stage, dtype=dtype, loss_scale=loss_scale, opt_cls=opt_cls,
                opt_kwargs=opt_kwargs, schedule=schedule, micro_batch=micro, accumulation=acc,
                batch=total, clipping=clipping, steps_per_print=steps, wall_clock=wall,
                monitor=monitor, drop_last=drop_last,
                became=became, unknown=sorted(unknown), decided=sorted(decided))
    return plan, notes

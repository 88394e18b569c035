"""Reading a DeepSpeed ZeRO config into tieroffload's terms, so users can move over.

DeepSpeed counts parameters in elements; tieroffload budgets bytes. Element counts become bytes at
2 bytes an element (the fp16/bf16 weights ZeRO-3 offload usually holds), and the report says so.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

log = logging.getLogger("tieroffload")

# Settings tieroffload chooses itself: read, reported, not needed.
DECIDED_HERE = {
    "offload_param": {"pin_memory", "buffer_count", "buffer_size", "max_in_cpu"},
    "offload_optimizer": {"pin_memory", "buffer_count", "fast_init", "pipeline", "pipeline_read",
                          "pipeline_write", "ratio"},
    "aio": {"single_submit", "overlap_events", "use_gds"},
    "zero_optimization": {"stage", "sub_group_size", "stage3_param_persistence_threshold",
                          "stage3_max_reuse_distance", "contiguous_gradients", "overlap_comm",
                          "reduce_bucket_size", "stage3_gather_16bit_weights_on_model_save",
                          "round_robin_gradients", "memory_efficient_linear"},
}
BYTES_PER_ELEMENT = 2
TIER = {"nvme": "nvme", "cpu": "cpu", "none": None, None: None}


def load_config(config: dict[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """A DeepSpeed config as a dict: given as one, or read from its JSON file."""
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                config = json.load(f)
        except ValueError as e:
            raise ValueError(f"DeepSpeed config {os.fspath(config)}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"a DeepSpeed config is a dict (or its JSON file), not {config!r:.80}")
    return config


def settings(config: Any, key: str, where: str = "") -> dict[str, Any]:
    """``config[key]``, a dict of settings (absent or null: none); anything else is refused,
    ``[]`` and ``false`` included."""
    value = config.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"DeepSpeed {where}{key} must be a dict of settings, not {value!r:.80}")
    return dict(value)


def _count(value: Any, where: str) -> int:
    """A DeepSpeed count (elements, bytes, threads): a whole number >= 0."""
    try:
        n = (int(value) if not isinstance(value, (bool, str)) and float(value) == int(value)
             else None)  # 1e9 is whole (DeepSpeed's own examples write counts so); "8" is not
    except (TypeError, ValueError, OverflowError):
        n = None
    if n is None or n < 0:
        raise ValueError(f"DeepSpeed {where} must be a whole number >= 0, not {value!r}")
    return n


def read_offload(config: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[str]]:
    """The ``Policy.from_dict`` arguments that ``config``'s ``zero_optimization`` and ``aio``
    sections give, the keys there tieroffload decides itself, and those it does not know
    (dotted names). Logs nothing."""
    if not isinstance(config, dict):
        raise ValueError(f"a DeepSpeed config is a dict (or its JSON file), not {config!r:.80}")
    zero = settings(config, "zero_optimization", "")
    param = settings(zero, "offload_param", "zero_optimization.")
    optim = settings(zero, "offload_optimizer", "zero_optimization.")
    zero.pop("offload_param", None)
    zero.pop("offload_optimizer", None)
    aio = settings(config, "aio", "")
    stage = zero.get("stage", 3)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ValueError(f"DeepSpeed zero_optimization.stage must be 0, 1, 2 or 3, not {stage!r}")
    if stage != 3 and param.get("device") not in (None, "none"):
        raise ValueError(f"DeepSpeed zero_optimization.offload_param needs stage 3, not stage "
                         f"{stage}: DeepSpeed itself would refuse this config")
    if stage == 0 and optim.get("device") not in (None, "none"):
        raise ValueError("DeepSpeed zero_optimization.offload_optimizer needs stage 1, 2 or 3, "
                         "not stage 0 (no ZeRO): set stage, or remove offload_optimizer")
    out: dict[str, Any] = {}
    unknown: list[str] = []
    decided: list[str] = []

    def device(section: dict[str, Any], where: str) -> str | None:
        dev = section.pop("device", None)
        if dev not in TIER:
            raise ValueError(f"DeepSpeed {where}.device {dev!r} is not one of nvme, cpu, none")
        return TIER[dev]

    dirs = set()
    for section, where, key in ((param, "offload_param", "params"),
                                (optim, "offload_optimizer", "optimizer")):
        tier = device(section, where)
        if tier is not None:
            out[key] = tier
        path = section.pop("nvme_path", None)
        if path and tier == "nvme":
            dirs.add(path)
        for k in section:
            (decided if k in DECIDED_HERE[where] else unknown).append(f"{where}.{k}")
    if len(dirs) > 1:
        raise ValueError(f"DeepSpeed config names two nvme_path values {sorted(dirs)}; "
                         "tieroffload keeps one swap directory")
    if dirs:
        out["nvme_dir"] = dirs.pop()
    for key in ("stage3_prefetch_bucket_size", "stage3_max_live_parameters"):
        if zero.get(key) == "auto":  # Hugging Face's placeholder: left to tieroffload
            zero.pop(key)
            decided.append(f"zero_optimization.{key}")
    if "stage3_prefetch_bucket_size" in zero:
        n = _count(zero.pop("stage3_prefetch_bucket_size"),
                   "zero_optimization.stage3_prefetch_bucket_size")
        out["prefetch"] = f"{n * BYTES_PER_ELEMENT}B"
    if "stage3_max_live_parameters" in zero:
        live = _count(zero.pop("stage3_max_live_parameters"),
                      "zero_optimization.stage3_max_live_parameters") * BYTES_PER_ELEMENT
        out["cpu_budget" if out.get("params") == "nvme" else "gpu_budget"] = live
    for k in zero:
        (decided if k in DECIDED_HERE["zero_optimization"] else unknown).append(
            f"zero_optimization.{k}")
    io: dict[str, Any] = {}
    for ds_key, ours in (("block_size", "block_size"), ("queue_depth", "queue_depth"),
                         ("intra_op_parallelism", "threads"), ("thread_count", "threads")):
        if ds_key in aio:
            io[ours] = _count(aio.pop(ds_key), f"aio.{ds_key}")
    for k in aio:
        (decided if k in DECIDED_HERE["aio"] else unknown).append(f"aio.{k}")
    if io:
        out["io"] = io
    return out, decided, unknown


def policy_from_deepspeed(config: dict[str, Any]) -> dict[str, Any]:
    """The ``Policy.from_dict`` arguments that match ``config``; warns about every key that did
    not map, those outside ``zero_optimization`` and ``aio`` included (training settings that
    ``tieroffload.initialize`` applies)."""
    out, decided, unknown = read_offload(config)
    elements = [k for k in ("prefetch", "cpu_budget", "gpu_budget") if k in out]
    if elements:
        log.info("DeepSpeed element counts read as %d bytes an element: %s", BYTES_PER_ELEMENT,
                 ", ".join(elements))
    elsewhere = sorted(k for k in config if k not in ("zero_optimization", "aio"))
    if elsewhere:  # precision, batch sizes, clipping: a migrating user must hear of them
        log.warning("DeepSpeed settings outside zero_optimization and aio, not used by "
                    "Policy.from_deepspeed: %s; tieroffload.initialize(model=..., config=...) "
                    "applies the whole config", ", ".join(elsewhere))
    if decided:
        log.warning("DeepSpeed settings that tieroffload decides itself, not used: %s",
                    ", ".join(sorted(decided)))
    if unknown:
        log.warning("DeepSpeed settings tieroffload does not know, not used: %s",
                    ", ".join(sorted(unknown)))
    return out

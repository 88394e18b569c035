"""Policies: small frozen dataclasses that say where tensors live and how I/O is done."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..aio.config import IOConfig
from ..integrations.deepspeed import load_config, policy_from_deepspeed
from ..utils.paths import directories
from ..utils.sizes import parse_bytes

TIERS = ("gpu", "cpu", "nvme")


def _budget(name: str, value: int | str | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_bytes(value)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


@dataclass(frozen=True)
class BasePolicy:
    """Where an offloaded model's tensors live and how they move.

    ``params``: the tier that holds the parameters ("gpu", "cpu" or "nvme"). ``device``: where
    compute runs (default: cuda when present, else cpu). ``nvme_dir``: directory of the swap
    space (needed for "nvme"), or a list of them, one per drive: units are striped over all.
    One that other users can write to without the sticky bit is refused, as they could redirect
    the swap files; set ``TIEROFFLOAD_ALLOW_SHARED_DIR=1`` to accept that.
    ``gpu_budget`` / ``cpu_budget``: bytes (or "2GiB") of parameters
    that may be resident on the compute device at once; default: what the prefetch window needs.
    ``prefetch``: how much to have on its way ahead of compute along the recorded order, past
    the units already resident: a number of units, or bytes given as a string ("512MiB").
    ``io``: engine settings (an ``IOConfig`` or its dict).
    ``optimizer``: the tier of the paged optimizer's state ("gpu", "cpu" or "nvme"; default: the
    compute device's). ``grads``: where gradients go after each unit's backward: the compute
    device (default), or "nvme" (with params="nvme"; consumed by the paged optimizer's step).
    ``activations``: where tensors saved for backward are paged during forward ("cpu", "nvme",
    or None to leave them); those under ``activation_threshold`` bytes stay put. ``adapt``:
    the prefetch depth follows measured stalls and memory pressure (see ``stats()``).
    ``lend_core``: with params on NVMe and compute on the CPU, compute runs on one thread fewer
    while it is behind its reads, leaving the reads a core (``tieroffload.threads``); off by
    default, as results then differ in the last bits from a run at a fixed thread count.
    ``checksum``: a CRC-32 of each unit (parameters, gradients, optimizer state) and of each
    saved activation written to NVMe, checked when it is read back: a hole or a bad block
    raises an EIO naming the unit (or activation), the file and the offset instead of training
    on zeros (costs a CRC pass over every byte
    moved; see bench/README.md).
    """

    params: str = "cpu"
    device: str | None = None
    nvme_dir: str | tuple[str, ...] | None = None
    gpu_budget: int | str | None = None
    cpu_budget: int | str | None = None
    prefetch: int | str = 2
    io: IOConfig | dict = dataclasses.field(default_factory=IOConfig)
    optimizer: str | None = None
    grads: str | None = None
    activations: str | None = None
    activation_threshold: int | str = "1MiB"
    adapt: bool = True
    lend_core: bool = False
    checksum: bool = False

    def __post_init__(self) -> None:
        if self.device is not None:
            try:
                dev = torch.device(self.device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"device: {e}".splitlines()[0]) from None
            if dev.type not in ("cpu", "cuda"):
                raise ValueError(f"device must be 'cpu' or 'cuda' (where compute runs), not "
                                 f"{self.device!r}")
            if dev.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"device={self.device!r} but CUDA is not available here "
                                 "(a CPU build of torch, or no GPU): use device='cpu'")
        if self.params not in TIERS:
            raise ValueError(f"params must be one of {TIERS}, not {self.params!r}")
        if self.optimizer is None:
            object.__setattr__(self, "optimizer",
                               "gpu" if self.compute_device().type == "cuda" else "cpu")
        if self.grads is None:
            object.__setattr__(self, "grads",
                               "gpu" if self.compute_device().type == "cuda" else "cpu")
        if self.grads == "nvme" and self.params != "nvme":
            raise ValueError('grads="nvme" needs params="nvme"')
        if self.grads not in TIERS:
            raise ValueError(f"grads must be one of {TIERS}, not {self.grads!r}")
        if self.grads == "cpu" and self.compute_device().type == "cuda" \
                and not self.pages_params:
            raise ValueError(
                'grads="cpu" with CUDA compute pages each unit\'s gradients to pinned RAM as '
                f'its backward ends, which needs params="cpu" or "nvme", not {self.params!r}; '
                'use grads="gpu" with params="gpu"')
        if self.optimizer not in TIERS:
            raise ValueError(f"optimizer must be one of {TIERS}, not {self.optimizer!r}")
        if self.activations not in (None, "cpu", "nvme"):
            raise ValueError(f'activations must be "cpu", "nvme" or None, not '
                             f"{self.activations!r}")
        if "nvme" in (self.params, self.optimizer, self.activations) and not self.nvme_dir:
            raise ValueError('params, optimizer or activations on "nvme" need nvme_dir, the '
                             "directory for the swap space")
        for name in ("adapt", "lend_core", "checksum"):  # "no" would switch it on
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, not {getattr(self, name)!r}")
        if not isinstance(self.io, (IOConfig, dict)):
            raise ValueError(f"io must be an IOConfig or a dict of its fields, not {self.io!r}")
        for d in (self.nvme_dir if isinstance(self.nvme_dir, (list, tuple)) else
                  [self.nvme_dir] if self.nvme_dir is not None else []):
            if not isinstance(d, (str, os.PathLike)):
                raise ValueError(f"nvme_dir must be a path (str or os.PathLike) or a list of "
                                 f"them, not {d!r}")
        set_ = object.__setattr__  # frozen: normalise once, here
        set_(self, "gpu_budget", _budget("gpu_budget", self.gpu_budget))
        set_(self, "cpu_budget", _budget("cpu_budget", self.cpu_budget))
        set_(self, "activation_threshold",
             _budget("activation_threshold", self.activation_threshold))
        if isinstance(self.io, dict):
            set_(self, "io", IOConfig.from_dict(self.io))
        if isinstance(self.prefetch, str):
            _budget("prefetch", self.prefetch)
        elif isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) \
                or self.prefetch < 0:
            raise ValueError(f"prefetch must be a number of units >= 0 or a size such as "
                             f"'256MiB', not {self.prefetch!r}")
        if self.device is not None:
            set_(self, "device", str(self.device))
        dirs = directories(self.nvme_dir)  # one directory per drive: striped
        set_(self, "nvme_dir", None if not dirs else dirs[0] if len(dirs) == 1 else tuple(dirs))

    def compute_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    @property
    def pages_params(self) -> bool:
        """Parameters live away from the compute device and are paged in: on NVMe, or in RAM
        with CUDA compute."""
        return self.params == "nvme" or (self.params == "cpu"
                                         and self.compute_device().type == "cuda")

    @property
    def pages_grads(self) -> bool:
        """Gradients leave the compute device as each unit's backward ends (``p.grad`` is None
        after it): to NVMe, or to pinned RAM with CUDA compute."""
        return self.grads == "nvme" or (self.grads == "cpu"
                                        and self.compute_device().type == "cuda")

    def to_dict(self) -> dict[str, Any]:
        """Plain values (JSON-ready); ``Policy.from_dict`` reads it back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BasePolicy:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown policy settings {unknown}; known: {sorted(names)}")
        return cls(**d)

    def to_json(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> BasePolicy:
        with open(path) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_deepspeed(cls, config: dict[str, Any] | str | os.PathLike) -> BasePolicy:
        """A Policy from a DeepSpeed config (a dict or a JSON file): its ZeRO ``offload_param``,
        ``offload_optimizer`` and ``aio`` sections. Keys tieroffload decides for itself and keys it
        does not know are logged as a warning, never dropped in silence."""
        return cls.from_dict(policy_from_deepspeed(load_config(config)))

    def explain(self) -> str:
        """What goes where and why, with the predicted step time, peak memory per tier and the
        bottleneck (for a policy made by ``Policy.auto``)."""
        plan = getattr(self, "plan", None)
        if plan is None:
            return f"{self!r} was set by hand; Policy.auto explains the policies it makes"
        return plan.explain()

    def prefetch_window(self) -> tuple[int, int | None]:
        """(units, bytes or None) ahead to prefetch."""
        if isinstance(self.prefetch, str):
            return 1 << 30, parse_bytes(self.prefetch)
        return self.prefetch, None

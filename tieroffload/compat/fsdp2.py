"""FSDP2 (``fully_shard``) internals that tieroffload reads and rebinds: a module's parameter
group, its lazy initialisation, and each FSDPParam's padded shard and DTensor local tensor."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

TESTED = ("2.11", "2.13")


def is_fsdp_module(m: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(m, FSDPModule)


def param_group(m: nn.Module) -> Any:
    """The FSDPParamGroup of a sharded module, or None."""
    return m._get_fsdp_state()._fsdp_param_group


def lazy_init(m: nn.Module) -> None:
    """FSDP's lazy initialisation of a root module (idempotent)."""
    m._get_fsdp_state()._lazy_init()


def gather_pending(group: Any) -> bool:
    """An all-gather of the group was issued and not yet waited for."""
    return group._all_gather_result is not None


def padded_shard(fp: Any) -> torch.Tensor:
    """The FSDPParam's local shard, padded to an even size (what the all-gather reads)."""
    return fp._sharded_param_data


def local_tensor(dt: Any) -> torch.Tensor:
    """The local tensor of a DTensor parameter."""
    return dt._local_tensor


def rebind(fp: Any, padded: torch.Tensor, local: torch.Tensor) -> None:
    """Points the FSDPParam's padded shard and its DTensor's local tensor at new storage."""
    fp._sharded_param_data = padded.view(-1)
    fp.sharded_param._local_tensor = local


def param_name(fp: Any) -> str:
    return getattr(fp, "_param_fqn", "?")


def owner(fp: Any) -> nn.Module:
    """The module that owns the FSDPParam."""
    return fp._module_info.module

"""Composition with FSDP2 (``fully_shard``): tieroffload pages each rank's local shards.

FSDP keeps one parameter group per sharded module. Each parameter's local shard, padded to an
even size, is ``FSDPParam._sharded_param_data``; the module and the user see it wrapped in a
DTensor. FSDP's hooks all-gather the shards before the module runs (``unshard``, then
``wait_for_unshard``) and reduce-scatter the gradients after its backward. tieroffload makes one
unit of each group's shards, brings it in just before FSDP's all-gather reads it and lets it go
once the gathered parameters exist, so the scheduler records and prefetches along the order of
FSDP's all-gathers as it does along module order elsewhere. The optimizer steps each shard as a
plain parameter over the same storage (``Shard.local``), so the paged optimizer and the
checkpoints work on shards unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from ..compat import fsdp2


@dataclass
class Shard:
    """One FSDP parameter's local shard as tieroffload pages it."""

    fsdp_param: Any      # FSDPParam
    name: str            # the parameter's name in the model
    local: nn.Parameter  # a plain parameter over the unpadded shard: what the optimizer steps
    nbytes: int          # the padded shard's bytes: what the all-gather reads

    @property
    def public(self) -> nn.Parameter:
        """The DTensor parameter the module and the user's optimizer see."""
        return self.fsdp_param.sharded_param

    def rebind(self) -> None:
        """Points FSDP's padded shard and the DTensor's local tensor at the storage ``local``
        now has (tieroffload moved it into a buffer of its own)."""
        fp, data = self.fsdp_param, self.local.data
        padded = data.new_empty(0).set_(data.untyped_storage(), data.storage_offset(),
                                        fp.padded_sharded_param_size)
        fsdp2.rebind(fp, padded, padded.narrow(0, 0, data.shape[0]))

    def pull_grad(self) -> None:
        """Hands the reduce-scattered gradient (a DTensor) to ``local`` as a plain tensor."""
        g = self.public.grad
        self.local.grad = None if g is None else g.to_local()

    def clear_grad(self, set_to_none: bool) -> None:
        g = self.public.grad
        if set_to_none or g is None:
            self.public.grad = None
        else:
            g.zero_()


def groups(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """(module name, FSDP parameter group) of ``model``'s sharded modules, in module order."""
    seen: set[int] = set()
    for name, m in model.named_modules():
        if fsdp2.is_fsdp_module(m):
            g = fsdp2.param_group(m)
            if g is not None and id(g) not in seen:
                seen.add(id(g))
                yield name, g


def lazy_init(model: nn.Module) -> None:
    """Runs FSDP's lazy initialisation now, as its first forward would (idempotent): it
    re-pads the shards, which must happen before tieroffload moves them."""
    def roots(m: nn.Module) -> Iterator[nn.Module]:
        if fsdp2.is_fsdp_module(m):
            yield m
            return
        for c in m.children():
            yield from roots(c)

    for m in roots(model):
        fsdp2.lazy_init(m)


def shards(group: Any, names: dict[int, str]) -> list[Shard]:
    """The group's parameters as shards; ``names``: id of each DTensor parameter -> its name."""
    out = []
    for fp in group.fsdp_params:
        dt = fp.sharded_param
        where = names.get(id(dt), fsdp2.param_name(fp))
        if dt.device.type == "meta":
            raise ValueError(f"tieroffload cannot offload FSDP parameter {where!r}: it is on the "
                             "meta device; initialise it (to_empty and init) first")
        if fp.fsdp_placement.dim != 0 or fp.offload_to_cpu:
            raise TypeError(f"tieroffload cannot offload FSDP parameter {where!r}: it pages "
                            "shards on dimension 0 without FSDP's own CPUOffloadPolicy")
        local = nn.Parameter(fsdp2.local_tensor(dt).detach(), requires_grad=dt.requires_grad)
        padded = fsdp2.padded_shard(fp)
        out.append(Shard(fp, where, local, padded.numel() * padded.element_size()))
    return out


def hook(group: Any, acquire: Callable[[], None], release: Callable[[], None]) -> Callable:
    """Wraps the group's ``unshard`` and ``wait_for_unshard``: the shards are resident from
    before the all-gather reads them until the gathered parameters exist. Returns the undo."""
    held = [False]
    unshard, wait = group.unshard, group.wait_for_unshard

    def unshard_resident(async_op: bool = False) -> None:
        if not held[0] and not fsdp2.gather_pending(group) and not group.is_unsharded:
            acquire()
            held[0] = True
        unshard(async_op)

    def wait_then_release() -> None:
        try:
            wait()
        finally:
            if held[0]:
                held[0] = False
                release()

    group.unshard, group.wait_for_unshard = unshard_resident, wait_then_release

    def undo() -> None:
        del group.unshard, group.wait_for_unshard
        if held[0]:
            held[0] = False
            release()
    return undo


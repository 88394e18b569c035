"""Modules assigned into an offloaded model after ``offload``: a wrapper around one of its
layers (PEFT's LoRA, IA3 and the like, ``get_peft_model`` and ``PeftModel.from_pretrained``)
is accepted. The wrapped layer keeps its units and hooks; the wrapper's own new parameters (the
adapters) are plain parameters on the compute device, outside the budget, stepped by any torch
optimizer. Putting the layer back (``merge_and_unload``, ``unload``) is accepted too. What would
drop offloaded parameters, or bring new ones without wrapping a layer (a replaced embedding,
``resize_token_embeddings``), is refused."""

from __future__ import annotations

from torch import nn


def check_assignment(paged: dict[int, object], known: set[int], parent: nn.Module, name: str,
                     sub: nn.Module) -> None:
    """Refuses ``parent.name = sub`` inside an offloaded model (``paged``: ids of its paged
    parameters; ``known``: ids of its modules at offload) unless ``sub`` is one of its
    modules, wraps the module it replaces, or drops no paged parameter and brings none."""
    if id(sub) in known:
        return
    old = parent._modules.get(name)
    if old is not None and any(m is old for m in sub.modules()):
        return  # a wrapper: the old module, with its units and hooks, lives inside
    kept = {id(p) for p in sub.parameters()}
    dropped = [p for p in (old.parameters() if old is not None else ())
               if id(p) in paged and id(p) not in kept]
    new = [n for n, p in sub.named_parameters() if id(p) not in paged]
    if dropped or new:
        what = (f"would drop {len(dropped)} offloaded parameter(s)" if dropped else
                f"brings {len(new)} parameter(s) of its own ({new[0]!r}) without wrapping a "
                "layer")
        raise ValueError(
            f"tieroffload: module {name!r} assigned into an offloaded model {what} "
            "(resize_token_embeddings, a replaced layer): change modules before "
            "tieroffload.offload, wrap the layer instead (as PEFT does), or close(model) "
            "first")

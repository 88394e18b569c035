"""The Hugging Face Trainer over an offloaded model: the optimizer the Trainer would build
(its ``optim``, learning rate, betas, eps, and no weight decay on biases and norms), made a paged
one where it steps offloaded parameters. transformers is imported only when this is called."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .hooks.registry import state_of
from .optim import optimizer


def trainer_optimizer(model: nn.Module, args: Any) -> torch.optim.Optimizer:
    """``transformers.Trainer``'s own optimizer for ``model`` and ``args``
    (``TrainingArguments``), as ``Trainer.create_optimizer`` builds it: the class and keyword
    arguments of ``args.optim`` and two param groups, ``args.weight_decay`` on the parameters
    ``Trainer.get_decay_parameter_names`` names and none on the others (biases, norms). Over
    offloaded parameters it is a paged optimizer (``tieroffload.optimizer``); over parameters
    outside the units only (a PEFT adapter on a frozen offloaded base) the plain torch one.

    ``Trainer(model=model, args=args, ..., optimizers=(trainer_optimizer(model, args), None))``:
    the Trainer builds its scheduler over it, clips, accumulates, saves and resumes it."""
    import transformers

    state = state_of(model)
    opt_cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
    if not (isinstance(opt_cls, type) and issubclass(opt_cls, torch.optim.Optimizer)) \
            or {"params", "model", "optimizer_dict"} & kwargs.keys():
        raise ValueError(f"tieroffload.hf.trainer_optimizer: optim={args.optim!r} builds no "
                         "plain torch.optim.Optimizer over param groups; use an AdamW, Adam "
                         "or SGD optim (optim='adamw_torch_fused', the default)")
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    paged = [n for n, p in named if id(p) in state.param_unit]
    if not paged:
        return opt_cls(groups, **kwargs)
    plain = [n for n, p in named if id(p) not in state.param_unit]
    if plain:
        raise ValueError(
            f"tieroffload.hf.trainer_optimizer: {len(plain)} trainable parameter(s) outside "
            f"the offloaded units ({plain[0]!r}) beside {len(paged)} offloaded ones: train "
            "one kind only (freeze the base for adapters), or build the optimizers yourself")
    # The Trainer's kernel: its plain AdamW (optim="adamw_torch") is torch's default, not the
    # fused kernel a paged Adam takes when it is not told.
    adam = opt_cls in (torch.optim.Adam, torch.optim.AdamW)
    if adam and not {"fused", "foreach"} & kwargs.keys():
        kwargs["fused"] = None
    return optimizer(model, opt_cls, groups, **kwargs)

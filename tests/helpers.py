"""Builders the test files share: policies, (plain, offloaded) pairs, training steps, and plain
PyTorch reference runs computed once per set of parameters."""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

import tieroffload
from tieroffload import Policy
from tieroffload.testing.models import token_batch

T = TypeVar("T")

ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)  # the AdamW of the training tests


def cpu_policy(tmp_path=None, **kw: Any) -> Policy:
    """``Policy(device="cpu", **kw)``, its NVMe directory ``tmp_path`` where one is given."""
    if tmp_path is not None:
        kw.setdefault("nvme_dir", str(tmp_path))
    return Policy(device="cpu", **kw)


def nvme_policy(tmp_path, **kw: Any) -> Policy:
    """Parameters on NVMe under ``tmp_path``, computed on the CPU."""
    return cpu_policy(tmp_path, params="nvme", **kw)


def offloaded_pair(make: Callable[[], nn.Module], policy: Policy, seed: int | None = 0,
                   **offload_kw: Any) -> tuple[nn.Module, nn.Module]:
    """(plain model, offloaded deepcopy of it): ``make()`` under ``torch.manual_seed(seed)``
    (none where seed is None)."""
    if seed is not None:
        torch.manual_seed(seed)
    ref = make()
    return ref, tieroffload.offload(copy.deepcopy(ref), policy, **offload_kw)


def square_loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def square_step(model: nn.Module, opt, x: torch.Tensor) -> float:
    """One training step on the mean square of the output; its loss."""
    opt.zero_grad()
    loss = square_loss(model(x))
    loss.backward()
    opt.step()
    return loss.item()


def gpt_step(model: nn.Module, opt, i: int, batch: int = 4, seq: int = 16,
             vocab: int = 97) -> float:
    """One training step of a GPT on ``token_batch(i)`` (cross entropy); its loss."""
    x, y = token_batch(i, batch, seq, vocab)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of each parameter, by name (read inside materialize where offloaded)."""
    if getattr(model, "_tieroffload", None) is None:
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    with tieroffload.materialize(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def optim_state_of(opt) -> dict:
    """A copy of each optimizer state entry, by (index, key)."""
    sd = opt.state_dict()["state"]
    return {(i, k): (v.clone() if isinstance(v, torch.Tensor) else v)
            for i, st in sd.items() for k, v in st.items()}


def assert_same(a: dict, b: dict, what: str) -> None:
    """``a`` and ``b`` (of params_of or optim_state_of) equal, bit for bit."""
    assert a.keys() == b.keys(), what
    for k in a:
        va, vb = a[k], b[k]
        same = torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb
        assert same, f"{what}: {k} changed"


def cached(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` (a pure builder: same arguments, same result) computed once per arguments; each
    call returns a deep copy, so that no test can change what the next one gets."""
    once = functools.cache(fn)

    @functools.wraps(fn)
    def copied(*args: Any, **kwargs: Any) -> T:
        return copy.deepcopy(once(*args, **kwargs))

    return copied


class TokenDataset(torch.utils.data.Dataset):
    """``n`` fixed rows of ``seq`` token ids below ``vocab``, each its own labels: a causal LM's
    training set for the Trainer and accelerate."""

    def __init__(self, vocab: int, n: int = 16, seq: int = 12) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}

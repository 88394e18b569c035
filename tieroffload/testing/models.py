"""A small GPT-style transformer built from code, and a learnable synthetic token stream: the
main job, the examples and the benchmarks train these without downloading anything."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and an MLP, each residual."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` pre-norm blocks, and an output head tied to the
    token embedding."""

    def __init__(self, vocab: int = 512, d: int = 256, layers: int = 4, heads: int = 4,
                 seq: int = 64) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        for m in self.modules():  # GPT-2's initialisation: small logits at the start
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def token_batch(step: int, batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of a deterministic stream whose next token mostly follows from the last
    one: a model can learn it, so the loss visibly falls."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    steps = torch.arange(seq + 1)
    tokens = (start * 7 + steps * 13) % vocab
    noise = torch.rand(batch, seq + 1, generator=g) < 0.1
    tokens = torch.where(noise, torch.randint(0, vocab, tokens.shape, generator=g), tokens)
    return tokens[:, :-1], tokens[:, 1:]


def gpt_task(vocab: int, d: int, layers: int, heads: int, seq: int, batch: int
             ) -> tuple[Callable[[], GPT], Callable[[nn.Module], torch.Tensor]]:
    """``(build, sample)`` as ``Policy.auto`` and the planner take them: ``build()`` makes the
    GPT afresh (the same weights each time), ``sample(model)`` runs a forward on one fixed batch
    of the token stream and returns its loss."""
    def build() -> GPT:
        torch.manual_seed(0)
        return GPT(vocab, d, layers, heads, seq)

    x, y = token_batch(0, batch, seq, vocab)

    def sample(model: nn.Module) -> torch.Tensor:
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    return build, sample

"""Small models built from code for the offload tests."""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tieroffload.testing.models import GPT


def mlp(width: int = 64, depth: int = 6) -> nn.Module:
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 8))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(GPT):
    """The package's GPT (output head tied to the embedding) with nn.MultiheadAttention blocks,
    which read their out_proj's parameters without calling it."""

    def __init__(self, vocab: int = 97, d: int = 32, layers: int = 3, heads: int = 4,
                 seq: int = 16) -> None:
        super().__init__(vocab, d, layers, heads, seq)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))


class Branchy(nn.Module):
    """Takes one of two paths depending on its input, and calls one layer twice."""

    def __init__(self, d: int = 48) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.shared = nn.Linear(d, d)
        self.left = nn.Linear(d, d)
        self.right = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d))
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = self.shared(h)
        h = self.left(h) if x.sum() > 0 else self.right(h)
        h = self.shared(torch.tanh(h))  # second call of the same module
        return self.out(h)


class CheckpointedGPT(TinyGPT):
    """TinyGPT whose blocks recompute their forward in backward with reentrant checkpointing:
    each runs a backward of its own inside the model's."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True)
        return self.head(self.ln_f(x))

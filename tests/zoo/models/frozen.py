"""Fine-tuning set-up: a GPT whose token embedding and first block are frozen
(``requires_grad_(False)``) and whose positions come from a fixed sinusoidal table registered
as a frozen parameter, as Whisper's encoder does."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn



class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.mlp = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.GELU(),
                                 nn.Linear(4 * hidden, hidden))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (y.view(b, t, -1, c // self.heads).transpose(1, 2) for y in self.qkv(self.norm(x)).chunk(3, -1))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp(x)


class FrozenBottomGPT(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, seq_len: int, vocab: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Parameter(self._sinusoids(seq_len, hidden), requires_grad=False)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.wte.requires_grad_(False)
        self.blocks[0].requires_grad_(False)

    @staticmethod
    def _sinusoids(length: int, channels: int) -> torch.Tensor:
        scales = torch.exp(-math.log(10000.0) * torch.arange(channels // 2) / (channels // 2 - 1))
        angles = torch.arange(length)[:, None] * scales[None, :]
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model(layers: int = 2, hidden: int = 32, heads: int = 4, seq_len: int = 16, vocab: int = 64) -> nn.Module:
    return FrozenBottomGPT(layers, hidden, heads, seq_len, vocab)


def example_batch(batch_size: int, seq_len: int = 16, vocab: int = 64) -> dict:
    tokens = torch.randint(0, vocab, (batch_size, seq_len + 1))
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


def loss_fn(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())

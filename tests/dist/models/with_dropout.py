"""Blocks with dropout the way model authors write it: nn.Dropout modules after the MLP, and
attention's own dropout_p while training (as Hugging Face's SDPA attention passes it); with
``noise``, also noise drawn into each block's input while training (a random draw that is not
dropout)."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

WIDTH, HEADS, SEQ = 32, 4, 8


class Block(nn.Module):
    def __init__(self, p: float, noise: float):
        super().__init__()
        self.noise = noise
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH), nn.Dropout(p))
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        if self.training and self.noise:
            x = x + self.noise * torch.randn_like(x)
        q, k, v = (part.view(b, s, HEADS, -1).transpose(1, 2) for part in self.qkv(x).chunk(3, dim=-1))
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(b, s, WIDTH))
        return x + self.mlp(x)


class Net(nn.Module):
    def __init__(self, layers: int, p: float, noise: float):
        super().__init__()
        self.blocks = nn.ModuleList(Block(p, noise) for _ in range(layers))
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).mean(dim=1)


def build_model(layers: int = 2, p: float = 0.2, noise: float = 0.0) -> nn.Module:
    return Net(layers, p, noise)


def example_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, SEQ, WIDTH), torch.randint(0, 4, (batch_size,))


def loss_fn(output: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(output, batch[1])

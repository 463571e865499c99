"""A deep MLP regressor: the simplest model to shard (data parallel or layer-wise).

    autopar profile examples/mlp.py model.layers=8 model.width=4096
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ResidualMLPBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.relu(self.up(self.norm(x))))


class MLP(nn.Module):
    def __init__(self, inputs: int, width: int, layers: int, outputs: int):
        super().__init__()
        self.embed = nn.Linear(inputs, width)
        self.blocks = nn.ModuleList(ResidualMLPBlock(width) for _ in range(layers))
        self.head = nn.Linear(width, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model(inputs: int = 64, width: int = 128, layers: int = 4, outputs: int = 8) -> nn.Module:
    return MLP(inputs, width, layers, outputs)


def example_batch(batch_size: int, inputs: int = 64, outputs: int = 8):
    return torch.randn(batch_size, inputs), torch.randn(batch_size, outputs)


def loss_fn(prediction: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(prediction, batch[1])

"""A small LM whose forward reads a tensor's values through NumPy (position ids per padded
sample): code no fake tensor can run, as hand-written data preparation inside forward often is."""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, seq_len: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(seq_len, hidden)
        self.layers = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        lengths = attention_mask.sum(-1).cpu().numpy()
        positions = np.stack([np.minimum(np.arange(ids.shape[1]), max(int(n) - 1, 0)) for n in lengths])
        h = self.embed(ids) + self.position(torch.from_numpy(positions).to(ids.device))
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def build_model(vocab: int = 64, hidden: int = 32, layers: int = 2, seq_len: int = 16) -> nn.Module:
    return Model(vocab, hidden, layers, seq_len)


def example_batch(batch_size: int, vocab: int = 64, seq_len: int = 16) -> dict:
    lengths = torch.randint(seq_len // 2, seq_len + 1, (batch_size, 1))
    mask = (torch.arange(seq_len) < lengths).long()
    return {"ids": torch.randint(0, vocab, (batch_size, seq_len)), "attention_mask": mask,
            "labels": torch.randint(0, vocab, (batch_size, seq_len))}


def loss_fn(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

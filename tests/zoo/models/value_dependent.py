"""A small mixture-of-experts LM written with code whose shapes and branches depend on values.

The common hand-written forms fake tensors cannot trace alone: experts that gather their tokens
with ``torch.nonzero(choice == expert)`` (DBRX, many MoE tutorials), a loss that checks
``labels.max()`` before using the labels (Hugging Face's CTC heads), and a loss over the tokens the
attention mask keeps, selected by boolean indexing (ELECTRA-style). Planning reads the batch's
values and bounds the weight-dependent sizes (autopar/data_dependent.py).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Experts(nn.Module):
    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.router = nn.Linear(hidden, experts)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        choice = self.router(flat).argmax(-1)
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            rows = torch.nonzero(choice == index).squeeze(-1)
            out = out.index_add(0, rows, expert(flat[rows]))
        return x + out.view_as(x)


class Model(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, experts: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Experts(hidden, experts) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def build_model(vocab: int = 64, hidden: int = 32, layers: int = 2, experts: int = 2) -> nn.Module:
    return Model(vocab, hidden, layers, experts)


def example_batch(batch_size: int, vocab: int = 64, seq_len: int = 16) -> dict:
    """Token ids, labels, and a padding mask keeping 8 to 16 tokens of each sample."""
    lengths = torch.randint(seq_len // 2, seq_len + 1, (batch_size, 1))
    mask = (torch.arange(seq_len) < lengths).long()
    return {"ids": torch.randint(0, vocab, (batch_size, seq_len)), "attention_mask": mask,
            "labels": torch.randint(0, vocab, (batch_size, seq_len))}


def loss_fn(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    labels = batch["labels"]
    if labels.max() >= logits.shape[-1]:
        raise ValueError("labels outside the vocabulary")
    keep = batch["attention_mask"].bool()
    return F.cross_entropy(logits[keep], labels[keep])

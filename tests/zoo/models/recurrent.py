"""An LSTM language model that takes token positions, as a user does after autopar's advice to
give context parallelism a ``positions`` argument: its recurrence still reads every earlier
position, so CP must be refused at profile (autopar/trace/sequence.py), not by a numerical check
that only runs on CPU ranks."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, seq_len: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(seq_len, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.position(positions)
        h, _ = self.lstm(h)
        return self.head(h)


def build_model(vocab: int = 64, hidden: int = 32, layers: int = 2, seq_len: int = 16) -> nn.Module:
    return Model(vocab, hidden, layers, seq_len)


def example_batch(batch_size: int, vocab: int = 64, seq_len: int = 16) -> dict:
    tokens = torch.randint(0, vocab, (batch_size, seq_len + 1))
    positions = torch.arange(seq_len).expand(batch_size, seq_len)
    return {"ids": tokens[:, :-1], "positions": positions, "targets": tokens[:, 1:]}


def loss_fn(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())

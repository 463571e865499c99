"""A small MLP language model that centres each block's activations on the batch's mean: every
sample's loss depends on the other samples of its batch, so data-parallel ranks, each seeing
part of the batch, train something else than one process (the numbers differ, nothing
crashes). tests/dist/test_proof.py checks compile's numerical check catches it."""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        x = x - x.mean(dim=0, keepdim=True)
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Model(nn.Module):
    def __init__(self, vocab=64, hidden=32, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model(vocab=64, hidden=32, layers=2):
    return Model(vocab, hidden, layers)


def example_batch(batch_size, vocab=64, seq_len=8):
    return {"tokens": torch.randint(0, vocab, (batch_size, seq_len)),
            "targets": torch.randint(0, vocab, (batch_size, seq_len))}


def loss_fn(output, batch):
    return nn.functional.cross_entropy(output.flatten(0, 1), batch["targets"].flatten())

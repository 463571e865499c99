"""A small MLP language model whose tensor-parallel split crashes at run time, deliberately: a
block whose weight arrives split across ranks raises (as models that reshape by a global width
do). FSDP unshards a block's weights before its forward, so data parallelism, ZeRO and
pipelines train it; tests/dist/test_proof.py checks compile rejects its TP plans."""
import torch
from torch import nn
from torch.distributed.tensor import DTensor


class Block(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        if isinstance(self.up.weight, DTensor) and any(p.is_shard() for p in self.up.weight.placements):
            raise RuntimeError("Block.up was split across ranks: this model cannot run tensor-parallel")
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, vocab=64, hidden=512, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model(vocab=64, hidden=512, layers=2):
    return Model(vocab, hidden, layers)


def example_batch(batch_size, vocab=64, seq_len=16):
    return {"tokens": torch.randint(0, vocab, (batch_size, seq_len)),
            "targets": torch.randint(0, vocab, (batch_size, seq_len))}


def loss_fn(output, batch):
    return nn.functional.cross_entropy(output.flatten(0, 1), batch["targets"].flatten())

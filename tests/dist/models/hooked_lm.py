"""A small language model whose file brings its own data: dataset(split) returns samples that
collate into example_batch's structure (a dict of tokens and next-token labels). The sequences
follow a rule (each token is 3x the previous plus 1, mod the vocabulary, from a random start),
so training on them lowers the loss. ``stream=True`` gives an iterable dataset instead of a
map-style one; ``masked=True`` labels with -100 (not counted by the loss) every target that is a
multiple of 4, so each sample counts a different number of tokens (a token-level loss)."""
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, IterableDataset


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model(vocab: int = 64, hidden: int = 32, layers: int = 4):
    return TinyLM(vocab, hidden, layers)


IGNORED = -100


def labelled(tokens: torch.Tensor, masked: bool) -> dict:
    labels = tokens[..., 1:]
    return {"tokens": tokens[..., :-1], "labels": labels.masked_fill(labels % 4 == 0, IGNORED) if masked else labels}


def example_batch(batch_size: int, seq_len: int = 16, vocab: int = 64, masked: bool = False):
    return labelled(torch.randint(0, vocab, (batch_size, seq_len + 1)), masked)


def loss_fn(logits, batch):
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(0, 1))


def sequence(start: int, length: int, vocab: int) -> torch.Tensor:
    values = [start]
    for _ in range(length):
        values.append((values[-1] * 3 + 1) % vocab)
    return torch.tensor(values)


class RuleSequences(Dataset):
    def __init__(self, count: int, seq_len: int, vocab: int, seed: int, masked: bool = False):
        starts = torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(seed))
        self.samples = [sequence(int(s), seq_len, vocab) for s in starts]
        self.masked = masked

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return labelled(self.samples[index], self.masked)


class RuleStream(IterableDataset):
    """The same samples as a stream; each epoch reverses the order (set_epoch)."""

    def __init__(self, count: int, seq_len: int, vocab: int, seed: int):
        self.inner = RuleSequences(count, seq_len, vocab, seed)
        self.epoch = 0

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __iter__(self):
        order = range(len(self.inner)) if self.epoch % 2 == 0 else reversed(range(len(self.inner)))
        return (self.inner[i] for i in order)


def dataset(split: str, seq_len: int = 16, vocab: int = 64, stream: bool = False, masked: bool = False):
    count, seed = (40, 1) if split == "train" else (16, 2)
    if stream:
        return RuleStream(count, seq_len, vocab, seed)
    return RuleSequences(count, seq_len, vocab, seed, masked)

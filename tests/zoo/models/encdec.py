"""A sequence-to-sequence Transformer written with torch.nn's own layers: an encoder stack and a
decoder stack (two ModuleLists of equal weight), a shared embedding, learned positions."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Seq2Seq(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, seq_len: int, vocab: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq_len, hidden)
        self.encoder = nn.ModuleList(
            nn.TransformerEncoderLayer(hidden, heads, 2 * hidden, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.decoder = nn.ModuleList(
            nn.TransformerDecoderLayer(hidden, heads, 2 * hidden, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, source: torch.Tensor, target_in: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(source.shape[1], device=source.device)
        memory = self.embed(source) + self.pos(positions)
        for layer in self.encoder:
            memory = layer(memory)
        x = self.embed(target_in) + self.pos(positions[: target_in.shape[1]])
        causal = nn.Transformer.generate_square_subsequent_mask(target_in.shape[1], device=x.device)
        for layer in self.decoder:
            x = layer(x, memory, tgt_mask=causal, tgt_is_causal=True)
        return self.head(self.norm(x))


def build_model(layers: int = 2, hidden: int = 32, heads: int = 4, seq_len: int = 16, vocab: int = 64) -> nn.Module:
    return Seq2Seq(layers, hidden, heads, seq_len, vocab)


def example_batch(batch_size: int, seq_len: int = 16, vocab: int = 64) -> dict:
    source = torch.randint(0, vocab, (batch_size, seq_len))
    target = torch.randint(0, vocab, (batch_size, seq_len + 1))
    return {"source": source, "target_in": target[:, :-1], "target_out": target[:, 1:]}


def loss_fn(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), batch["target_out"].flatten())

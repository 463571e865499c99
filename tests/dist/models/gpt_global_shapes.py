"""A GPT whose code views activations by global sizes, as most hand-written GPTs do: attention
reads ``b, s, h = x.shape`` and views by ``self.n_head`` and ``h // self.n_head``, the MLP views
its hidden activation by ``self.ffn``. On one rank's local share these views fail; kept as
DTensors (autopar.solver.tp_global_shapes) they see global shapes and compute on shards."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.n_head = heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q = self.q(x).view(b, s, self.n_head, h // self.n_head).transpose(1, 2)
        k = self.k(x).view(b, s, self.n_head, h // self.n_head).transpose(1, 2)
        v = self.v(x).view(b, s, self.n_head, h // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, s, h))


class MLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.ffn = 4 * hidden
        self.fc = nn.Linear(hidden, self.ffn)
        self.out = nn.Linear(self.ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        return self.out(F.gelu(self.fc(x), approximate="tanh").view(b, s, self.ffn))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, seq_len: int, vocab: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for embedding in (self.wte, self.wpe):
            nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model(layers: int = 2, hidden: int = 32, heads: int = 4, seq_len: int = 16, vocab: int = 64) -> nn.Module:
    return GPT(layers, hidden, heads, seq_len, vocab)


def example_batch(batch_size: int, seq_len: int = 16, vocab: int = 64):
    tokens = torch.randint(0, vocab, (batch_size, seq_len + 1))
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def loss_fn(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(0, 1))

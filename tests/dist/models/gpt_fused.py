"""A GPT with fused projections, as nanoGPT and Llama-style code write them: one ``c_attn =
Linear(h, 3h)`` whose output is ``split(self.n_embd, dim=2)`` into q, k and v (each viewed by
``self.n_head``), and a gate-up MLP ``w12 = Linear(h, 2f)`` whose output is ``chunk(2, dim=-1)``.
Split as fused projections (autopar.codegen.sections.tensor_parallel.FusedColwiseParallel),
each rank holds its heads' rows of every part; the checkpoint keeps the fused layout."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.n_head, self.n_embd = heads, hidden
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(b, s, self.n_head, h // self.n_head).transpose(1, 2)
        k = k.view(b, s, self.n_head, h // self.n_head).transpose(1, 2)
        v = v.view(b, s, self.n_head, h // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, s, h))


class GatedMLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.w12 = nn.Linear(hidden, 2 * 2 * hidden, bias=False)
        self.w3 = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = GatedMLP(hidden)

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

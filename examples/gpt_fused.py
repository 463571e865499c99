"""The GPT of examples/gpt.py written as Megatron-LM, nanoGPT and minGPT write attention: one fused
``c_attn`` projection for q, k and v, cut by ``split(hidden, dim=2)``, then viewed by the global
head count (``view(b, s, self.heads, hidden // self.heads)``). Tensor parallelism splits it as its
parts: each rank holds its heads' rows of q, k and v (autopar.solver.tp_fused). ``logits_fp32``
returns the logits in fp32, so the loss is computed in fp32, as examples/gpt.py's does.

    autopar plan examples/gpt_fused.py model.layers=24 model.hidden=2048 model.heads=16 plan.tp=4
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        self.heads = heads
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.c_attn(x).split(hidden, dim=2)
        shape = (batch, seq, self.heads, hidden // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(batch, seq, hidden))


class MLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc_in = nn.Linear(hidden, 4 * hidden)
        self.fc_out = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x), approximate="tanh"))


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
    def __init__(self, layers: int, hidden: int, heads: int, seq_len: int, vocab: int, logits_fp32: bool = False):
        super().__init__()
        self.logits_fp32 = logits_fp32
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2
        for embedding in (self.wte, self.wpe):  # GPT-2's scale: unit-variance logits start near ln(vocab)
            nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        # Positions are an argument so context parallelism can give each rank its tokens' places.
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits.float() if self.logits_fp32 else logits


def build_model(layers: int = 4, hidden: int = 256, heads: int = 4, seq_len: int = 128,
                vocab: int = 1024, logits_fp32: bool = False) -> nn.Module:
    return GPT(layers, hidden, heads, seq_len, vocab, logits_fp32)


def example_batch(batch_size: int, seq_len: int = 128, vocab: int = 1024):
    tokens = torch.randint(0, vocab, (batch_size, seq_len + 1))
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def loss_fn(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(0, 1))

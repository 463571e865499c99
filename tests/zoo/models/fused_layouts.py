"""A GPT written the ways people write attention and MLPs, one ``layout`` at a time:

- ``split``: one ``qkv`` projection cut by ``split([h, kv*d, kv*d], dim=-1)`` (Megatron,
  nanoGPT, Llama-style grouped query attention, unequal parts), views by ``-1`` heads, and a fused
  ``gate_up`` projection cut by ``chunk(2, dim=-1)`` (Phi-3, many Llama ports);
- ``interleaved``: GPT-NeoX's per-head interleaved ``qkv`` (``view(b, s, heads, 3 * d)`` then
  ``chunk(3, dim=-1)``), viewed by the global head count;
- ``global_views``: the fused ``qkv`` cut by ``split(h, dim=2)`` after ``b, s, h = x.shape``, then
  viewed by ``self.heads`` and ``h // self.heads`` (global sizes), with the fused gate-up MLP.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, layout: str):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.layout = heads, kv_heads, hidden // heads, layout
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        d = self.head_dim
        if self.layout == "split":
            q, k, v = self.qkv(x).split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
            q, k, v = (t.view(b, s, -1, d).transpose(1, 2) for t in (q, k, v))
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        elif self.layout == "interleaved":
            qkv = self.qkv(x).view(b, s, self.heads, 3 * d)
            q, k, v = (t.transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        else:
            q, k, v = self.qkv(x).split(h, dim=2)
            q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class GatedMLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * 2 * hidden, bias=False)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class MLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.out = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, layout: str):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, kv_heads, layout)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden) if layout == "interleaved" else GatedMLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, seq_len: int, vocab: int, layout: str):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, kv_heads, layout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model(layout: str = "split", layers: int = 2, hidden: int = 64, heads: int = 8, kv_heads: int | None = None,
                seq_len: int = 16, vocab: int = 64) -> nn.Module:
    kv_heads = (heads // 2 if layout == "split" else heads) if kv_heads is None else kv_heads
    if layout not in ("split", "interleaved", "global_views") or (layout != "split" and kv_heads != heads):
        raise ValueError(f"layout {layout!r} with {kv_heads} key/value heads of {heads}: "
                         "split (any kv_heads), interleaved or global_views (kv_heads == heads)")
    return GPT(layers, hidden, heads, kv_heads, seq_len, vocab, layout)


def example_batch(batch_size: int, seq_len: int = 16, vocab: int = 64) -> dict:
    tokens = torch.randint(0, vocab, (batch_size, seq_len + 1))
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def loss_fn(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(0, 1))

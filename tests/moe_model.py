"""A tiny mixture-of-experts decoder in plain torch, for expert-parallel tests.

Each block's feed-forward is a router, top-k choice and E experts whose weights are stacked
[E, ...] under a module named `experts` (what cost_models.expert_parallel recognises). Tokens
are dispatched GShard-style with static shapes (Lepikhin et al. 2020): each sequence gives every
expert `capacity` slots, each (token, choice) is copied into its expert's next slot of the
experts' input [E, b·C, h] (index_copy; choices over capacity are dropped), and the outputs are
gathered back and weighted by the gates. Shapes never depend on the routing, so the model traces
on fake tensors, and the experts' input is what an expert-parallel group exchanges by
all-to-all.

The auxiliary load-balancing loss is Switch's E · Σ_e f_e · P_e computed per sequence and
averaged (DeepSeek-V3's sequence-wise form): linear in the samples, so a data-parallel run
averages to the one-process value. Variants: `shared_ffn` adds an always-on shared expert
(Qwen2-MoE), many small experts with top-k > 2 and `kv_lora_rank` > 0 (multi-head latent
attention in place of the fused attention) give a DeepSeek-V3-like shape, and `aux_loss=False`
drops the auxiliary loss, so blocks hand on the residual stream alone and a pipeline cuts the
model by modules (with it, the running loss read by every block makes codegen cut stages from an
exported graph).

    autopar profile tests/moe_model.py model.experts=8 model.top_k=2
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

AUX_LOSS_WEIGHT = 0.01


class Experts(nn.Module):
    """E two-layer feed-forward experts, weights stacked on dim 0: input [E, tokens, h]."""

    def __init__(self, experts: int, hidden: int, ffn: int):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(experts, hidden, ffn) * 0.02)
        self.w_out = nn.Parameter(torch.randn(experts, ffn, hidden) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(F.gelu(torch.bmm(x, self.w_in), approximate="tanh"), self.w_out)


class MoE(nn.Module):
    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, capacity_factor: float, shared_ffn: int):
        super().__init__()
        self.num_experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = Experts(experts, hidden, ffn)
        self.shared = nn.Sequential(nn.Linear(hidden, shared_ffn), nn.GELU(approximate="tanh"),
                                    nn.Linear(shared_ffn, hidden)) if shared_ffn else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq, hidden = x.shape
        e, k = self.num_experts, self.top_k
        capacity = max(1, math.ceil(self.capacity_factor * seq * k / e))
        probs = F.softmax(self.router(x).float(), dim=-1)  # [b, s, E]
        gates, chosen = probs.topk(k, dim=-1)  # [b, s, k]
        gates = (gates / gates.sum(-1, keepdim=True)).to(x.dtype)
        # Each (token, choice) takes the next slot of its expert's queue, first choices first:
        # its rank among the sequence's choices of that expert (a stable sort by expert).
        ids = chosen.transpose(1, 2).reshape(batch, k * seq)  # [b, k·s], choice-major
        counts = torch.zeros(batch, e, dtype=torch.long, device=x.device).scatter_add_(1, ids, torch.ones_like(ids))
        order = torch.sort(ids, dim=1, stable=True).indices
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(k * seq, device=x.device).expand(batch, -1))
        slot = rank - (counts.cumsum(1) - counts).gather(1, ids)
        # Row of the experts' input [E, b, C] each choice fills; a choice over capacity is dropped
        # into one spare row past the end.
        sample = torch.arange(batch, device=x.device)[:, None]
        row = torch.where(slot < capacity, (ids * batch + sample) * capacity + slot, e * batch * capacity)
        tokens = x.repeat(1, k, 1).reshape(batch * k * seq, hidden)  # choice-major, like ids
        expert_in = x.new_zeros(e * batch * capacity + 1, hidden).index_copy(0, row.flatten(), tokens)
        expert_out = self.experts(expert_in[:-1].view(e, batch * capacity, hidden))
        out = torch.cat([expert_out.reshape(e * batch * capacity, hidden), x.new_zeros(1, hidden)])
        picked = out.index_select(0, row.flatten()).view(batch, k, seq, hidden)
        y = (picked * gates.permute(0, 2, 1)[..., None]).sum(1)
        if self.shared is not None:
            y = y + self.shared(x)
        routed = counts.float() / (k * seq)  # f_e per sequence
        aux = (e * (routed * probs.mean(1)).sum(-1)).mean()
        return y, aux


def rotate(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x [b, s, heads, d] (Su et al. 2021), pairing each dim of the
    first half with its partner in the second."""
    half = x.shape[-1] // 2
    inv_freq = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)[:, None] * inv_freq  # [s, d/2]
    cos, sin = angles.cos()[:, None].to(x.dtype), angles.sin()[:, None].to(x.dtype)  # [s, 1, d/2]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class MLA(nn.Module):
    """Multi-head latent attention (DeepSeek-V2, Liu et al. 2024, section 2.1): keys and values
    come from one low-rank latent of the token, c = RMSNorm(W_kv_a x), up-projected per head by
    W_kv_b; each query and key also carries a decoupled rotary part, the key's shared by all heads
    and computed from x beside the latent (eq. 14-19). Queries are projected directly (DeepSeek-V2-
    Lite's form, without the query's own low-rank compression)."""

    def __init__(self, hidden: int, heads: int, kv_lora_rank: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.rope_dim, self.kv_lora_rank = self.head_dim // 2, kv_lora_rank
        self.wq = nn.Linear(hidden, heads * (self.head_dim + self.rope_dim), bias=False)
        self.wkv_a = nn.Linear(hidden, kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = nn.RMSNorm(kv_lora_rank)
        self.wkv_b = nn.Linear(kv_lora_rank, heads * 2 * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 for the head counts keeps the module correct when tensor parallelism gives each rank
        # a slice of the heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim + self.rope_dim)
        q_nope, q_pe = torch.split(q, [self.head_dim, self.rope_dim], dim=-1)
        kv, k_pe = torch.split(self.wkv_a(x), [self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv)).view(batch, seq, -1, 2 * self.head_dim)
        k_nope, v = torch.split(kv, [self.head_dim, self.head_dim], dim=-1)
        k_pe = rotate(k_pe.unsqueeze(2)).expand(-1, -1, k_nope.shape[2], -1)
        q = torch.cat([q_nope, rotate(q_pe)], dim=-1).transpose(1, 2)
        k = torch.cat([k_nope, k_pe], dim=-1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, experts: int, top_k: int, capacity_factor: float,
                 shared_ffn: int, kv_lora_rank: int = 0):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(hidden)
        if kv_lora_rank:
            self.attn = MLA(hidden, heads, kv_lora_rank)
        else:
            self.qkv = nn.Linear(hidden, 3 * hidden)
            self.proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden)
        self.moe = MoE(hidden, ffn, experts, top_k, capacity_factor, shared_ffn)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "attn"):
            return self.attn(x)
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, hidden))

    def forward(self, x: torch.Tensor, aux: torch.Tensor | None = None):
        """(residual stream, running aux loss), or the residual stream alone without an aux loss."""
        x = x + self.attention(self.ln_1(x))
        y, block_aux = self.moe(self.ln_2(x))
        return x + y if aux is None else (x + y, aux + block_aux)


class MoEDecoder(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, experts: int, top_k: int,
                 capacity_factor: float, shared_ffn: int, seq_len: int, vocab: int, aux_loss: bool = True,
                 kv_lora_rank: int = 0):
        super().__init__()
        self.aux_loss = aux_loss
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, ffn, experts, top_k, capacity_factor, shared_ffn,
                                          kv_lora_rank) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        if not self.aux_loss:
            for block in self.blocks:
                x = block(x)
            return self.lm_head(self.ln_f(x)), x.new_zeros((), dtype=torch.float32)
        aux = x.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            x, aux = block(x, aux)
        return self.lm_head(self.ln_f(x)), aux


def build_model(layers: int = 2, hidden: int = 64, heads: int = 4, ffn: int = 128, experts: int = 4, top_k: int = 2,
                capacity_factor: float = 2.0, shared_ffn: int = 0, seq_len: int = 32, vocab: int = 256,
                aux_loss: bool = True, kv_lora_rank: int = 0) -> nn.Module:
    """`kv_lora_rank` > 0: multi-head latent attention with a key/value latent of that width."""
    return MoEDecoder(layers, hidden, heads, ffn, experts, top_k, capacity_factor, shared_ffn, seq_len, vocab,
                      aux_loss, kv_lora_rank)


def example_batch(batch_size: int, seq_len: int = 32, vocab: int = 256):
    tokens = torch.randint(0, vocab, (batch_size, seq_len + 1))
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def loss_fn(output: tuple[torch.Tensor, torch.Tensor], batch: dict) -> torch.Tensor:
    logits, aux = output
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(0, 1)) + AUX_LOSS_WEIGHT * aux

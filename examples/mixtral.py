"""A Mixtral-style mixture-of-experts decoder written in plain torch.nn, the way a user would
write one: RMSNorm, grouped-query attention, and in every block a router choosing the top-k of E
SwiGLU experts for each token, with Switch's load-balancing loss.

The experts' weights are stacked by expert, [E, ...], in a module named ``experts`` whose
forward takes the tokens already grouped by expert, [E, tokens, hidden]: what autopar recognises
as experts and can shard over an expert-parallel group (``plan.ep``). Tokens are grouped with
static shapes, GShard's dense dispatch (Lepikhin et al. 2020, section 2.2): each sequence gives
every expert ``capacity`` slots (capacity_factor x its fair share of the choices), choices past
an expert's capacity are dropped, and one-hot dispatch and combine tensors move the tokens in
and out by einsum. Shapes never depend on the routing, so the model traces on fake tensors.

Size comes from keyword arguments (Hydra overrides ``model.<name>=<value>``); Mixtral-8x7B's
shape (without its sliding window) is

    autopar profile examples/mixtral.py model.layers=32 model.hidden=4096 model.heads=32 \\
        model.kv_heads=8 model.ffn=14336 model.experts=8 model.top_k=2 model.vocab=32000 model.seq_len=4096
    autopar compile examples/mixtral.py cluster=cpu_gloo cluster.gpus_per_node=2 plan.ep=2
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

AUX_LOSS_WEIGHT = 0.02  # Mixtral's router_aux_loss_coef


class Attention(nn.Module):
    """Causal grouped-query attention: kv_heads key/value heads shared by heads / kv_heads queries."""

    def __init__(self, hidden: int, heads: int, kv_heads: int):
        super().__init__()
        if hidden % heads or heads % kv_heads:
            raise ValueError(f"hidden ({hidden}) must divide by heads ({heads}), heads by kv_heads ({kv_heads})")
        self.head_dim, self.groups = hidden // heads, heads // kv_heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 for the head counts keeps the module correct when tensor parallelism gives each rank
        # a slice of the heads.
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k, v = k.repeat_interleave(self.groups, dim=1), v.repeat_interleave(self.groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, -1))


class Experts(nn.Module):
    """E SwiGLU feed-forward experts, weights stacked on dim 0: input and output [E, tokens, hidden]."""

    def __init__(self, experts: int, hidden: int, ffn: int):
        super().__init__()
        self.w_gate = nn.Parameter(torch.randn(experts, hidden, ffn) / math.sqrt(hidden))
        self.w_up = nn.Parameter(torch.randn(experts, hidden, ffn) / math.sqrt(hidden))
        self.w_down = nn.Parameter(torch.randn(experts, ffn, hidden) / math.sqrt(ffn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(F.silu(torch.bmm(x, self.w_gate)) * torch.bmm(x, self.w_up), self.w_down)


class SparseMoE(nn.Module):
    """Router, top-k choice and experts; returns the layer's output and its load-balancing loss."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, capacity_factor: float):
        super().__init__()
        self.num_experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = Experts(experts, hidden, ffn)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq, hidden = x.shape
        e, k = self.num_experts, self.top_k
        capacity = max(1, math.ceil(self.capacity_factor * seq * k / e))
        probs = F.softmax(self.router(x).float(), dim=-1)  # [b, s, E]
        gates, chosen = probs.topk(k, dim=-1)  # [b, s, k]
        gates = gates / gates.sum(-1, keepdim=True)  # Mixtral renormalises the top-k weights
        # Choice-major order (every token's first choice before any second choice), so first
        # choices take an expert's slots first: [b, k·s, E].
        mask = F.one_hot(chosen.transpose(1, 2).reshape(batch, k * seq), e)
        slot = mask.cumsum(1) * mask - 1  # each choice's place in its expert's queue (-1: not this expert)
        kept = (slot >= 0) & (slot < capacity)
        dispatch = F.one_hot(slot.clamp(0, capacity - 1), capacity) * kept[..., None]  # [b, k·s, E, C]
        tokens = x.repeat(1, k, 1)  # [b, k·s, h], choice-major like the mask
        expert_in = torch.einsum("bnec,bnh->ebch", dispatch.to(x.dtype), tokens).reshape(e, batch * capacity, hidden)
        expert_out = self.experts(expert_in).view(e, batch, capacity, hidden)
        weights = dispatch.to(x.dtype) * gates.transpose(1, 2).reshape(batch, k * seq, 1, 1).to(x.dtype)
        y = torch.einsum("bnec,ebch->bnh", weights, expert_out).view(batch, k, seq, hidden).sum(1)
        # Switch's load-balancing loss E · Σ_e f_e · P_e (Fedus et al. 2021, eq. 4), per sequence
        # and averaged: linear in the samples, so data-parallel ranks average to the batch's value.
        routed = mask.float().mean(1)  # f_e: the share of the sequence's choices routed to e
        aux = (e * (routed * probs.mean(1)).sum(-1)).mean()
        return y, aux


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int, experts: int, top_k: int,
                 capacity_factor: float):
        super().__init__()
        self.attn_norm = RMSNorm(hidden)
        self.attn = Attention(hidden, heads, kv_heads)
        self.moe_norm = RMSNorm(hidden)
        self.moe = SparseMoE(hidden, ffn, experts, top_k, capacity_factor)

    def forward(self, x: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.attn_norm(x))
        y, block_aux = self.moe(self.moe_norm(x))
        return x + y, aux + block_aux  # the running load-balancing loss travels with the residual stream


class Mixtral(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, experts: int, top_k: int,
                 capacity_factor: float, seq_len: int, vocab: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq_len, hidden)  # learned positions keep the example short (Mixtral: RoPE)
        self.layers = nn.ModuleList(Block(hidden, heads, kv_heads, ffn, experts, top_k, capacity_factor)
                                    for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        aux = x.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            x, aux = layer(x, aux)
        return self.lm_head(self.norm(x)), aux / len(self.layers)


def build_model(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, ffn: int = 128,
                experts: int = 4, top_k: int = 2, capacity_factor: float = 2.0, seq_len: int = 32,
                vocab: int = 256) -> nn.Module:
    return Mixtral(layers, hidden, heads, kv_heads, ffn, experts, top_k, capacity_factor, seq_len, vocab)


def example_batch(batch_size: int, seq_len: int = 32, vocab: int = 256):
    tokens = torch.randint(0, vocab, (batch_size, seq_len + 1))
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def loss_fn(output: tuple[torch.Tensor, torch.Tensor], batch: dict) -> torch.Tensor:
    logits, aux = output
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(0, 1)) + AUX_LOSS_WEIGHT * aux

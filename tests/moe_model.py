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
(Qwen2-MoE), many small experts with top-k > 2 give a DeepSeek-V3-like shape, and
`aux_loss=False` drops the auxiliary loss, so blocks hand on the residual stream alone and a
pipeline cuts the model by modules (with it, the running loss read by every block makes codegen
cut stages from an exported graph).

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


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, experts: int, top_k: int, capacity_factor: float,
                 shared_ffn: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden)
        self.moe = MoE(hidden, ffn, experts, top_k, capacity_factor, shared_ffn)

    def forward(self, x: torch.Tensor, aux: torch.Tensor | None = None):
        """(residual stream, running aux loss), or the residual stream alone without an aux loss."""
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(batch, seq, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, seq, hidden))
        y, block_aux = self.moe(self.ln_2(x))
        return x + y if aux is None else (x + y, aux + block_aux)


class MoEDecoder(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, experts: int, top_k: int,
                 capacity_factor: float, shared_ffn: int, seq_len: int, vocab: int, aux_loss: bool = True):
        super().__init__()
        self.aux_loss = aux_loss
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, ffn, experts, top_k, capacity_factor, shared_ffn)
                                    for _ in range(layers))
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
                aux_loss: bool = True) -> nn.Module:
    return MoEDecoder(layers, hidden, heads, ffn, experts, top_k, capacity_factor, shared_ffn, seq_len, vocab,
                      aux_loss)


def example_batch(batch_size: int, seq_len: int = 32, vocab: int = 256):
    tokens = torch.randint(0, vocab, (batch_size, seq_len + 1))
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def loss_fn(output: tuple[torch.Tensor, torch.Tensor], batch: dict) -> torch.Tensor:
    logits, aux = output
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(0, 1)) + AUX_LOSS_WEIGHT * aux

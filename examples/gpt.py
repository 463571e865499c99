"""A GPT-2-style decoder written in plain torch.nn, the way a user would write one.

Size comes from keyword arguments (Hydra overrides ``model.<name>=<value>``):

    autopar profile examples/gpt.py model.layers=24 model.hidden=2048 model.heads=16

``attention=unfused`` writes attention as Megatron-LM did before fused attention kernels (2021-22,
the runs of its papers): every query's scores against every key in one batched matmul, a softmax
over them, dropout on the probabilities, a second batched matmul. ``attention_dropout`` is the rate
of that dropout, ``hidden_dropout`` the one on each block's two residual branches (Megatron-LM's
defaults are 0.1 for both). ``logits_fp32`` returns the logits in fp32, so the loss is computed in
fp32 as Megatron-LM computes it (its GPT casts the logits with ``.float()`` before the cross-entropy
unless ``--fp16-lm-cross-entropy``; Megatron-Core's vocab-parallel cross-entropy casts them itself).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


ATTENTION_KINDS = ("sdpa", "unfused")


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, fused_qkv: bool = False, attention: str = "sdpa",
                 attention_dropout: float = 0.0):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_KINDS)}, not {attention!r}")
        self.heads = heads
        self.attention = attention
        self.dropout = attention_dropout
        if fused_qkv:  # one [3h, h] projection, as Megatron-LM's GPT holds it
            self.qkv_proj = nn.Linear(hidden, 3 * hidden)
        else:
            self.q_proj = nn.Linear(hidden, hidden)
            self.k_proj = nn.Linear(hidden, hidden)
            self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        # -1 for the head count keeps the module correct when tensor parallelism gives each
        # rank only a slice of the heads.
        shape = (batch, seq, -1, hidden // self.heads)
        if hasattr(self, "qkv_proj"):
            q, k, v = (part.view(shape).transpose(1, 2) for part in self.qkv_proj(x).chunk(3, dim=-1))
        else:
            q = self.q_proj(x).view(shape).transpose(1, 2)
            k = self.k_proj(x).view(shape).transpose(1, 2)
            v = self.v_proj(x).view(shape).transpose(1, 2)
        if self.attention == "unfused":
            y = self._unfused(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(y.transpose(1, 2).reshape(batch, seq, -1))

    def _unfused(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Scores of every query against every key (the causal mask added by the same matmul,
        as a -inf bias above the diagonal), softmax, dropout, then the weighted values."""
        batch, heads, seq, head_dim = q.shape

        def heads_first(x: torch.Tensor) -> torch.Tensor:
            # Heads outermost in the merged dimension, so a split of the heads is a split of it.
            return x.transpose(0, 1).reshape(heads * batch, seq, head_dim)

        mask = torch.full((seq, seq), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
        scores = torch.baddbmm(mask, heads_first(q), heads_first(k).transpose(1, 2), alpha=head_dim ** -0.5)
        probs = F.dropout(scores.softmax(dim=-1), self.dropout, self.training)
        return torch.bmm(probs, heads_first(v)).view(heads, batch, seq, head_dim).transpose(0, 1)


class MLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc_in = nn.Linear(hidden, 4 * hidden)
        self.fc_out = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, fused_qkv: bool = False, attention: str = "sdpa",
                 attention_dropout: float = 0.0, hidden_dropout: float = 0.0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads, fused_qkv, attention, attention_dropout)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)
        self.dropout = hidden_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._residual(self.attn(self.ln_1(x)))
        return x + self._residual(self.mlp(self.ln_2(x)))

    def _residual(self, branch: torch.Tensor) -> torch.Tensor:
        return F.dropout(branch, self.dropout, self.training) if self.dropout else branch


class GPT(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, seq_len: int, vocab: int, fused_qkv: bool = False,
                 attention: str = "sdpa", attention_dropout: float = 0.0, hidden_dropout: float = 0.0,
                 logits_fp32: bool = False):
        super().__init__()
        self.logits_fp32 = logits_fp32
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, fused_qkv, attention, attention_dropout, hidden_dropout)
                                    for _ in range(layers))
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
                vocab: int = 1024, fused_qkv: bool = False, attention: str = "sdpa", attention_dropout: float = 0.0,
                hidden_dropout: float = 0.0, logits_fp32: bool = False) -> nn.Module:
    return GPT(layers, hidden, heads, seq_len, vocab, fused_qkv, attention, attention_dropout, hidden_dropout,
               logits_fp32)


def example_batch(batch_size: int, seq_len: int = 128, vocab: int = 1024):
    tokens = torch.randint(0, vocab, (batch_size, seq_len + 1))
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def loss_fn(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(0, 1))

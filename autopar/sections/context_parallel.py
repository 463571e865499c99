"""Context parallelism: each rank of a CP group holds part of every sequence; attention sees all of it.

Sharding (load-balanced for causal attention): a sequence of S tokens is cut into 2·cp chunks
and CP rank i keeps chunks i and 2·cp-1-i, so every rank gets the same share of the causal
triangle's work. Every [batch, sequence] tensor of the batch is sharded this way and the model
receives the global positions of its tokens (its `position_ids` / `positions` argument).

Attention (``scaled_dot_product_attention`` replaced while training runs) by one of two
strategies the planner chose:
    ulysses  head partition (Jacobs et al. 2023): an all-to-all turns [heads, local tokens]
             into [heads/cp, all tokens]; ordinary causal attention runs on those heads; a
             second all-to-all turns the output back. Needs heads % cp == 0.
    ring     (Liu et al. 2023): K/V blocks travel around the CP ring (p2p, the next block's
             transfer overlapping this block's attention); each rank merges the blockwise
             softmax results of its queries with log-sum-exp, masking by global position.
Gradients flow through differentiable collectives (the ring pass sends gradients back the other
way); parameter gradients are averaged over data- x context-parallel ranks by FSDP.
The PyTorch context-parallel API dispatches only CUDA attention kernels, so these two are
written on plain tensor ops that run on gloo/CPU as well as NCCL/CUDA.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.utils.checkpoint import checkpoint as rerun_in_backward

from autopar.sections.recompute import never_kept_by_selective


def chunk_order(cp: int) -> list[int]:
    """Global chunk indices in the order the CP ranks hold them: rank i has (i, 2cp-1-i)."""
    return [c for i in range(cp) for c in (i, 2 * cp - 1 - i)]


def local_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Global positions of this rank's tokens (its two chunks, in order)."""
    chunk = seq_len // (2 * cp)
    first, second = cp_rank, 2 * cp - 1 - cp_rank
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk),
                      torch.arange(second * chunk, (second + 1) * chunk)])


def shard_sequence(batch: Any, seq_len: int, cp: int, cp_rank: int, position_argument: str | None,
                   mask_argument: str | None = None) -> Any:
    """This CP rank's share of a dict batch: every [batch, seq_len, ...] tensor keeps this rank's
    tokens, and the global positions are added under ``position_argument``. A model taking a
    padding mask gets an all-ones one when the batch has none: Hugging Face models otherwise read
    the jump in positions between a rank's two chunks as two packed sequences."""
    if not isinstance(batch, dict):
        raise TypeError("context parallelism needs example_batch() to return a dict of tensors")
    index = local_positions(seq_len, cp, cp_rank)
    sharded = {key: value.index_select(1, index.to(value.device))
               if torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] == seq_len else value
               for key, value in batch.items()}
    if position_argument is not None:
        rows = next(v.shape[0] for v in batch.values() if torch.is_tensor(v))
        sharded[position_argument] = index.unsqueeze(0).expand(rows, -1).contiguous()
    if mask_argument is not None and mask_argument not in sharded:
        rows = next(v.shape[0] for v in batch.values() if torch.is_tensor(v))
        sharded[mask_argument] = torch.ones(rows, index.numel(), dtype=torch.long)
    return sharded


class _RingPass(torch.autograd.Function):
    """Send a tensor to the next CP rank and receive the previous rank's (started, not waited:
    the caller waits after computing on the block it has). Backward sends gradients the other way."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup, pending: list) -> torch.Tensor:
        ctx.group = group
        received = torch.empty_like(tensor)
        pending.extend(_exchange(tensor.contiguous(), received, group, forward=True))
        return received

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        received = torch.empty_like(grad)
        for work in _exchange(grad.contiguous(), received, ctx.group, forward=False):
            work.wait()
        return received, None, None


def _exchange(send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup, forward: bool) -> list:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    to, source = ((rank + 1) % size, (rank - 1) % size) if forward else ((rank - 1) % size, (rank + 1) % size)
    ops = [dist.P2POp(dist.isend, send, dist.get_global_rank(group, to), group),
           dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, source), group)]
    return dist.batch_isend_irecv(ops)


def _block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_pos: torch.Tensor,
                     key_pos: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of the local queries over one K/V block, and its log-sum-exp per query
    (what merging blocks needs). ``key_pos`` masks keys after each query (None: no mask)."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if key_pos is not None:
        # A large finite negative (not -inf): a row with no visible key in this block gets
        # weight exp(-huge) = 0 in the merge instead of NaN.
        scores = scores.masked_fill(query_pos[:, None] < key_pos[None, :], torch.finfo(scores.dtype).min / 2)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(scores - lse), v), lse


# The most fp32 score bytes one attention tile materialises (the cost model prices the same).
RING_TILE_SCORE_BYTES = 256 * 2**20


def _tiled_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_pos: torch.Tensor,
                           key_pos: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One K/V block's attention in query tiles whose scores fit RING_TILE_SCORE_BYTES, each
    recomputed in backward: kept, a block's scores make attention memory quadratic in the
    sequence (Llama-3-70B at 8192 tokens, cp 2: 343 GiB per rank, measured on fake tensors);
    this way a rank keeps its blocks' outputs and log-sum-exps, and one tile's scores at a time."""
    batch, heads, queries, _ = q.shape
    rows = max(1, RING_TILE_SCORE_BYTES // (4 * batch * heads * k.shape[-2]))
    tiles = [rerun_in_backward(_block_attention, q[:, :, start:start + rows], k, v, query_pos[start:start + rows],
                               key_pos, scale, use_reentrant=False)
             for start in range(0, queries, rows)]
    if len(tiles) == 1:
        return tiles[0]
    return torch.cat([out for out, _ in tiles], dim=2), torch.cat([lse for _, lse in tiles], dim=2)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, seq_len: int,
                   causal: bool, scale: float | None) -> torch.Tensor:
    """Attention of local queries over every rank's keys, block by block around the ring."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    dtype = q.dtype
    q, k, v = q.float(), k.float(), v.float()
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each K/V head serves several queries
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    query_pos = local_positions(seq_len, cp, rank).to(q.device)
    block = torch.stack([k, v])
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    for step in range(cp):
        pending: list = []
        following = _RingPass.apply(block, group, pending) if step < cp - 1 else None
        owner = (rank - step) % cp
        key_pos = local_positions(seq_len, cp, owner).to(q.device) if causal else None
        block_out, block_lse = _tiled_block_attention(q, block[0], block[1], query_pos, key_pos, scale)
        if out is None or lse is None:
            out, lse = block_out, block_lse
        else:
            merged = torch.logaddexp(lse, block_lse)
            out = out * torch.exp(lse - merged) + block_out * torch.exp(block_lse - merged)
            lse = merged
        for work in pending:
            work.wait()
        if following is not None:  # the last step passes nothing on
            block = following
    assert out is not None  # cp >= 1 blocks were attended
    return out.to(dtype)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, seq_len: int,
                      causal: bool, scale: float | None, attention: Any) -> torch.Tensor:
    """All-to-all to head-sharded full sequences, ordinary attention, all-to-all back."""
    cp = dist.get_world_size(group)
    order = torch.tensor(chunk_order(cp), device=q.device)
    to_global = torch.argsort(order)  # position in rank order -> chunk in global order

    def gather_sequence(t: torch.Tensor) -> torch.Tensor:
        batch, heads, local, dim = t.shape
        if heads % cp:
            raise ValueError(f"Ulysses needs the local heads ({heads}) divisible by cp ({cp})")
        parts = t.reshape(batch, cp, heads // cp, local, dim).transpose(0, 1).contiguous()
        received = wait_tensor(all_to_all_single_autograd(parts, None, None, group))
        chunks = received.reshape(cp, batch, heads // cp, 2, local // 2, dim).permute(1, 2, 0, 3, 4, 5)
        chunks = chunks.reshape(batch, heads // cp, 2 * cp, local // 2, dim)
        return chunks.index_select(2, to_global).reshape(batch, heads // cp, cp * local, dim)

    def scatter_sequence(t: torch.Tensor, local: int) -> torch.Tensor:
        batch, heads, _, dim = t.shape
        chunks = t.reshape(batch, heads, 2 * cp, local // 2, dim).index_select(2, order)
        parts = chunks.reshape(batch, heads, cp, local, dim).permute(2, 0, 1, 3, 4).contiguous()
        received = wait_tensor(all_to_all_single_autograd(parts, None, None, group))
        return received.permute(1, 0, 2, 3, 4).reshape(batch, heads * cp, local, dim)

    local = q.shape[2]
    full = attention(gather_sequence(q), gather_sequence(k), gather_sequence(v), is_causal=causal, scale=scale,
                     enable_gqa=k.shape[1] != q.shape[1])
    return scatter_sequence(full, local)


def is_local_causal_mask(mask: torch.Tensor, queries: int, keys: int) -> bool:
    """Whether a mask is the plain causal mask over this rank's tokens (Hugging Face models
    build one from the local sequence length): under CP it stands for causal attention over the
    global positions."""
    if mask.shape[-2:] != (queries, keys):
        return False
    if is_fake(mask):  # a memory check on fake tensors (no values): take it for the mask it stands for
        return True
    allowed = mask if mask.dtype == torch.bool else mask == 0
    causal = torch.ones(queries, keys, dtype=torch.bool, device=mask.device).tril()
    return bool((allowed == causal).all())


@contextlib.contextmanager
def context_parallel_attention(group: dist.ProcessGroup, strategy: str, seq_len: int) -> Iterator[None]:
    """Replace ``F.scaled_dot_product_attention`` with the CP strategy while training runs
    (forward, recomputation in backward, and backward all see it)."""
    original = F.scaled_dot_product_attention

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None and is_local_causal_mask(attn_mask, query.shape[2], key.shape[2]):
            attn_mask, is_causal = None, True  # a causal mask built for the local tokens means causal
        if query.is_meta:  # a pipeline stage inferring shapes: local attention has the output's shape
            return original(query, key, value, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        if attn_mask is not None or dropout_p:
            raise ValueError("context parallelism supports causal or full attention without another mask "
                             "or dropout (call scaled_dot_product_attention with is_causal=True)")
        if strategy == "ulysses":
            return ulysses_attention(query, key, value, group, seq_len, is_causal, scale, original)
        with never_kept_by_selective():
            return ring_attention(query, key, value, group, seq_len, is_causal, scale)

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original

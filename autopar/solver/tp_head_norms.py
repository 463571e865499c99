"""Norms over each attention head's features, run on the rank's heads.

Qwen3 and Gemma-3 normalise queries and keys per head (``q_norm``, ``k_norm``: an RMSNorm over
``head_dim`` of the ``[batch, seq, heads, head_dim]`` view of q_proj's output). Everything such a
norm computes stays inside one head, so on a column-parallel projection's head shards it runs
on the rank's heads unchanged; only its weight sees every head, and its gradient on each rank is
the sum over that rank's heads: partial. Treated as needing whole activations (as a norm over
the hidden features would), the norm made the solver gather q and k before it: attention
unpaired, every projection column-parallel with its output gathered, and at tp above the
key/value heads, the key/value projections whole (Qwen3: 89% of the block parameters split at
tp=4, 80% of the FLOPs).

Design: the norm keeps its weight whole on every rank as a replicated DTensor and reads the
rank's heads as a DTensor sharded along a dim other than the normalised one (``HeadNorm``,
autopar/sections/tensor_parallel.py); torch's DTensor turns the weight's partial
gradient into the whole one with an all-reduce over the TP group in each backward, the same
mechanism that sums a sequence-parallel norm's gradient. Its output goes back to a local tensor,
as the region's other ops expect.

Price (autopar.solver.intra_op's ``head_norm`` strategy): the norm's work divides by tp, and each
micro-batch one all-reduce of each of its parameters' gradients (fp32 bytes) in backward.

Where it applies: a forward reduction or norm over only the last dim of a tensor of 4 or more
dims whose last dim is the attention's head_dim and whose second-to-last or second dim is its
query or key/value head count, in a module whose parameters are all its own vectors of head_dim
(a per-head norm module; a functional norm in the attention's code is left to need whole
activations, as before).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autopar.model_profile import ModelProfile, OpProfile


def head_norm_reductions(profile: "ModelProfile") -> dict[str, tuple[float, ...]]:
    """Forward op name -> bytes (fp32) of each parameter of its module, for every reduction that
    normalises a head's features inside a per-head norm module (the module docstring's rule)."""
    from autopar.solver.space import ModelShape

    shape = ModelShape.from_profile(profile)
    if not shape.head_dim or not shape.heads:
        return {}
    head_counts = {shape.heads, shape.kv_heads or shape.heads}
    norms = _per_head_norms(profile, shape.head_dim)
    return {op.name: norms[op.module] for op in profile.ops
            if op.phase == "forward" and op.op_class in ("reduction", "norm") and op.module in norms
            and _reduces_head_features(op, shape.head_dim, head_counts)}


def _per_head_norms(profile: "ModelProfile", head_dim: int) -> dict[str, tuple[float, ...]]:
    """Module -> bytes of each of its parameters, for the modules whose parameters are all their
    own vectors of ``head_dim`` (a module whose sub-modules hold parameters is none of them)."""
    direct: dict[str, list[tuple[str, list[int]]]] = {}
    for name, dims in sorted(profile.param_shapes.items()):
        direct.setdefault(name.rpartition(".")[0], []).append((name, list(dims)))
    # modules above a parameter holder: their sub-modules hold parameters
    above = {holder.rsplit(".", depth)[0] for holder in direct for depth in range(1, holder.count(".") + 1)}
    return {module: tuple(4.0 * math.prod(dims) for _, dims in shapes) for module, shapes in direct.items()
            if module not in above and all(dims == [head_dim] for _, dims in shapes)}


def _reduces_head_features(op: "OpProfile", head_dim: int, head_counts: set[int]) -> bool:
    """Whether ``op`` reduces only the last dim of a per-head tensor."""
    if not op.input_shapes or not op.output_shapes:
        return False
    source, result = list(op.input_shapes[0]), list(op.output_shapes[0])
    if len(source) < 4 or source[-1] != head_dim or not ({source[-2], source[1]} & head_counts):
        return False
    if op.op_class == "reduction":
        return result in (source[:-1] + [1], source[:-1])
    # A fused norm (native_layer_norm): its output keeps the shape; its saved statistics show
    # which dims it normalised.
    statistics = [list(shape) for shape in op.output_shapes[1:]]
    return result == source and bool(statistics) and all(s == source[:-1] + [1] for s in statistics)

"""Grouped-query attention with more tensor-parallel ranks than key/value heads.

Llama-3-70B has 64 query heads and 8 key/value heads; at tp=16 a column split of ``k_proj``
would cut each key/value head in half. Megatron-LM and vLLM instead give every rank the
key/value head of its query heads' group: ranks ``g·tp/kv .. (g+1)·tp/kv - 1`` all compute
head ``g``. This module finds the projections that need it (``kv_group`` style) and what they
cost; the generated code runs them with ``KVGroupColwise`` (autopar/sections/
tensor_parallel.py).

Design (Megatron's computation on local tensors, the weight stored split as ZeRO-3 would). Each
rank holds 1/tp of the key/value weight's rows (a ``Shard(0)`` DTensor, as a column-parallel
weight: checkpoints, clipping and the optimizer see one tensor of the model's shape),
all-gathers it in forward, computes only its group's rows, and hands the attention one local
key/value head beside its ``heads / tp`` query heads: attention that broadcasts key/value heads
over query heads (SDPA's ``enable_gqa``, Hugging Face's SDPA path without a padding mask) runs
unchanged. The backward of the gather reduce-scatters the weight's gradient, which sums the
shares of the ranks of a group (each adds only its query heads' part of its group's rows) and
leaves each rank its own rows; the input's gradient is partial like a column-parallel linear's,
summed by the region's one backward all-reduce.

Before, the weight stayed whole on every rank and its partial gradient was all-reduced once per
step: one collective a step instead of two a micro-batch, but the weight, its gradient and its
optimizer states tp times over; on the zoo's GQA models (2 key/value heads of 4) that left 11%
of the blocks' parameters whole at tp=4, and Llama-3-70B's 8 key/value heads at tp=16 would
hold each key/value weight 16 times. The gather moves the weight once per micro-batch (twice
under full recomputation), small beside the layer's activations' collectives.

Rejected: keeping k/v whole as replicated DTensors in a DTensor region (``GlobalShapes``), so
that SDPA slices them to the query heads' shards locally. Measured on torch 2.13 CPU with a
Hugging Face Llama (4 query heads, 1 key/value head, tp=2): the batched matmul of a head-sharded
query (``_StridedShard`` after folding batch and heads) against a replicated key all-gathers the
query in forward, and its backward all-gathers three more tensors; correct, but not the one
all-reduce per row-parallel linear that the layout is priced at. Code that repeats key/value
heads itself to the global count (``repeat_kv`` by ``num_key_value_groups``, HF's eager path or
its SDPA path with a mask) cannot run either way without changing the module's attributes: the
*local shapes* probe finds it failing and the region runs replicated.

Price (autopar.solver.intra_op's ``kv_group`` strategy, autopar.solver.tp_split): the
projection's forward and backward work divides by the number of key/value heads, not by tp; its
weight, gradient and optimizer states divide by tp (counted as split); its saved output is
priced whole (an over-count: a rank keeps one head), while the elementwise ops on the key/value
head after it (rotary embedding) are priced as split by tp (an under-count by tp / kv of ops
that small); each micro-batch one all-gather of its weight in forward (again under full
recomputation) and one reduce-scatter of its gradient in backward over the TP group, as
measured (tests/dist/test_kv_groups.py). The ILP weighs both when it chooses between kv_group
and replicating the projection. The gathered weight is transient and not priced.

Fused projections: Phi-3 computes q, k and v in one ``qkv_proj`` that its code cuts into
parts (autopar.solver.tp_fused). At tp above its key/value heads the projection takes
``kv_group`` as a whole (``FusedKVGroupColwise``, autopar/sections/fused.py): held like
a fused column-parallel weight (rows permuted so each rank's ``Shard(0)`` share is 1/tp of
every part), each forward gathers the key/value parts' shares in one all-gather and keeps the
group's rows, while the query part's rows are the rank's own; priced with its work divided by
the rows a rank computes (the query part's 1/tp and a group's head of each key/value part) and
the gather and reduce-scatter of the key/value parts' rows only (`KVGroups.with_fused`).

Where it applies: ``ModelShape.kv_grouped`` (tp > kv heads, tp a multiple of them, query heads
divisible by tp), with the heads read from the traced SDPA op (the key's heads before the
attention repeats them); attention written as matmuls
(Hugging Face's eager path) shows no heads in the trace, so its projections are not offered
``kv_group`` and split as before.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autopar.model_profile import ModelProfile


@dataclass(frozen=True)
class KVGroups:
    """The grouped-query attention of a model at one TP degree, read from the traced shapes
    (the attention op's query and key heads, and the projections' widths).

    Attributes:
        heads: query heads of the model.
        kv_heads: key/value heads of the model (the number of groups).
        head_dim: features per head.
        tp: the tensor-parallel degree.
        modules: FQN -> output features of each projection whose output is ``kv_heads`` heads,
            or, for a fused projection (`fused`), holds such parts.
        feeding: modules whose GEMM computes an attention's keys or values.
        fused: fused projections (Phi-3's ``qkv_proj``) -> their parts' global sizes: a part of
            ``kv_heads`` heads is computed by group, the others split by tp as their parts.
    """

    heads: int
    kv_heads: int
    head_dim: int
    tp: int
    modules: dict[str, int]
    feeding: frozenset[str] = frozenset()
    fused: dict[str, list[int]] = field(default_factory=dict)

    def parts(self, module: str) -> list[int]:
        """The global sizes of ``module``'s output parts (one part when not fused)."""
        return self.fused.get(module, [self.modules[module]])

    def grouped(self, module: str) -> list[bool]:
        """Per part of ``module``'s output: whether it is computed by group."""
        return [module not in self.fused or size == self.kv_heads * self.head_dim for size in self.parts(module)]

    def local_parts(self, module: str) -> list[int]:
        """Output features each rank computes, per part: one group's share of a grouped part,
        1/tp of any other."""
        return [size // (self.kv_heads if grouped else self.tp)
                for size, grouped in zip(self.parts(module), self.grouped(module))]

    def rows_per_rank(self, module: str) -> int:
        """Output features each rank computes."""
        return sum(self.local_parts(module))

    def work_divisor(self, module: str) -> float:
        """How many times less work of ``module`` each rank does than one unsplit GPU."""
        return self.modules[module] / self.rows_per_rank(module)

    def gathered_share(self, module: str) -> float:
        """The share of ``module``'s rows that each forward gathers (its grouped parts')."""
        parts = self.parts(module)
        return sum(size for size, grouped in zip(parts, self.grouped(module)) if grouped) / sum(parts)

    def with_fused(self, fused: dict[str, list[int]]) -> "KVGroups":
        """These groups and the fused projections of ``fused`` (FQN -> parts, split as their
        parts: autopar.solver.tp_fused) that compute keys or values as parts of ``kv_heads``
        heads, each part dividing by its divisor."""
        width = self.kv_heads * self.head_dim
        found = {module: list(parts) for module, parts in fused.items() if module in self.feeding and width in parts
                 and all(size % (self.kv_heads if size == width else self.tp) == 0 for size in parts)}
        if not found:
            return self
        return replace(self, modules={**self.modules, **{m: sum(parts) for m, parts in found.items()}},
                       fused={**self.fused, **found})


def kv_groups(profile: "ModelProfile", tp: int) -> KVGroups | None:
    """The key/value projections that take the ``kv_group`` style at ``tp`` (None when tp does
    not exceed the key/value heads by a whole factor, or the model has no such attention);
    fused ones join by `KVGroups.with_fused` once their parts are known."""
    from autopar.solver.space import ModelShape

    shape = ModelShape.from_profile(profile)
    if not shape.kv_grouped(tp) or not shape.head_dim or shape.kv_heads is None or shape.heads is None:
        return None
    width = shape.kv_heads * shape.head_dim
    feeding = _key_value_producers(profile)
    modules = {}
    for name, dims in profile.param_shapes.items():
        module, _, leaf = name.rpartition(".")
        # nn.Linear's (out, in) weight whose outputs are the key/value heads and whose inputs are
        # not, computing what the attention reads as keys or values
        if leaf == "weight" and len(dims) == 2 and dims[0] == width and dims[1] != width and module in feeding:
            modules[module] = dims[0]
    return KVGroups(shape.heads, shape.kv_heads, shape.head_dim, tp, modules, frozenset(feeding))


def _key_value_producers(profile: "ModelProfile") -> set[str]:
    """Modules whose forward GEMM computes, through any ops of the same layer, an attention op's
    key or value input (the first GEMM met walking up from each: rotary tables and masks come
    from other layers or from no GEMM)."""
    return attention_producers(profile, slice(1, 3))


def attention_producers(profile: "ModelProfile", inputs: slice = slice(0, 3)) -> set[str]:
    """Modules whose forward GEMM computes, through any ops of the same layer, the ``inputs`` of
    an attention op (query, key, value by default), the first GEMM met walking up from each."""
    by_name = {op.name: op for op in profile.ops if op.phase == "forward"}
    found: set[str] = set()
    for attention in by_name.values():
        if attention.op_class != "attention":
            continue
        frontier, seen = list(attention.inputs[inputs]), set()
        while frontier:
            op = by_name.get(frontier.pop())
            if op is None or op.name in seen or op.layer != attention.layer:
                continue
            seen.add(op.name)
            if op.op_class == "gemm" and op.module is not None:
                found.add(op.module)
            else:
                frontier.extend(op.inputs)
    return found


def parameter_bytes(profile: "ModelProfile", module: str, bytes_per_element: int = 4,
                    share: float = 1.0) -> tuple[float, ...]:
    """Bytes of each of a ``kv_group`` module's parameters (its weight, and its bias where it has
    one: Qwen2's), in name order, times ``share`` (of a fused projection, its grouped parts'
    rows): the forward gathers each and the backward reduce-scatters each, one collective apiece
    (fp32 by default: the optimizer's master copy)."""
    return tuple(float(bytes_per_element * math.prod(shape)) * share
                 for name, shape in sorted(profile.param_shapes.items()) if name.rpartition(".")[0] == module)

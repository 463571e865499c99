"""The search space: every global configuration of a plan (all but the layer partition).

A candidate (a `ParallelLayout` without its stage split) fixes the parallel degrees and their order
on the topology, the ZeRO stage,
micro-batching, the pipeline schedule and the sequence/context-parallel options. What is
legal follows from the model (heads and hidden sizes divisible by TP, layers by stages), the
batch (global batch = dp × micro-batch × micro-batches), the cluster (TP inside a node unless
allowed) and the user's pins. Orders of mesh axes that put every group on the same links are
equivalent; only one of each kind is kept.
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

from autopar.errors import ConfigError
from cost_models.expert_parallel import ExpertFacts
from autopar.domain.mesh import Mesh
from autopar.domain.layout import ParallelLayout, enum_member
from autopar.domain.vocabulary import CPStrategy, DPSync, Schedule, ZeroStage
from autopar.domain.techniques import zero_stages_for

if TYPE_CHECKING:
    from autopar.config import PlanPins, SolverConfig
    from autopar.model_profile import ModelProfile, OpProfile

AXES = ("tp", "cp", "pp", "dp")



# A candidate is a layout whose stage split and recomputation the partition solver completes.
Candidate = ParallelLayout


@dataclass(frozen=True)
class ModelShape:
    """What divisibility rules need from the profile."""

    num_blocks: int
    num_layers: int
    heads: int | None
    kv_heads: int | None
    head_dim: int | None
    tokens_per_sample: int | None
    # Weight dims a TP split divides (output and input features); one smaller than tp leaves its
    # module replicated instead (autopar.solver.tp_legality's too-small rule).
    split_dims: tuple[int, ...]
    cp_blocker: str | None = None  # the first op that makes context parallelism illegal, if any
    experts: int = 0  # what every MoE layer's expert count divides into (0: no experts)
    sp_blocker: str | None = None  # why sequence parallelism cannot wrap the blocks, if it cannot
    ep_blocker: str | None = None  # why the generated expert parallelism cannot shard the experts, if it cannot
    dropless_experts: bool = False  # every MoE layer exchanged dropless: EP may span context-parallel ranks
    expert_width: int = 0  # what every MoE layer's experts' width divides into (0: expert TP cannot split it)
    batch_blocker: str | None = None  # why any split of the batch would train another model (trace/batch.py)

    @classmethod
    def from_profile(cls, profile: "ModelProfile") -> "ModelShape":
        heads = kv_heads = head_dim = None
        attention = [op for op in profile.ops if op.op_class == "attention" and op.phase == "forward"]
        if attention and len(attention[0].input_shapes) >= 2 and len(attention[0].input_shapes[0]) == 4:
            heads, head_dim = attention[0].input_shapes[0][1], attention[0].input_shapes[0][3]
            kv_heads = _key_heads_before_repeat(profile, attention[0])
        dims: set[int] = set()
        blocks = {layer.name for layer in profile.blocks}
        multiplied = _matmul_weights(profile)
        for name, shape in profile.param_shapes.items():
            if len(shape) == 2 and name in multiplied and any(name.startswith(block + ".") for block in blocks):
                dims.update(shape)
        # Grouped-query attention: K/V projections have fewer heads than Q (HF repeats them
        # before attention), visible as projection widths that are a multiple of head_dim.
        if head_dim:
            kv_widths = [d // head_dim for d in dims if d % head_dim == 0 and d // head_dim < (heads or 0)]
            if kv_widths:
                kv_heads = min(kv_widths)
        experts = ExpertFacts.of(profile)
        return cls(num_blocks=len(blocks), num_layers=len(profile.layers), heads=heads, kv_heads=kv_heads,
                   head_dim=head_dim, tokens_per_sample=profile.tokens_per_sample, split_dims=tuple(sorted(dims)),
                   cp_blocker=next(iter(profile.sequence_mixers), None), experts=experts.common_divisor(),
                   sp_blocker=sp_blocker(profile), ep_blocker=experts.ep_blocker, dropless_experts=experts.dropless,
                   expert_width=experts.common_width(), batch_blocker=getattr(profile, "batch_mixer", None))

    def tp_divides(self, tp: int) -> bool:
        return self.tp_problem(tp) is None

    def kv_grouped(self, tp: int) -> bool:
        """Whether ``tp`` exceeds the key/value heads of grouped-query attention by a whole factor:
        each rank then computes its group's key/value head (Megatron-LM's and vLLM's layout,
        autopar.solver.tp_kv_groups) while queries split by heads."""
        return (self.kv_heads is not None and self.heads is not None and self.kv_heads < tp
                and tp % self.kv_heads == 0 and self.heads % tp == 0)

    def tp_problem(self, tp: int) -> str | None:
        """Why a TP degree is illegal (for error messages), or None."""
        for label, count in (("attention heads", self.heads), ("key/value heads", self.kv_heads)):
            if count is not None and count % tp and not (label == "key/value heads" and self.kv_grouped(tp)):
                return (f"{count} {label} are not divisible by tp={tp}"
                        + (f" (nor is tp={tp} a multiple of them)" if label == "key/value heads" else ""))
        bad = [dim for dim in self.split_dims if dim % tp and dim > tp]
        if bad:
            return f"weight dimension {bad[0]} is not divisible by tp={tp}"
        return None


@functools.lru_cache(maxsize=4096)
def divisors(n: int) -> tuple[int, ...]:
    """The divisors of n in increasing order, built from its prime factors: the enumeration asks
    for the divisors of the world size and the batch many times, and a scan up to sqrt(n) would
    not end for an absurd batch (10^20: 10^10 trials); factoring takes milliseconds."""
    found = [1]
    for prime, power in sorted(prime_factors(n).items()):
        found = [d * prime ** k for d in found for k in range(power + 1)]
    return tuple(sorted(found))


SMALL_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


def prime_factors(n: int) -> dict[int, int]:
    """n's prime factorisation {prime: power}: small factors by trial division, the rest by
    Pollard's rho (a Miller-Rabin test tells a prime cofactor)."""
    factors: dict[int, int] = {}
    for p in range(2, 1000):
        while n % p == 0:
            factors[p] = factors.get(p, 0) + 1
            n //= p
    pending = [n] if n > 1 else []
    while pending:
        m = pending.pop()
        if _is_prime(m):
            factors[m] = factors.get(m, 0) + 1
            continue
        d = _pollard_rho(m)
        pending += [d, m // d]
    return factors


def _is_prime(n: int) -> bool:
    """Miller-Rabin with the first 13 primes as bases: exact below 3.3 * 10^24."""
    if n < 2:
        return False
    for p in SMALL_PRIMES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in SMALL_PRIMES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


# Rho steps before a factor search gives up (~2 s of Python): enough for every number with a factor
# below ~10^11 (any batch or cluster size a plan can be made for); past it the number is refused.
RHO_STEP_LIMIT = 1 << 19


def _pollard_rho(n: int) -> int:
    """A nontrivial factor of the odd composite n (Brent's cycle finding on x^2 + c, gcds taken
    over batches of 128 steps)."""
    steps = 0
    for c in range(1, 64):
        y, r, q, g = 2, 1, 1, 1
        x = ys = y
        while g == 1:
            x = y
            for _ in range(r):
                y = (y * y + c) % n
            k = 0
            while k < r and g == 1:
                ys = y
                for _ in range(min(128, r - k)):
                    y = (y * y + c) % n
                    q = q * abs(x - y) % n
                g = math.gcd(q, n)
                k += 128
            r *= 2
            steps += r
            if steps > RHO_STEP_LIMIT:
                raise ConfigError(f"{n} is too large a number to split into parallel degrees (it has no factor autopar "
                                  "finds in bounded time); it comes from the batch size or the cluster's GPU count.",
                                  "use a train.global_batch_size and cluster size of realistic magnitude.")
        if g == n:  # the batch overshot: step back one at a time
            g = 1
            while g == 1:
                ys = (ys * ys + c) % n
                g = math.gcd(abs(x - ys), n)
        if g != n:
            return g
    raise ConfigError(f"no factor of {n} found", "use a realistic batch size and cluster size.")


def enumerate_candidates(shape: ModelShape, world_size: int, gpus_per_node: int, global_batch_size: int,
                         solver: "SolverConfig", pins: "PlanPins") -> Iterator[Candidate]:
    """Every legal candidate, in a fixed order (the tie-break order of the search)."""
    def pinned(name: str, values: list):
        value = getattr(pins, name)
        return [value] if value is not None else values

    def bounded(values: Sequence[int], bound: int) -> list[int]:
        return [v for v in values if not bound or v <= bound]

    for tp in pinned("tp", bounded(divisors(world_size), solver.max_tp)):
        if not shape.tp_divides(tp) or (tp > gpus_per_node and not solver.allow_cross_node_tp):
            continue
        for cp in pinned("cp", bounded(_cp_options(shape, world_size // tp if world_size % tp == 0 else 0),
                                       solver.max_cp)):
            if world_size % (tp * cp):
                continue
            for pp in pinned("pp", bounded([d for d in divisors(world_size // (tp * cp))
                                            if d <= max(1, shape.num_blocks)],
                                           solver.max_pp)):
                if world_size % (tp * cp * pp):
                    continue
                dp = world_size // (tp * cp * pp)
                if pins.dp is not None and pins.dp != dp or global_batch_size % dp or (shape.batch_blocker and dp > 1):
                    continue
                yield from _micro_batching(shape, tp, cp, pp, dp, world_size, gpus_per_node, global_batch_size,
                                           solver, pins, pinned)


def sp_blocker(profile: "ModelProfile") -> str | None:
    """Why sequence parallelism cannot wrap this model's blocks (what codegen would refuse), or
    None: it needs one stack of blocks, and no block may call a linear layer directly on the
    residual stream (no torch style gathers the sequence for it: cost_models.tp_layout's
    UNSUPPORTED role)."""
    if not profile.block_containers or not profile.blocks:
        return "the model has no block container (a stack of repeated blocks) to keep sequence-sharded"
    if len(profile.block_containers) > 1:
        # Between two stacks the stream is whole again (an encoder's output, a second tower's
        # input), and codegen's styles enter and leave the sequence slices once.
        return f"the model has {len(profile.block_containers)} stacks of blocks " \
               f"({', '.join(profile.block_containers)}); sequence parallelism is written for one"
    from cost_models.tp_layout import ModuleTree

    tree = ModuleTree.of_profile(profile)
    blocks = {layer.name for layer in profile.blocks}
    last = profile.layers[-1]
    for layer in profile.layers:
        # Outside the blocks the stream is whole: only the embeddings, norms and a head that reads
        # the whole sequence are written for it (a pooled projection would get sequence-sharded
        # tensors).
        if layer.name in blocks or tree.kind(layer.name) == "norm":
            continue
        linears = [name for name, kind in tree.kinds.items() if kind == "linear"
                   and (name == layer.name or name.startswith(layer.name + "."))]
        if layer is last and linears and layer.input_bytes != profile.blocks[-1].output_bytes:
            return f"{layer.name} reads less than the whole sequence (a pooled output)"
        if layer is not last and linears:
            return f"{linears[0]}, a linear layer outside the block container {profile.block_containers[0]}, runs on " \
                   "the whole sequence"
    for block in profile.blocks:
        for child in tree.children.get(block.name, []):
            if tree.kind(child) == "linear" and child in tree.with_parameters:
                return f"{child} is a linear layer called directly on the residual stream in {block.name}"
    return None


def _cp_options(shape: ModelShape, remaining: int) -> list[int]:
    if not shape.tokens_per_sample or remaining == 0 or shape.cp_blocker or shape.batch_blocker:
        return [1]
    # Ring attention's load-balanced causal sharding cuts each sequence into 2·cp chunks.
    return [cp for cp in divisors(remaining) if shape.tokens_per_sample % (2 * cp) == 0]


def _micro_batching(shape, tp, cp, pp, dp, world_size, gpus_per_node, global_batch_size, solver, pins, pinned):
    per_rank = global_batch_size // dp
    # What does not depend on micro-batching is worked out once per split of the degrees, and
    # enum fields are converted here, not in each candidate's constructor: at frontier scale the
    # candidates number hundreds of thousands.
    dp_sync = enum_member(DPSync, pins.dp_sync or DPSync.AUTO)
    zero_stages = [enum_member(ZeroStage, zero_stage)
                   for zero_stage in pinned("zero_stage", _zero_stages(solver, dp, cp, pins.dp_sync))
                   # a pinned stage the generated code cannot pair with this cp / dp_sync is left out
                   if dp * cp == 1 or _zero_stage_runs(zero_stage, cp, pins.dp_sync)]
    sp_options = pinned("sequence_parallel", [False, True] if tp > 1 and not shape.sp_blocker else [False])
    cp_strategies = [enum_member(CPStrategy, strategy)
                     for strategy in pinned("cp_strategy", _cp_strategies(shape, tp, cp))]
    # Expert TP: the experts' width split over the TP group too, where it divides it.
    expert_tps = pinned("expert_tp", [False, True] if tp > 1 and shape.experts and shape.expert_width
                        and shape.expert_width % tp == 0 else [False])
    placements = list(itertools.product(pinned("ep", _ep_options(shape, dp, cp)), expert_tps,
                                        legal_mesh_orders(tp, cp, pp, dp, gpus_per_node, solver.allow_cross_node_tp)))
    # Batch statistics need the whole batch in one micro-batch, whatever its size.
    sizes = [per_rank] if shape.batch_blocker else [b for b in divisors(per_rank) if b <= solver.max_micro_batch_size]
    for micro_batch_size in pinned("micro_batch_size", sizes):
        if per_rank % micro_batch_size or (shape.batch_blocker and micro_batch_size < per_rank):
            continue
        micro_batches = per_rank // micro_batch_size
        shares = _shares(pins, dp, pp, micro_batch_size)
        if pins.dp_shares and not shares:
            continue  # the pinned shares do not fit this data-parallel degree / micro-batch
        for schedule, chunks in _schedules(shape, pp, micro_batches, solver, pinned):
            schedule = enum_member(Schedule, schedule)
            for zero_stage in zero_stages:
                hybrid_options = [False, True] if zero_stage >= 2 and dp > 1 and world_size > gpus_per_node else [False]
                for hybrid_shard in pinned("hybrid_shard", hybrid_options):
                    for sequence_parallel in sp_options:
                        for cp_strategy in cp_strategies:
                            for ep, expert_tp, order in placements:
                                if ep > 1 and ((dp * cp) % ep or not shape.experts or shape.experts % ep
                                               or (cp > 1 and not shape.dropless_experts)
                                               or zero_stage < 2 or hybrid_shard):
                                    continue  # what the generated EP code runs with (techniques._ep_runs)
                                yield Candidate.of_final_values(
                                    dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, expert_tp=expert_tp, mesh_order=order,
                                    zero_stage=zero_stage,
                                    hybrid_shard=hybrid_shard, micro_batch_size=micro_batch_size,
                                    num_micro_batches=micro_batches, schedule=schedule, chunks=chunks,
                                    sequence_parallel=sequence_parallel, cp_strategy=cp_strategy, dp_sync=dp_sync,
                                    dp_shares=shares)


def _ep_options(shape: ModelShape, dp: int, cp: int) -> list[int]:
    """Expert-parallel degrees: divisors of both dp x cp and every MoE layer's expert count (EP
    is carved from the data- and context-parallel ranks, as Megatron-Core's expert-data-parallel
    groups are; across CP ranks only for experts exchanged dropless, whose tokens route alone),
    and none but 1 for experts the generated exchange cannot wrap (`shape.ep_blocker`)."""
    if not shape.experts or shape.ep_blocker or (cp > 1 and not shape.dropless_experts):
        return [1]
    return [ep for ep in divisors(dp * cp) if shape.experts % ep == 0]


def _shares(pins, dp: int, pp: int, micro_batch_size: int) -> tuple[int, ...]:
    """Pinned uneven data-parallel shares where they apply (they must fit the candidate)."""
    shares = tuple(pins.dp_shares or ())
    if shares and (len(shares) != dp or pp > 1 or sum(shares) != dp * micro_batch_size):
        return ()
    return shares


def _zero_stages(solver, dp: int, cp: int, dp_sync: str | None = None) -> list[int]:
    """ZeRO stages for a gradient group of dp x cp ranks. Context parallelism goes with ZeRO-2/3:
    the generated code shards over the flattened data- x context-parallel axis (FSDP cannot
    replicate over a group interleaving other mesh axes). A pinned all-reduce algorithm needs
    unsharded gradients (ZeRO-0/1), and a parameter server the whole optimizer (ZeRO-0)."""
    if dp * cp == 1:
        return [0]
    allowed = zero_stages_for(dp_sync)  # the technique registry's pairing
    return [z for z in solver.zero_stages if (cp == 1 or z >= 2) and z in allowed]


def _zero_stage_runs(zero_stage: int, cp: int, dp_sync: str | None) -> bool:
    """Whether generated code exists for this ZeRO stage with this CP degree and pinned sync."""
    return (cp == 1 or zero_stage >= 2) and zero_stage in zero_stages_for(dp_sync)


def _schedules(shape: ModelShape, pp: int, micro_batches: int, solver, pinned) -> Iterator[tuple[str, int]]:
    if pp == 1:
        yield (Schedule.ONE_F_ONE_B, 1)  # no pipeline: micro-batches are gradient accumulation
        return
    if micro_batches < pp:
        return  # fewer micro-batches than stages leaves ranks idle: never worth it
    for schedule in pinned("schedule", list(solver.schedules)):
        if schedule != Schedule.INTERLEAVED_1F1B:
            yield (schedule, 1)
            continue
        for chunks in pinned("chunks", list(solver.interleave_chunks)):
            # torch's interleaved schedule needs micro-batches in multiples of the stages.
            if chunks > 1 and shape.num_blocks >= pp * chunks and micro_batches % pp == 0:
                yield (schedule, chunks)


def _cp_strategies(shape: ModelShape, tp: int, cp: int) -> list[CPStrategy]:
    if cp == 1:
        return [CPStrategy.ULYSSES]
    strategies = [CPStrategy.RING]
    if shape.heads and shape.heads % (tp * cp) == 0 and (shape.kv_heads or shape.heads) % (tp * cp) == 0:
        strategies.insert(0, CPStrategy.ULYSSES)
    return strategies


@functools.lru_cache(maxsize=4096)
def legal_mesh_orders(tp: int, cp: int, pp: int, dp: int, gpus_per_node: int,
                      allow_cross_node_tp: bool) -> tuple[tuple[str, ...], ...]:
    """Distinct orders whose TP groups stay inside a node (unless allowed)."""
    degrees = {"tp": tp, "cp": cp, "pp": pp, "dp": dp}
    return tuple(order for order in distinct_mesh_orders(degrees, gpus_per_node)
                 if allow_cross_node_tp or _group_span(order, "tp", degrees, gpus_per_node)[0] == 1)


def distinct_mesh_orders(degrees: dict[str, int], gpus_per_node: int) -> list[tuple[str, ...]]:
    """Orders of the axes (innermost first) that differ in which links some group crosses.

    Two orders are equivalent when every axis's group spans the same number of nodes with the
    same ranks per node; the first such order in the canonical (tp, cp, pp, dp) sequence is kept.
    """
    seen: dict[tuple, tuple[str, ...]] = {}
    for order in itertools.permutations(AXES):
        signature = tuple(_group_span(order, axis, degrees, gpus_per_node) for axis in AXES)
        seen.setdefault(signature, order)
    return list(seen.values())


def _group_span(order: tuple[str, ...], axis: str, degrees: dict[str, int], gpus_per_node: int) -> tuple[int, int]:
    """(nodes spanned, ranks per node) of one group of `axis` when axes are laid out in `order`."""
    return Mesh.from_degrees(order, degrees).span(axis, gpus_per_node)


def _matmul_weights(profile: "ModelProfile") -> set[str]:
    """Parameters a forward matrix multiply reads (through views: a linear's transpose): what
    tensor parallelism splits, so what its degree must divide. A table the model indexes (Swin's
    49-row relative position bias, T5's bucket embedding) is read whole on every rank."""
    by_name = {op.name: op for op in profile.ops}
    return {name for op in profile.ops if op.phase == "forward" and op.op_class == "gemm"
            for name in profile.params_read(op, by_name)}


def _key_heads_before_repeat(profile: "ModelProfile", attention: "OpProfile") -> int:
    """The key heads an attention op reads, before the repeat Hugging Face's attention makes of
    them (``repeat_kv``: unsqueeze, expand, reshape to the query heads): the fewest heads of a
    ``[batch, heads, seq, head_dim]`` tensor met walking up the key input through views and
    copies, and at the op that made it (a fused q/k/v projection shows no key width of its own)."""
    key = attention.input_shapes[1]
    heads = key[1]
    by_name = {op.name: op for op in profile.ops if op.phase == "forward" and op.layer == attention.layer}
    name = attention.inputs[1] if len(attention.inputs) > 1 else None
    while name in by_name:
        op = by_name[name]
        shape = op.output_shapes[0] if op.output_shapes else []
        if len(shape) == 4 and shape[0] == key[0] and shape[2:] == key[2:]:
            heads = min(heads, shape[1])
        if op.op_class not in ("view", "memory") or not op.inputs:
            break
        name = op.inputs[0]
    return heads

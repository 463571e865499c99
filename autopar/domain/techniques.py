"""The technique registry: each way of synchronising gradients, splitting the sequence,
scheduling a pipeline and sharding with ZeRO declares, in one entry, what the search may
combine it with, the cost-model function that prices it, the generated code that runs it and
what it needs of a layout.

A technique whose `runtime` is None would be priced by the cost model but not generated. It can
be neither searched nor pinned: `chosen` refuses it with the reason, so no plan is priced for a
program that would run something else (before this registry, halving-doubling was such a
technique: a plan with it compiled and silently ran FSDP's reduction; gradient_sync.py now
generates it).

    from autopar.domain.techniques import Family, chosen, searchable, problems
    searchable(Family.DP_SYNC)          # ('auto', 'ring', 'tree', 'hierarchical', 'ps', 'halving_doubling')
    chosen(Family.DP_SYNC, "gossip")    # ValueError naming the problem and the fix
    problems(layout, heads=16, tokens_per_sample=2048)   # every precondition a layout breaks
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Callable

from autopar.domain.layout import ParallelLayout
from autopar.domain.vocabulary import CPStrategy, DPSync, ExpertDispatch, Schedule, ZeroStage

# Why an experts module's width cannot be split over TP, as the planner and the checks say it.
UNSPLITTABLE_WIDTH = ("their weights are not [E, a, b] with one of a, b the hidden size (the router's width) and the "
                      "other a feed-forward width in 1 or 2 blocks")


class Family(StrEnum):
    """The plan field a technique is a value of."""

    DP_SYNC = "dp_sync"
    CP_STRATEGY = "cp_strategy"
    SCHEDULE = "schedule"
    ZERO_STAGE = "zero_stage"
    EP_DISPATCH = "ep_dispatch"


@dataclass(frozen=True)
class LayoutFacts:
    """What preconditions read of the model besides the layout (None: unknown, not checked)."""

    heads: int | None = None
    kv_heads: int | None = None
    tokens_per_sample: int | None = None
    experts: int | None = None  # what every MoE layer's expert count divides into (0: no experts)
    ep_blocker: str | None = None  # why the generated exchange cannot wrap the experts (None: it can)
    dropless_experts: bool | None = None  # every MoE layer exchanged dropless (ExpertFacts.dropless)
    expert_width: int | None = None  # what every MoE layer's experts' width divides into (0: cannot split)


Precondition = Callable[[Any, LayoutFacts], "str | None"]


@dataclass(frozen=True)
class Technique:
    """One value of a plan field, declared once.

    Attributes:
        family, value: the plan field and its value.
        runtime: the generated code that runs it (codegen section.function), None if none does.
        pricing: the cost-model function that prices it (module.name under cost_models; a test resolves it).
        zero_stages: ZeRO stages the search combines it with (a dp_sync pinned by a user is
            only meaningful where gradients are all-reduced whole, ZeRO-0/1).
        requires: preconditions, each returning why the layout cannot use it (None: it can).
        summary: one line for errors and the README.
        pinnable: a user may pin it and the search may choose it (False: a plan records it as
            the outcome of other choices).
    """

    family: Family
    value: str | int
    runtime: str | None
    pricing: str
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    requires: tuple[Precondition, ...] = ()
    summary: str = ""
    pinnable: bool = True


# -- preconditions (each says what is wrong and how to fix it) ------------------------------------

def _zero_stage_in(stages: tuple[int, ...]) -> Precondition:
    def check(layout: ParallelLayout, facts: LayoutFacts) -> str | None:
        if layout.dp * layout.cp > 1 and layout.zero_stage not in stages:
            return (f"dp_sync={layout.dp_sync} needs ZeRO {' or '.join(map(str, stages))} (it reduces whole "
                    f"gradients; ZeRO-{int(layout.zero_stage)} shards them): pin zero_stage or dp_sync=auto")
        return None
    return check


def _sequence_splits(layout: ParallelLayout, facts: LayoutFacts) -> str | None:
    if layout.cp == 1 or not facts.tokens_per_sample:
        return None
    # Ring attention's load-balanced causal split cuts each sequence into 2·cp chunks.
    chunks = 2 * layout.cp if layout.cp_strategy == CPStrategy.RING else layout.cp
    if facts.tokens_per_sample % chunks:
        return (f"sequence length {facts.tokens_per_sample} is not divisible into {chunks} chunks for "
                f"cp={layout.cp} ({layout.cp_strategy})")
    return None


def _heads_split(layout: ParallelLayout, facts: LayoutFacts) -> str | None:
    if layout.cp > 1 and facts.heads and facts.heads % (layout.tp * layout.cp):
        return (f"Ulysses needs the {facts.heads} attention heads divisible by tp×cp = {layout.tp * layout.cp}; "
                "use cp_strategy=ring")
    return None


def _cp_shards_gradients(layout: ParallelLayout, facts: LayoutFacts) -> str | None:
    if layout.cp > 1 and layout.zero_stage < 2:
        return (f"context parallelism shards gradients over data- x context-parallel ranks, which needs "
                f"ZeRO-2 or 3 (the layout has ZeRO-{int(layout.zero_stage)}): pin zero_stage=2")
    return None


def _chunks_need_interleaving(layout: ParallelLayout, facts: LayoutFacts) -> str | None:
    if layout.chunks > 1:
        return "chunks > 1 needs schedule=interleaved_1f1b"
    return None


def _interleaving(layout: ParallelLayout, facts: LayoutFacts) -> str | None:
    if layout.chunks > 1 and layout.pp == 1:
        return "interleaving model chunks needs pp > 1"
    if layout.chunks > 1 and layout.num_micro_batches % layout.pp:
        return (f"the interleaved schedule needs micro-batches ({layout.num_micro_batches}) in multiples of "
                f"pp ({layout.pp})")
    return None


def _experts_divide(layout: ParallelLayout, facts: LayoutFacts) -> str | None:
    if facts.experts is None:
        return None
    if facts.experts == 0:
        return f"ep={layout.ep} needs a model with experts (parameters stacked [E, ...] under an 'experts' module)"
    if facts.experts % layout.ep:
        return (f"ep={layout.ep} must divide the {facts.experts} experts of every MoE layer: pin plan.ep to a "
                "divisor of it")
    return None


def _experts_exchangeable(layout: ParallelLayout, facts: LayoutFacts) -> str | None:
    if layout.ep > 1 and facts.ep_blocker:
        return f"ep={layout.ep} cannot run: {facts.ep_blocker}; pin plan.ep=1"
    return None


def expert_tp_problem(layout: ParallelLayout, facts: LayoutFacts) -> str | None:
    """Why the experts' width cannot be split over the layout's TP group (None: it can, or the
    layout does not ask for it)."""
    if not getattr(layout, "expert_tp", False):
        return None
    if layout.tp == 1:
        return "expert_tp splits the experts over the tensor-parallel group, which needs tp > 1: pin expert_tp=false"
    if facts.experts == 0:
        return "expert_tp needs a model with experts (parameters stacked [E, ...] under an 'experts' module)"
    if facts.expert_width == 0:
        return f"expert_tp cannot split these experts: {UNSPLITTABLE_WIDTH}; pin expert_tp=false"
    if facts.expert_width and facts.expert_width % layout.tp:
        return f"expert_tp needs tp={layout.tp} to divide the experts' width {facts.expert_width}: pin expert_tp=false"
    return None


def _ep_runs(layout: ParallelLayout, facts: LayoutFacts) -> str | None:
    """What the generated expert-parallel code is built and tested with (one FSDP shard group
    over the data- (and context-) parallel ranks, cut into expert-parallel groups, in every
    pipeline stage and at every tensor-parallel coordinate, the experts whole on each TP rank;
    CP beside it only for experts exchanged dropless)."""
    if layout.cp > 1 and not facts.dropless_experts:
        # Grouped experts get capacity slots per sequence: a shard of it gets its own, and the
        # dropped tokens differ from one process's.
        return (f"expert parallelism with cp={layout.cp} is generated for experts exchanged dropless (each token "
                f"routed alone), not for experts taking their tokens grouped with a capacity per sequence: pin "
                f"ep=1 or cp=1")
    if layout.zero_stage < 2 or layout.hybrid_shard:
        return ("expert parallelism is generated with FSDP over all data-parallel ranks (ZeRO-2 or 3, not hybrid): "
                "pin zero_stage=2 or 3")
    return None


def _something_to_shard(layout: ParallelLayout, facts: LayoutFacts) -> str | None:
    if layout.hybrid_shard:
        return "hybrid_shard needs zero_stage >= 1 (there is nothing to shard)"
    return None


# -- the registry ---------------------------------------------------------------------------------

_FSDP_REDUCTION = "data_parallel.apply_fsdp (FSDP's reduction; NCCL_ALGO set by train.train)"
REGISTRY: tuple[Technique, ...] = (
    Technique(Family.DP_SYNC, DPSync.AUTO, "the algorithm GradientSync.auto picks, generated as below",
              "dp_sync.GradientSync.auto", summary="the cheapest of ring, tree, hierarchical and ps"),
    # Under ZeRO-2/3 (and with context parallelism) FSDP's reduce-scatter replaces a pinned
    # algorithm, priced as such; the search pairs a pinned one with ZeRO-0/1 only.
    Technique(Family.DP_SYNC, DPSync.RING, _FSDP_REDUCTION, "dp_sync.GradientSync.cost", (0, 1),
              summary="NCCL's ring all-reduce"),
    Technique(Family.DP_SYNC, DPSync.TREE, _FSDP_REDUCTION, "dp_sync.GradientSync.cost", (0, 1),
              summary="NCCL's tree all-reduce"),
    Technique(Family.DP_SYNC, DPSync.HIERARCHICAL, "gradient_sync.HierarchicalSync", "dp_sync.GradientSync.cost",
              (0, 1), summary="reduce-scatter in a node, all-reduce across, all-gather back"),
    Technique(Family.DP_SYNC, DPSync.PS, "gradient_sync.ParameterServer", "dp_sync.GradientSync.cost", (0,),
              (_zero_stage_in((0,)),), "a parameter server per bucket (it holds the whole optimizer)"),
    Technique(Family.DP_SYNC, DPSync.HALVING_DOUBLING, "gradient_sync.HalvingDoublingSync", "dp_sync.GradientSync.cost",
              (0, 1), summary="recursive halving reduce-scatter, then recursive doubling all-gather"),
    Technique(Family.DP_SYNC, DPSync.REDUCE_SCATTER, "data_parallel.apply_fsdp",
              "layer_cost.LayerPrices._zero_micro_batch_s", summary="FSDP's reduce-scatter (ZeRO-2/3)", pinnable=False),
    Technique(Family.DP_SYNC, DPSync.NONE, "nothing (one gradient replica)", "layer_cost.LayerPrices.per_step_parts",
              summary="no synchronisation (one gradient replica)", pinnable=False),
    Technique(Family.CP_STRATEGY, CPStrategy.ULYSSES, "context_parallel.ulysses_attention",
              "layer_cost.LayerPrices._cp_time_s", (2, 3), (_sequence_splits, _heads_split, _cp_shards_gradients),
              "all-to-all of heads"),
    Technique(Family.CP_STRATEGY, CPStrategy.RING, "context_parallel.ring_attention",
              "layer_cost.LayerPrices._cp_time_s", (2, 3), (_sequence_splits, _cp_shards_gradients),
              "K/V passed around the context-parallel ring"),
    Technique(Family.SCHEDULE, Schedule.GPIPE, "pipeline.build_pipeline (ScheduleGPipe)",
              "held_activations.held_moments", requires=(_chunks_need_interleaving,),
              summary="all forwards, then all backwards"),
    Technique(Family.SCHEDULE, Schedule.ONE_F_ONE_B, "pipeline.build_pipeline (Schedule1F1B)",
              "held_activations.held_moments", requires=(_chunks_need_interleaving,),
              summary="one forward, one backward (also: no pipeline)"),
    Technique(Family.SCHEDULE, Schedule.INTERLEAVED_1F1B, "pipeline.build_pipeline (ScheduleInterleaved1F1B)",
              "held_activations.held_moments", requires=(_interleaving,), summary="v model chunks per rank"),
    Technique(Family.ZERO_STAGE, ZeroStage.NONE, "data_parallel.apply_fsdp or gradient_sync (replicated states)",
              "memory.trained_model_states", requires=(_something_to_shard,), summary="replicated states"),
    Technique(Family.ZERO_STAGE, ZeroStage.OPTIMIZER, "optimizer.ShardedAdamW", "memory.trained_model_states",
              summary="optimizer states sharded"),
    Technique(Family.ZERO_STAGE, ZeroStage.GRADIENTS, "data_parallel.apply_fsdp (reshard_after_forward=False)",
              "memory.trained_model_states", summary="+ gradients sharded"),
    Technique(Family.ZERO_STAGE, ZeroStage.PARAMETERS, "data_parallel.apply_fsdp (reshard_after_forward=True)",
              "memory.trained_model_states", summary="+ parameters sharded (FSDP)"),
    Technique(Family.EP_DISPATCH, ExpertDispatch.ALL_TO_ALL, "expert_parallel.apply_ep (all_to_all_single)",
              "layer_cost.LayerPrices._ep_time_s", requires=(_experts_divide, _experts_exchangeable, _ep_runs),
              summary="tokens to their experts' ranks and back by all-to-all"),
)


def entries(family: Family) -> tuple[Technique, ...]:
    return tuple(t for t in REGISTRY if t.family == family)


def searchable(family: Family) -> tuple[Any, ...]:
    """Values of `family` a plan may hold: those the generated code runs."""
    return tuple(t.value for t in entries(family) if t.runtime is not None and t.pinnable)


def technique(family: Family, value: Any) -> Technique:
    """The entry of one value (ValueError for an unknown one)."""
    for entry in entries(family):
        if entry.value == value:
            return entry
    raise ValueError(f"unknown {family} '{value}': use one of {', '.join(map(str, searchable(family)))}")


def chosen(family: Family, value: Any) -> Technique:
    """The entry of a value a user pinned or a plan holds: refused, with the fix, when nothing
    generated runs it."""
    entry = technique(family, value)
    if entry.runtime is None:
        raise ValueError(f"{family} '{value}' ({entry.summary}) has a price but no generated implementation, so "
                         f"a plan with it would run something else: use one of "
                         f"{', '.join(map(str, searchable(family)))}")
    return entry


def zero_stages_for(dp_sync: Any) -> tuple[int, ...]:
    """ZeRO stages the search pairs with a pinned gradient synchronisation."""
    return technique(Family.DP_SYNC, dp_sync or DPSync.AUTO).zero_stages


def pinnable_sync(dp_sync: Any) -> Any:
    """A plan's recorded gradient synchronisation as a layout pins it: an outcome a plan records
    (reduce_scatter, none) is re-derived by the pricer, so it prices as auto."""
    if not dp_sync:
        return DPSync.AUTO
    try:
        return DPSync.AUTO if not technique(Family.DP_SYNC, dp_sync).pinnable else dp_sync
    except ValueError:
        return dp_sync


def problems(layout: ParallelLayout, facts: LayoutFacts = LayoutFacts()) -> list[str]:
    """Every precondition `layout` breaks, from the entries of the values it holds."""
    found = []
    values = {Family.DP_SYNC: pinnable_sync(getattr(layout, "dp_sync", DPSync.AUTO)),
              Family.CP_STRATEGY: layout.cp_strategy, Family.SCHEDULE: layout.schedule,
              Family.ZERO_STAGE: layout.zero_stage,
              Family.EP_DISPATCH: getattr(layout, "ep_dispatch", ExpertDispatch.ALL_TO_ALL)}
    for family, value in values.items():
        entry = chosen(family, value)
        if (family == Family.CP_STRATEGY and layout.cp == 1) \
                or (family == Family.DP_SYNC and layout.dp * layout.cp == 1) \
                or (family == Family.EP_DISPATCH and getattr(layout, "ep", 1) == 1):
            continue  # the technique is not used
        for require in entry.requires:
            reason = require(layout, facts)
            if reason and reason not in found:
                found.append(reason)
    reason = expert_tp_problem(layout, facts)
    return found + [reason] if reason else found

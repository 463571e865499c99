"""The plan's decisions (`ParallelLayout`) and the training settings they are priced for
(`TrainSpec`): what every stage reads, written once.

The words they are written in (mesh axes, schedules, ZeRO stages, ...) are
autopar.domain.vocabulary's; which values can be chosen (searched or pinned) is the technique
registry's (autopar.domain.techniques), and the rules a plan's structure obeys are
autopar.domain.rules'. Checking a layout against a model and a cluster before it is priced is the
cost model's (cost_models.validate).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

from autopar.domain.mesh import Mesh
from autopar.domain.vocabulary import AXES, CPStrategy, DPSync, ExpertDispatch, Recompute, Schedule, ZeroStage


class FrozenDict(dict):
    """A dict that hashes by its items, so a layout holding one can key a cache. Built once by
    `ParallelLayout`; nothing mutates it afterwards."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))


@dataclass(frozen=True)
class TrainSpec:
    """Training settings the cost depends on.

    Attributes:
        global_batch_size: samples per optimizer step across all data-parallel ranks.
        precision: fp32, or bf16 / fp16 mixed precision (must match the profile's).
        optimizer: adam (two fp32 states), sgd (momentum) or sgd_plain (no state).
        moe_imbalance: the most-loaded expert-parallel rank's tokens over the mean under dropless
            routing (1: even), what its group waits for (cost_models.expert_parallel).
        expert_load: (experts module FQN, tokens each of its experts received) measured from a
            trained router (autopar/trace/routing.py); where given, it prices the busiest rank
            for each ep instead of moe_imbalance.
        clip_grad_norm: whether each step clips gradients by their global norm (the generated
            module's optim.max_grad_norm > 0): one scalar all-reduce over every rank per step.
        tp_runtime: dtensor (each TP-split module dispatches through DTensor on the host, a
            floor under its compute: cost_models.host), plain (Megatron-style, no such floor)
            or megatron_core (plain, with the overlaps Megatron-Core's published runs enabled:
            `cost_models.engine_overlap`), the last for pricing published runs of that engine.
        zero3_runtime: fsdp2 (the generated module) or deepspeed_2021 (one exposed collective
            per tensor: cost_models.deepspeed_zero3), for pricing published runs of that engine.
        selective_runtime: which products selective recomputation keeps: autopar (the generated
            module: products with a weight) or torchtitan_op (torchtitan's op-level policy: every
            second matrix product of a layer rerun), for pricing that engine's runs and plans
            (`cost_models.weights.selective_reruns`).
        grad_reduce_dtype: what gradients are reduced in under mixed precision: fp32 (the
            generated module: FSDP2's reduce_dtype, the generated exchange's fp32 gradients;
            torchtitan's default; Megatron-LM under bf16, which turns on
            --accumulate-allreduce-grads-in-fp32 itself) or compute (the 16-bit gradients as
            computed: Megatron-LM and DeepSpeed under fp16), for pricing runs of those engines.
    """

    global_batch_size: int
    precision: str = "bf16"
    optimizer: str = "adam"
    moe_imbalance: float = 1.0
    expert_load: tuple[tuple[str, tuple[int, ...]], ...] = ()
    clip_grad_norm: bool = True
    tp_runtime: str = "dtensor"
    zero3_runtime: str = "fsdp2"
    selective_runtime: str = "autopar"
    grad_reduce_dtype: str = "fp32"


def fsdp_groups(layers: list[str], blocks: set[str]) -> list[list[str]]:
    """The FSDP units of a whole model, bottom-up, as the generated module wraps them and the
    pricer counts their messages: each block its own unit, the layers after the last block (final
    norm and head, which run back to back) one unit; without blocks, each layer its own. The root
    wraps whatever no unit holds (the embeddings).

    Args:
        layers: every layer FQN in model order.
        blocks: the FQNs of the repeated blocks, of every stack (an encoder's and a decoder's alike).
    """
    block_layers = [layer for layer in layers if layer in blocks]
    if not block_layers:
        return [[layer] for layer in layers]
    after = layers[layers.index(block_layers[-1]) + 1:]
    return [[block] for block in block_layers] + ([after] if after else [])


def enum_member(enum: type, value: Any) -> Any:
    """The enum member spelled `value`, or `value` itself when no member is (validated later).
    A layout built from members skips this conversion: the planner's enumeration converts each
    value once, not once per candidate."""
    try:
        return _MEMBERS[enum].get(value, value)
    except TypeError:  # unhashable: certainly no member
        return value


@dataclass(frozen=True)
class ParallelLayout:
    """A plan as the cost model sees it (autopar.plans.Plan carries the same fields); frozen and
    hashable, so the pricer's caches are keyed by (projections of) the layout itself.

    Attributes:
        dp, tp, pp, cp: data-, tensor-, pipeline- and context-parallel degrees.
        ep: expert-parallel degree, carved from the data-parallel ranks (not a mesh axis of its
            own, so it does not multiply the world size): ep consecutive data-parallel ranks
            share one copy of the experts, E / ep each (cost_models.expert_parallel).
        mesh_order: mesh axes innermost (consecutive ranks, fastest links) to outermost.
        zero_stage: 0-3, sharding over the data-parallel (x context-parallel) ranks.
        hybrid_shard: shard within a node, replicate across nodes (HSDP).
        micro_batch_size: samples per micro-batch per data-parallel rank.
        num_micro_batches: micro-batches per step (pipeline depth / gradient accumulation).
        schedule: gpipe, 1f1b or interleaved_1f1b.
        chunks: model chunks per pipeline rank (v, interleaved schedule).
        stages: layer names per pipeline stage (pp x chunks of them, in model order; stage j
            runs on pipeline rank j % pp); empty: an even split by layer count.
        recompute: none | selective | full for every layer, or {layer name: option}.
        sequence_parallel: split the TP-replicated activations along the sequence too.
        cp_strategy: ulysses (all-to-all of heads) or ring (K/V passed around).
        dp_sync: gradient all-reduce algorithm: auto (the cheapest), ring, tree, hierarchical
            or ps (parameter server); see the technique registry.
        dp_shares: samples per micro-batch of each data-parallel rank when they differ (uneven
            shares for mixed GPU types; they sum to dp x micro_batch_size); empty: even.
        ep_dispatch: how tokens reach their experts' ranks (all_to_all).
        expert_tp: every expert's feed-forward width split over the tensor-parallel group
            (Megatron's MLP split per expert), separately from attention's split; False: each
            TP rank holds its experts whole.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    mesh_order: tuple[str, ...] = AXES
    zero_stage: int = ZeroStage.NONE
    hybrid_shard: bool = False
    micro_batch_size: int = 1
    num_micro_batches: int = 1
    schedule: str = Schedule.ONE_F_ONE_B
    chunks: int = 1
    sequence_parallel: bool = False
    cp_strategy: str = CPStrategy.ULYSSES
    dp_sync: str = DPSync.AUTO
    dp_shares: tuple[int, ...] = ()
    ep_dispatch: str = ExpertDispatch.ALL_TO_ALL
    expert_tp: bool = False
    stages: tuple[tuple[str, ...], ...] = ()
    recompute: Any = Recompute.NONE

    def __post_init__(self) -> None:
        # Callers pass lists, dicts and plain strings (plan files, Hydra); the layout keeps
        # tuples, a FrozenDict and enum members. A value no enum knows is kept as given, for
        # `validate_layout` to name it. Mesh axes stay strings (a MeshAxis equals and hashes
        # as its name). The planner builds tens of thousands of layouts: what is already in
        # its final type is left alone.
        # The fields are read from __dict__ (object.__setattr__ writes there): getattr per field
        # cost more than the checks themselves.
        set_, values = object.__setattr__, self.__dict__
        if not values["dp_sync"]:
            set_(self, "dp_sync", DPSync.AUTO)
        for name, enum in _ENUM_FIELDS:
            if type(values[name]) is not enum:
                set_(self, name, enum_member(enum, values[name]))
        if type(values["mesh_order"]) is not tuple:
            set_(self, "mesh_order", tuple(values["mesh_order"]))
        if type(values["dp_shares"]) is not tuple:
            set_(self, "dp_shares", tuple(values["dp_shares"] or ()))
        stages = values["stages"]
        if stages and not (type(stages) is tuple and all(type(s) is tuple for s in stages)):
            set_(self, "stages", tuple(tuple(stage) for stage in stages))
        elif not stages and type(stages) is not tuple:
            set_(self, "stages", ())
        recompute = values["recompute"]
        if type(recompute) is Recompute or type(recompute) is FrozenDict:
            return
        if isinstance(recompute, dict):
            set_(self, "recompute", FrozenDict({k: enum_member(Recompute, v) for k, v in recompute.items()}))
        else:
            set_(self, "recompute", enum_member(Recompute, recompute))

    @classmethod
    def of_final_values(cls, **values: Any) -> "ParallelLayout":
        """A layout from values already in the types `__post_init__` keeps (enum members, tuples),
        the fields not given at their defaults, built without the conversions: the planner's
        enumeration builds hundreds of thousands of candidates, and the dataclass constructor
        was most of the time spent enumerating them."""
        layout = object.__new__(cls)
        state = layout.__dict__
        state.update(_DEFAULTS)
        state.update(values)
        if len(state) != len(_DEFAULTS):
            raise TypeError(f"not fields of ParallelLayout: {', '.join(sorted(values.keys() - _DEFAULTS.keys()))}")
        return layout

    @cached_property
    def mesh(self) -> Mesh:
        """Where each rank sits (computed once per layout: the pricer asks for groups often)."""
        return Mesh.of(self)

    def projected(self, *names: str) -> "ParallelLayout":
        """This layout with every field but `names` at its default: the cache key of a price that
        reads only those fields, so layouts differing elsewhere (schedule, chunks, ...) share it.
        The fields a price reads are named once, beside its computation, as a frozen value
        rather than a tuple assembled by hand at each lookup."""
        return ParallelLayout(**{f.name: getattr(self, f.name) for f in fields(self) if f.name in names})

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def degree(self, axis: str) -> int:
        return getattr(self, axis)


# Fields of ParallelLayout held as enum members, and each enum's members by value.
_ENUM_FIELDS = (("zero_stage", ZeroStage), ("schedule", Schedule), ("cp_strategy", CPStrategy), ("dp_sync", DPSync),
                ("ep_dispatch", ExpertDispatch))
_MEMBERS: dict[type, dict[Any, Any]] = {
    enum: {member.value: member for member in enum}
    for enum in (ZeroStage, Schedule, CPStrategy, DPSync, Recompute, ExpertDispatch)}
# Every field's default, as `__post_init__` leaves it (what `of_final_values` starts from).
_DEFAULTS = dict(ParallelLayout().__dict__)

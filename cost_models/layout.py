"""The plan as the cost model sees it (`ParallelLayout`), the training settings (`TrainSpec`), and
the checks that turn a layout that cannot run into a clear ValueError before it is priced."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cost_models.memory import OPTIMIZERS, RECOMPUTE_OPTIONS
from cost_models.topology import ClusterSpec

AXES = ("tp", "cp", "pp", "dp")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
CP_STRATEGIES = ("ulysses", "ring")
DP_SYNC = ("auto", "ring", "tree", "hierarchical", "ps", "halving_doubling")
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class TrainSpec:
    """Training settings the cost depends on.

    Attributes:
        global_batch_size: samples per optimizer step across all data-parallel ranks.
        precision: fp32, or bf16 / fp16 mixed precision (must match the profile's).
        optimizer: adam (two fp32 states), sgd (momentum) or sgd_plain (no state).
    """

    global_batch_size: int
    precision: str = "bf16"
    optimizer: str = "adam"


@dataclass(frozen=True)
class ParallelLayout:
    """A plan as the cost model sees it (autopar.plan.Plan carries the same fields).

    Attributes:
        dp, tp, pp, cp: data-, tensor-, pipeline- and context-parallel degrees.
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
        dp_sync: gradient all-reduce algorithm: auto (the cheapest), ring, tree, hierarchical,
            ps (parameter server) or halving_doubling.
        dp_shares: samples per micro-batch of each data-parallel rank when they differ (uneven
            shares for mixed GPU types; they sum to dp x micro_batch_size); empty: even.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    mesh_order: tuple[str, ...] = AXES
    zero_stage: int = 0
    hybrid_shard: bool = False
    micro_batch_size: int = 1
    num_micro_batches: int = 1
    schedule: str = "1f1b"
    chunks: int = 1
    sequence_parallel: bool = False
    cp_strategy: str = "ulysses"
    dp_sync: str = "auto"
    dp_shares: tuple[int, ...] = ()
    stages: tuple[tuple[str, ...], ...] | list[list[str]] = ()
    recompute: Any = "none"

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def degree(self, axis: str) -> int:
        return getattr(self, axis)


def validate_train(train: TrainSpec, profile: Any) -> None:
    """Clear errors for training settings the cost model cannot price."""
    if train.precision not in PRECISIONS:
        raise ValueError(f"precision '{train.precision}' is not one of {', '.join(PRECISIONS)}")
    if train.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer '{train.optimizer}' is not one of {', '.join(OPTIMIZERS)}")
    if train.global_batch_size < 1:
        raise ValueError(f"global batch size must be at least 1, got {train.global_batch_size}")
    if (train.precision == "fp32") != (profile.precision == "fp32"):
        raise ValueError(f"the profile was traced in {profile.precision} but training is {train.precision}: "
                         "profile the model in the training precision (bytes moved and saved differ)")


def validate_layout(layout: ParallelLayout, cluster: ClusterSpec, train: TrainSpec, layer_names: list[str] | int,
                    tokens_per_sample: int | None = None, heads: int | None = None,
                    recompute_options: tuple[str, ...] = RECOMPUTE_OPTIONS) -> None:
    """Clear errors for layouts that cannot run, before pricing them."""
    names = list(layer_names) if not isinstance(layer_names, int) else None
    num_layers = len(names) if names is not None else layer_names
    for axis in AXES:
        if not isinstance(layout.degree(axis), int) or layout.degree(axis) < 1:
            raise ValueError(f"{axis} must be a positive integer, got {layout.degree(axis)!r}")
    if sorted(layout.mesh_order) != sorted(AXES):
        raise ValueError(f"mesh_order {tuple(layout.mesh_order)} must order exactly the axes {', '.join(AXES)}")
    if layout.world_size != cluster.world_size:
        raise ValueError(f"dp×tp×pp×cp = {layout.dp}×{layout.tp}×{layout.pp}×{layout.cp} = {layout.world_size}, "
                         f"but the cluster has {cluster.world_size} GPUs")
    if layout.micro_batch_size < 1 or layout.num_micro_batches < 1:
        raise ValueError("micro_batch_size and num_micro_batches must be at least 1")
    if layout.dp * layout.micro_batch_size * layout.num_micro_batches != train.global_batch_size:
        raise ValueError(f"global batch {train.global_batch_size} ≠ dp {layout.dp} × micro-batch "
                         f"{layout.micro_batch_size} × micro-batches {layout.num_micro_batches}")
    shares = tuple(getattr(layout, "dp_shares", ()) or ())
    if shares and (len(shares) != layout.dp or sum(shares) != layout.dp * layout.micro_batch_size
                   or min(shares) < 1):
        raise ValueError(f"dp_shares {list(shares)} must give each of the {layout.dp} data-parallel ranks at least "
                         f"one sample and sum to dp x micro_batch_size = {layout.dp * layout.micro_batch_size}")
    if shares and layout.pp > 1:
        raise ValueError("uneven data-parallel shares need pp=1 (each pipeline replica would run another schedule)")
    if layout.schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule '{layout.schedule}': use {', '.join(SCHEDULES)}")
    if layout.chunks < 1:
        raise ValueError(f"chunks must be at least 1, got {layout.chunks}")
    if layout.chunks > 1:
        if layout.schedule != "interleaved_1f1b":
            raise ValueError("chunks > 1 needs schedule=interleaved_1f1b")
        if layout.pp == 1:
            raise ValueError("interleaving model chunks needs pp > 1")
        if layout.num_micro_batches % layout.pp:
            raise ValueError(f"the interleaved schedule needs micro-batches ({layout.num_micro_batches}) in "
                             f"multiples of pp ({layout.pp})")
    if layout.pp * layout.chunks > num_layers:
        raise ValueError(f"{num_layers} layers cannot fill pp {layout.pp} × chunks {layout.chunks} stages")
    if layout.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {layout.zero_stage}")
    if layout.hybrid_shard and layout.zero_stage == 0:
        raise ValueError("hybrid_shard needs zero_stage >= 1 (there is nothing to shard)")
    if layout.cp_strategy not in CP_STRATEGIES:
        raise ValueError(f"unknown cp_strategy '{layout.cp_strategy}': use {', '.join(CP_STRATEGIES)}")
    if getattr(layout, "dp_sync", "auto") not in DP_SYNC:
        raise ValueError(f"unknown dp_sync '{layout.dp_sync}': use {', '.join(DP_SYNC)}")
    if layout.cp > 1 and tokens_per_sample:
        # Ring attention's load-balanced causal split cuts each sequence into 2·cp chunks.
        chunks = 2 * layout.cp if layout.cp_strategy == "ring" else layout.cp
        if tokens_per_sample % chunks:
            raise ValueError(f"sequence length {tokens_per_sample} is not divisible into {chunks} chunks for "
                             f"cp={layout.cp} ({layout.cp_strategy})")
    if layout.cp > 1 and layout.cp_strategy == "ulysses" and heads and heads % (layout.tp * layout.cp):
        raise ValueError(f"Ulysses needs the {heads} attention heads divisible by tp×cp = {layout.tp * layout.cp}; "
                         "use cp_strategy=ring")
    _validate_recompute(layout.recompute, names, recompute_options)
    if layout.stages and names is not None:
        _validate_stages(layout, names)


def _validate_recompute(recompute: Any, names: list[str] | None, options: tuple[str, ...]) -> None:
    values = recompute.values() if isinstance(recompute, dict) else [recompute]
    unknown = sorted({str(v) for v in values} - set(options))
    if unknown:
        raise ValueError(f"recompute '{unknown[0]}' is not one of {', '.join(options)}")
    if isinstance(recompute, dict) and names is not None:
        stray = sorted(set(recompute) - set(names))
        if stray:
            raise ValueError(f"recompute names unknown layers: {', '.join(stray[:3])}")


def _validate_stages(layout: ParallelLayout, names: list[str]) -> None:
    stages = [list(stage) for stage in layout.stages]
    if len(stages) != layout.pp * layout.chunks:
        raise ValueError(f"{len(stages)} stages given for pp={layout.pp} × chunks={layout.chunks}")
    if any(not stage for stage in stages):
        raise ValueError("every pipeline stage needs at least one layer")
    flat = [name for stage in stages for name in stage]
    if flat != names:
        missing = sorted(set(names) - set(flat))
        raise ValueError("stages must list every layer once, in model order"
                         + (f" (missing: {', '.join(missing[:3])})" if missing else ""))

"""Step assembly: price a parallel layout into per-layer times and memory, then a training step.

`PlanPricer` owns one collaborator per concern, each built from explicit dependencies and
testable alone: where a layout's groups sit and what their collectives cost (`groups`,
placement.py), the gradient synchronisation (`sync`, dp_sync.py), what the model fixes for every
plan (`structure`, structure.py), each layer kind's TP split (`splits`, layer_split.py), the speed
and memory of each pipeline rank (`ranks`, ranks.py), what a layer costs under a layout
(`layer_prices`, layer_cost.py), the collectives a step issues (`issued`, issued.py) and the
estimate and the breakdowns the report reads (`assembler`, breakdowns.py). This module holds the
per-layer price tables (cached by projections of the frozen `ParallelLayout`) and assembles the
partition problem and the step.

    from cost_models import estimate, ParallelLayout, TrainSpec, ClusterSpec
    est = estimate(profile, cluster, ParallelLayout(dp=8, zero_stage=1), TrainSpec(global_batch_size=64))

`PlanPricer.partition_problem` turns one configuration (degrees, mesh order, ZeRO, micro-batching,
schedule, SP/CP) into the per-layer prices the planner's partition ILP balances; `estimate`
prices a complete layout (with its stage split) through the same numbers, so a plan's prediction
and the solver's objective are one computation.

Per layer and micro-batch, on the pipeline rank's GPU (compute from `compute.py`, collectives
from `collectives.py`, TP split from a `TPSplitter`, sequence parallelism from `tp_layout.py`):
    time = compute / cp (sharded ops ÷ tp; under SP the replicated ops that run on a sequence
           slice ÷ tp, and the gathers into replicated modules priced)
           + recomputation (selective: the forward but its products with a weight and its
             attention kernels again; full: the forward again)
           + TP collectives, on the critical path (forward ones again under full recompute)
           + CP exchange (Ulysses: 4 all-to-alls each way; ring: K/V passed cp-1 times,
             overlapped with attention, only the excess exposed)
           + expert parallelism's dispatch and combine all-to-alls, and the wait for the
             most-loaded expert rank (expert_parallel.py)
           + ZeRO-2/3 gradient reduce-scatter and ZeRO-3 parameter all-gathers beyond the
             compute they overlap with (prefetch)
Once per step and layer: gradient synchronisation over the data-parallel (× context-parallel)
group not hidden behind that layer's backward of the last micro-batch (bucketed overlap,
DDP/Megatron style), the ZeRO-1/2 parameter all-gather after the update, and the optimizer's
memory-bound update.
Step time from the per-device sums by the pipeline formula (`pipeline.py`).
Memory per device: model states (`memory.py`) of its layers, activations x in-flight
micro-batches of the schedule, plus buffers (prefetched ZeRO-3 parameters, DP buckets, one
layer's working set, the CUDA context), against (1 - headroom) of the GPU's memory.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from autopar.domain.layout import ParallelLayout, TrainSpec
from autopar.domain.vocabulary import DPSync, Recompute, Schedule
from cost_models.breakdowns import Estimate, EstimateAssembler, PerStepRows, TimeRows
from cost_models.collectives import OVERLAP_INTERFERENCE, Collective, exposed_s
from cost_models.compute import ComputeModel
from cost_models.dp_sync import BUCKET_CHOICES_BYTES, DP_BUCKET_BYTES, POST_BACKWARD_SYNC, GradientSync
from cost_models.expert_parallel import ExpertFacts
from cost_models.hardware import GPUSpec
from cost_models.issued import Counts, IssuedCollectives
from cost_models.layer_cost import (CUDA_CONTEXT_BYTES, OPTIMIZER_BYTES_PER_PARAM, RING_TILE_SCORE_BYTES, LayerPrices,
                                    expert_tp, ring_attention)
from cost_models.layer_split import LayerSplits, TPLayerSplit, TPSplitter
from cost_models.memory import RECOMPUTE_OPTIONS, activation_bytes, reduced_gradient_bytes
from cost_models.held_activations import Moment, held_moments
from cost_models.pipeline import MemoryRows, PartitionProblem, evaluate
from cost_models.placement import LayoutGroups, proportional_shares
from cost_models.ranks import PipelineRanks
from cost_models.structure import ModelStructure, attention_io_bytes
from cost_models.topology import ClusterSpec
from cost_models.validate import validate, validate_layout, validate_train

SCALAR_BYTES = 8  # one float64: gradient clipping's sum of squares, a token-level loss's count

if TYPE_CHECKING:
    from autopar.model_profile import LayerProfile, ModelProfile

Row = TypeVar("Row")

__all__ = ["TrainSpec", "ParallelLayout", "Estimate", "PlanPricer", "estimate", "validate", "validate_layout",
           "TPLayerSplit", "TPSplitter", "CUDA_CONTEXT_BYTES", "OPTIMIZER_BYTES_PER_PARAM", "OVERLAP_INTERFERENCE",
           "RING_TILE_SCORE_BYTES", "attention_io_bytes", "exposed_s", "BUCKET_CHOICES_BYTES", "DP_BUCKET_BYTES",
           "POST_BACKWARD_SYNC", "proportional_shares"]



# -- the module-level entry point ---------------------------------------------------------------

_PRICERS: "OrderedDict[tuple, PlanPricer]" = OrderedDict()
_SHARED: "OrderedDict[tuple[int, str], tuple[ModelProfile, ComputeModel]]" = OrderedDict()
_CACHE_SIZE = 8


def estimate(profile: "ModelProfile", cluster: ClusterSpec, layout: ParallelLayout, train: TrainSpec,
             tp_splitter: TPSplitter | None = None) -> Estimate:
    """Predict one training step of `layout` for `profile` on `cluster`.

    Per-layer prices are computed once per (profile, cluster, training settings) and reused
    across calls: the planner asks thousands of times.

    Raises:
        ValueError: the layout cannot run (degrees vs GPUs, batch arithmetic, stages, ...).
    """
    key = (id(profile), id(cluster), train, id(tp_splitter))
    pricer = _PRICERS.get(key)
    if pricer is None or pricer.profile is not profile or pricer.cluster is not cluster:
        pricer = PlanPricer(profile, cluster, train, tp_splitter)
        _PRICERS[key] = pricer
        while len(_PRICERS) > _CACHE_SIZE:
            _PRICERS.popitem(last=False)
    _PRICERS.move_to_end(key)
    return pricer.estimate(layout)


def _shared_compute(profile: "ModelProfile", selective_runtime: str) -> ComputeModel:
    """The compute model of a profile, shared by every pricer of it (per selective runtime)."""
    key = (id(profile), selective_runtime)
    entry = _SHARED.get(key)
    if entry is None or entry[0] is not profile:
        entry = (profile, ComputeModel(profile, selective_runtime))
        _SHARED[key] = entry
        while len(_SHARED) > _CACHE_SIZE:
            _SHARED.popitem(last=False)
    return entry[1]


class PlanPricer:
    """Prices configurations of one model on one cluster; caches what repeats across calls.

    Args:
        profile: the traced model (autopar.model_profile.ModelProfile).
        cluster: where it runs.
        train: batch, precision, optimizer.
        tp_splitter: chooses and prices a layer's split under TP: the planner's operator-wise ILP
            (autopar.solver.tp_split.ILPSplitter), the split codegen emits. None prices tp = 1
            only: this package has no TP split of its own, so no price differs from what runs.
        recompute_options: the recompute choices the partition problem offers per layer.
    """

    def __init__(self, profile: "ModelProfile", cluster: ClusterSpec, train: TrainSpec,
                 tp_splitter: TPSplitter | None = None, recompute_options: tuple[str, ...] = RECOMPUTE_OPTIONS):
        self.profile = profile
        self.cluster = cluster
        self.train = train
        self.compute = _shared_compute(profile, train.selective_runtime)
        splitter_runtime = getattr(tp_splitter, "selective_runtime", train.selective_runtime)
        if splitter_runtime != train.selective_runtime:
            raise ValueError(f"the TP splitter prices selective recomputation as {splitter_runtime} runs it, the "
                             f"training settings as {train.selective_runtime}: build it with the same runtime")
        self.tp_splitter = tp_splitter
        self.recompute_options = tuple(recompute_options)
        self.layers = profile.layers
        # Each layer's kind, and the first layer of each kind in model order: what `_rows` prices.
        self._layer_kinds = [self.compute.kind(layer.name) for layer in self.layers]
        self._first_of_kind: dict[str, "LayerProfile"] = {}
        for kind, layer in zip(self._layer_kinds, self.layers):
            self._first_of_kind.setdefault(kind, layer)
        self.b0 = profile.micro_batch_size
        self._problems: dict[ParallelLayout, PartitionProblem | None] = {}
        self._shared_rows: dict[ParallelLayout, dict[str, Any] | None] = {}
        self._memory_parts: dict[ParallelLayout, tuple[GPUSpec, dict[str, Any]] | None] = {}
        self._in_flight_cache: dict[tuple, list[tuple[Moment, ...]]] = {}
        self._totals_cache: dict[int, tuple[list, list]] = {}
        self._scalar_all_reduce_s: dict[int, float] = {}
        self._row_cache: dict[tuple, list] = {}
        self._floors: dict[tuple, tuple[list[float], list[float]] | None] = {}
        grads_bytes = reduced_gradient_bytes(train.precision, train.grad_reduce_dtype)
        self.groups = LayoutGroups(cluster)  # where each layout's groups sit, and their collectives' cost
        self.sync = GradientSync(self.groups, self.compute, self.layers, grads_bytes, self.b0, train.precision)
        self.structure = ModelStructure(profile, self.compute)  # FSDP units, tied weights, attention sizes
        self.experts = ExpertFacts.of(profile)
        self.splits = LayerSplits(profile, self.compute, self.groups, tp_splitter)
        self.ranks = PipelineRanks(cluster, self.groups, self.splits, self.layers)
        self.layer_prices = LayerPrices(profile, cluster, train, self.compute, self.groups, self.sync, self.structure,
                                        self.experts, self.splits, self.ranks)
        self.issued = IssuedCollectives(profile, train, self.compute, self.structure, self.groups, self.sync,
                                        self.experts, self.splits, self.ranks, self.layer_prices,
                                        self.recompute_options)
        self.assembler = EstimateAssembler(profile, cluster, train, self.groups, self.sync, self.splits, self.ranks,
                                           self.layer_prices, self.compute.dtype)

    def split(self, layer_name: str, layout: ParallelLayout, gpu: GPUSpec) -> TPLayerSplit:
        """The layer kind under the layout's TP degree on `gpu` (`LayerSplits.split`)."""
        return self.splits.split(layer_name, layout, gpu)

    def issued_collectives(self, layout: ParallelLayout) -> Counts:
        """Collective -> calls in one step on the counted ranks (`IssuedCollectives.per_step`)."""
        return self.issued.per_step(layout)

    # -- per-layer price tables (cached) ------------------------------------------------------

    def partition_problem(self, layout: ParallelLayout) -> PartitionProblem | None:
        """Per-layer prices of a configuration for the partition solver (None if it cannot run)."""
        # What the partition decides left out (a search candidate has neither already).
        key = layout if not layout.stages and layout.recompute == Recompute.NONE else \
            replace(layout, stages=(), recompute=Recompute.NONE)
        if key in self._problems:
            return self._problems[key]
        rows = self._partition_rows(layout)
        problem = None if rows is None else PartitionProblem(
            **rows, devices=layout.pp, chunks=layout.chunks, micro_batches=layout.num_micro_batches,
            in_flight=self._held_in_flight(layout), option_names=self.recompute_options)
        self._problems[key] = problem
        return problem

    def memory_rows(self, layout: ParallelLayout) -> MemoryRows | None:
        """The memory part of `partition_problem` (None if the layout cannot run), without its
        per-layer times: what the search checks before pricing a candidate in full."""
        part = self._memory_part(layout)
        if part is None:
            return None
        rows = part[1]
        return MemoryRows(rows["activation_bytes"], rows["static_bytes"], self._held_in_flight(layout),
                          rows["capacity_bytes"], rows["overhead_bytes"])

    def _held_in_flight(self, layout: ParallelLayout) -> list[tuple[Moment, ...]]:
        """Micro-batches each pipeline rank's chunks hold at the moments that can be its peak, in
        micro-batches of the layout's size: the rank with the largest data-parallel share holds
        that many samples' activations."""
        in_flight = self._in_flight(layout.schedule, layout.pp, layout.num_micro_batches, layout.chunks)
        shares = self.ranks.dp_shares(layout)
        if shares:
            scale = max(shares) / layout.micro_batch_size
            in_flight = [tuple(tuple(held * scale for held in moment) for moment in moments) for moments in in_flight]
        return in_flight

    @staticmethod
    def _shared_key(layout: ParallelLayout) -> ParallelLayout:
        """What the partition rows do not depend on left out (schedule, chunks, micro-batches)."""
        return replace(layout, stages=(), recompute=Recompute.NONE, num_micro_batches=1,
                       schedule=Schedule.ONE_F_ONE_B, chunks=1)

    def _memory_part(self, layout: ParallelLayout, key: ParallelLayout | None = None
                     ) -> tuple[GPUSpec, dict[str, Any]] | None:
        """(reference GPU, the schedule-independent memory rows: activations, static and step bytes,
        capacity and overheads per device, speeds), or None if the layout cannot run; ``key``: the
        layout's `_shared_key` where the caller has it already."""
        key = self._shared_key(layout) if key is None else key
        if key in self._memory_parts:
            return self._memory_parts[key]
        validate_train(self.train, self.profile)
        devices = self.ranks.device_facts(layout)
        if devices is None:
            self._memory_parts[key] = None
            return None
        reference, speed, capacity = devices
        scale = layout.micro_batch_size / self.b0
        keeps_attention = not ring_attention(layout)
        activations = self._rows("activation", layout, (layout.tp, layout.sequence_parallel, layout.cp,
                                                        layout.micro_batch_size, keeps_attention),
                                 lambda layer, split: [int(activation_bytes(self.splits.layer_activations(layer, split),
                                                                            scale, layout.tp, layout.sequence_parallel,
                                                                            layout.cp, option, keeps_attention)
                                                           + (self.layer_prices.ring_kept_bytes(layer, layout, scale)
                                                              if option == Recompute.NONE else 0.0))
                                                       for option in self.recompute_options], reference)
        statics = self._rows("static", layout, (layout.tp, self._zero_key_static(layout), layout.ep,
                                                expert_tp(layout)),
                             lambda layer, split: int(self.layer_prices.states(layer, split, layout).total_bytes),
                             reference)
        steps = self._rows("step", layout, (layout.tp, self._zero_key_static(layout), layout.ep, expert_tp(layout)),
                           lambda layer, split: int(self.layer_prices.step_bytes(layer, split, layout)), reference)
        overhead = self.layer_prices.overhead_bytes(layout, scale, reference)
        step_overhead = self.layer_prices.step_overhead_bytes(reference)
        rows = dict(activation_bytes=activations, static_bytes=statics, capacity_bytes=capacity,
                    overhead_bytes=[overhead] * layout.pp, speed=speed, step_bytes=steps,
                    step_overhead_bytes=[step_overhead] * layout.pp)
        self._memory_parts[key] = (reference, rows)
        return self._memory_parts[key]

    def _partition_rows(self, layout: ParallelLayout) -> dict[str, Any] | None:
        """The schedule-independent part of a partition problem (per-layer prices, memory per
        device, speeds), shared by the layouts that differ only in pipeline schedule and chunks."""
        key = self._shared_key(layout)
        if key in self._shared_rows:
            return self._shared_rows[key]
        part = self._memory_part(layout, key)
        if part is None:
            self._shared_rows[key] = None
            return None
        reference, memory = part
        scale = layout.micro_batch_size / self.b0
        times = self._totals(self.time_parts_rows(layout, reference))
        sends = self._rows("send", layout, (layout.pp, self.groups.span(layout, "pp"), layout.micro_batch_size,
                                            layout.cp, layout.tp if layout.sequence_parallel else 1),
                           lambda layer, split: self.layer_prices.send_s(layer, layout, scale), reference)
        per_step = self._totals(self.per_step_rows(layout, reference))
        rows = dict(memory, time_s=times, send_s=sends, per_step_s=per_step)
        self._shared_rows[key] = rows
        return rows

    def _totals(self, rows: list) -> list:
        """Each layer's parts summed (per option where a layer has several), memoised per table:
        `_rows` hands the same table to every layout it applies to, and within a table the
        layers of one kind share one row, summed once."""
        cached = self._totals_cache.get(id(rows))
        if cached is None or cached[0] is not rows:
            by_row: dict[int, Any] = {}
            for row in rows:
                if id(row) not in by_row:
                    by_row[id(row)] = [sum(parts.values()) for parts in row] if isinstance(row, list) \
                        else sum(row.values())
            cached = (rows, [by_row[id(row)] for row in rows])
            self._totals_cache[id(rows)] = cached
        return cached[1]

    def _in_flight(self, schedule: str, stages: int, micro_batches: int, chunks: int) -> list[tuple[Moment, ...]]:
        key = (schedule, stages, micro_batches, chunks)
        if key not in self._in_flight_cache:
            self._in_flight_cache[key] = [held_moments(schedule, stages, micro_batches, d, chunks)
                                          for d in range(stages)]
        return self._in_flight_cache[key]

    def time_parts_rows(self, layout: ParallelLayout, reference: GPUSpec) -> TimeRows:
        """[layer][recompute option] -> seconds per micro-batch by kind (layer_time_parts)."""
        scale = layout.micro_batch_size / self.b0
        return self._rows("time", layout, (layout.tp, layout.cp, layout.sequence_parallel, layout.cp_strategy,
                                           layout.micro_batch_size, self._zero_key(layout),
                                           self.groups.span(layout, "tp"), self.groups.span(layout, "cp"),
                                           self.layer_prices.ep_key(layout)),
                          lambda layer, split: self.layer_prices.layer_time_parts(layer, split, layout, scale,
                                                                                  self.recompute_options, reference),
                          reference)

    def per_step_rows(self, layout: ParallelLayout, reference: GPUSpec) -> PerStepRows:
        """[layer] -> seconds once per step by kind (per_step_parts)."""
        scale = layout.micro_batch_size / self.b0
        return self._rows("per_step", layout, (layout.tp, layout.cp, layout.dp, layout.zero_stage,
                                               layout.hybrid_shard, self.groups.span(layout, ("dp", "cp")),
                                               self.groups.shard_size(layout), layout.micro_batch_size,
                                               getattr(layout, "dp_sync", DPSync.AUTO), tuple(layout.mesh_order),
                                               layout.ep,
                                               expert_tp(layout), layout.pp, self.groups.span(layout, "tp")),
                          lambda layer, split: self.layer_prices.per_step_parts(layer, split, layout, scale, reference),
                          reference)

    def compute_floor(self, layout: ParallelLayout) -> tuple[list[float], list[float]] | None:
        """(per-layer seconds of a micro-batch below every recompute option's price, speed per
        pipeline rank), or None when the layout cannot run: compute without recomputation plus
        the least tensor- and context-parallel communication any option pays (no option avoids
        its layer's exchanges), no data-parallel or ZeRO traffic. It costs a fraction of
        `partition_problem` and is shared by layouts differing only in ZeRO stage, schedule or
        sharding, so the search orders candidates by it and prices only those that could win
        (communication in the floor keeps most context-parallel layouts from ever being priced)."""
        # The mesh spelled as its order and degrees: the search asks once per candidate (hundreds
        # of thousands), and building a Mesh for the key cost more than the lookup.
        key = (tuple(layout.mesh_order), layout.dp, layout.tp, layout.pp, layout.cp, layout.micro_batch_size,
               layout.sequence_parallel, layout.cp_strategy, tuple(getattr(layout, "dp_shares", ()) or ()), layout.ep,
               expert_tp(layout))
        if key not in self._floors:
            devices = self.ranks.device_facts(layout)
            if devices is None:
                self._floors[key] = None
                return None
            reference, speed, _ = devices
            scale = layout.micro_batch_size / self.b0
            spans = (self.groups.span(layout, "tp"), self.groups.span(layout, "cp"))
            rows = self._rows("compute_floor", layout, (layout.tp, spans[0], layout.sequence_parallel, layout.cp,
                                                        layout.cp_strategy, spans[1], layout.micro_batch_size,
                                                        self.layer_prices.ep_key(layout)),
                              lambda layer, split: self.layer_prices.floor_s(layer, split, layout, scale,
                                                                             self.recompute_options, reference),
                              reference)
            self._floors[key] = (rows, speed)
        return self._floors[key]

    def _rows(self, what: str, layout: ParallelLayout, key: tuple,
              price: Callable[["LayerProfile", TPLayerSplit], Row], reference: GPUSpec) -> list[Row]:
        """One value per layer, priced once per layer kind and cached by what the value depends on
        (the planner prices tens of thousands of configurations that share most of these)."""
        full_key = (what, reference.signature, key)
        if full_key not in self._row_cache:
            by_kind = {kind: price(layer, self.splits.split(layer.name, layout, reference))
                       for kind, layer in self._first_of_kind.items()}
            self._row_cache[full_key] = [by_kind[kind] for kind in self._layer_kinds]
        return self._row_cache[full_key]

    def _zero_key(self, layout: ParallelLayout) -> tuple:
        if layout.zero_stage < 2 or self.groups.grad_size(layout) == 1:
            return ()
        group = self.groups.shard_group(layout)
        replicas = self.groups.replica_group(layout) if layout.hybrid_shard else None
        return (layout.zero_stage, group.size, group.nodes, group.per_node, layout.pp > 1, replicas)

    def _zero_key_static(self, layout: ParallelLayout) -> tuple:
        if self.groups.grad_size(layout) == 1:
            return (0, 1)
        return (layout.zero_stage, self.groups.shard_size(layout), self.sync.uses_fsdp(layout), layout.pp > 1)

    def fixed_time_s(self, layout: ParallelLayout) -> float:
        """Step time outside the per-layer prices, each an all-reduce of one float64 over every
        rank that each pipeline rank waits for before its update (every other cost is attributed
        to a layer): gradient clipping's sum of squares, and a token-level loss's count of
        counted targets (`weighs_tokens`)."""
        calls = int(self.train.clip_grad_norm) + int(self.structure.weighs_tokens(layout))
        if not calls:
            return 0.0
        ranks = layout.world_size  # every rank: the mesh order does not change the group
        if ranks not in self._scalar_all_reduce_s:
            group = self.cluster.group_links(list(range(ranks)))
            self._scalar_all_reduce_s[ranks] = self.groups.collective_s(Collective.ALL_REDUCE, SCALAR_BYTES, group)
        return calls * self._scalar_all_reduce_s[ranks]

    # -- a complete layout ----------------------------------------------------------------------

    def estimate(self, layout: ParallelLayout) -> Estimate:
        """Price a layout with its stage split (an even split when `layout.stages` is empty).

        Raises:
            ValueError: the layout or the training settings cannot run.
        """
        validate(layout, self.profile, self.cluster, self.train, self.structure.heads, self.recompute_options)
        problem = self.partition_problem(layout)
        if problem is None:
            raise ValueError("a tensor-parallel group would mix GPU types; change the mesh order or tp")
        starts = self.structure.stage_starts(layout)
        options = self.structure.layer_options(layout, self.recompute_options)
        partition = evaluate(problem, starts, options)
        fits = partition is not None
        if partition is None:
            partition = evaluate(replace(problem, capacity_bytes=[2**62] * problem.devices), starts, options)
        if partition is None:  # without a memory limit every split evaluates
            raise ValueError("the stage split cannot be priced")
        reference = self.ranks.reference_gpu(layout)
        return self.assembler.assemble(layout, problem, partition, fits, self.time_parts_rows(layout, reference),
                                       self.per_step_rows(layout, reference), self.fixed_time_s(layout))

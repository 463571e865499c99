"""Step assembly: price a parallel layout into per-layer times and memory, then a training step.

    from cost_models import estimate, ParallelLayout, TrainSpec, ClusterSpec
    est = estimate(profile, cluster, ParallelLayout(dp=8, zero_stage=1), TrainSpec(global_batch_size=64))

`PlanPricer.partition_problem` turns one configuration (degrees, mesh order, ZeRO, micro-batching,
schedule, SP/CP) into the per-layer prices the planner's partition ILP balances; `estimate`
prices a complete layout (with its stage split) through the same numbers, so a plan's prediction
and the solver's objective are one computation.

Per layer and micro-batch, on the pipeline rank's GPU (compute from `compute.py`, collectives
from `collectives.py`, TP split from `tp_sharding.py`):
    time = compute / cp (sharded ops ÷ tp; replicated ops ÷ tp too under SP)
           + recomputation (selective: the non-GEMM forward again; full: the forward again)
           + TP collectives, on the critical path (forward ones again under full recompute)
           + CP exchange (Ulysses: 4 all-to-alls each way; ring: K/V passed cp-1 times,
             overlapped with attention, only the excess exposed)
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

import math
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from cost_models.collectives import Algorithm, Collective, CollectiveCost, best_algorithm, collective_time_s
from cost_models.compute import ComputeModel, LayerCompute
from cost_models.hardware import GiB, GPUSpec
from cost_models.layout import ParallelLayout, TrainSpec, validate_layout, validate_train
from cost_models.mesh import Mesh
from cost_models.memory import (RECOMPUTE_OPTIONS, LayerActivations, activation_bytes, activations_from_fraction,
                                layer_activations, state_bytes_per_param, trained_model_states)
from cost_models.pipeline import Partition, PartitionProblem, evaluate, in_flight_micro_batches
from cost_models.topology import ClusterSpec, GroupPlacement
from cost_models.tp_sharding import PropagationSplitter, TPLayerSplit, TPSplitter

if TYPE_CHECKING:
    from autopar.profile import ModelProfile

__all__ = ["TrainSpec", "ParallelLayout", "Estimate", "PlanPricer", "estimate", "validate_layout", "TPLayerSplit",
           "TPSplitter"]

CUDA_CONTEXT_BYTES = int(0.75 * GiB)  # CUDA context + cuBLAS/NCCL workspaces, typical on H100/A100
DP_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb; two buckets in flight
RING_TILE_SCORE_BYTES = 256 * 2**20  # fp32 scores of one ring-attention query tile (codegen's context_parallel)
BUCKET_CHOICES_BYTES = tuple(mib * 2**20 for mib in (4, 16, 25, 64, 256, 1024))
POST_BACKWARD_SYNC = (Algorithm.HIERARCHICAL, Algorithm.PARAMETER_SERVER)  # run after backward (gradient_sync.py)
# Fused AdamW streams p, g, m, v in and p, m, v out in fp32 (7 x 4 bytes per parameter); SGD with
# momentum p, g, buf in and p, buf out; plain SGD p, g in and p out.
OPTIMIZER_BYTES_PER_PARAM = {"adam": 28, "sgd": 20, "sgd_plain": 12}
# Slowdown of computation running beside NCCL kernels, as a share of the overlapped
# communication time: NCCL's kernels occupy SMs and memory bandwidth. An assumption (overlapped
# GEMMs typically lose 10-30%), not yet measured here: the committed H100 runs are single-GPU.
OVERLAP_INTERFERENCE = 0.2


@dataclass
class Estimate:
    """The predicted cost of one training step of a layout.

    Attributes:
        step_time_s: one optimizer step.
        tokens_per_s: tokens per second (None when the model has no sequence dimension).
        samples_per_s: samples per second.
        tflops_per_gpu: model FLOPs (no recomputation) per second per GPU, in TFLOP/s.
        mfu, hfu: model / hardware (with recomputation) FLOPs over the GPUs' dense peak.
        peak_memory_bytes: most any rank allocates (max over pipeline ranks).
        memory_breakdown: the peak rank's bytes: params, grads, optimizer, activations,
            buffers; headroom (kept free) and capacity (what may be allocated).
        time_breakdown: seconds per step: compute, recompute, tp_comm, cp_comm, pp_comm,
            dp_comm (exposed), bubble, optimizer; they add up to step_time_s.
        dp_sync_algorithm: the gradient synchronisation chosen.
        device_time_s: per pipeline rank, busy time of one micro-batch.
        device_memory_bytes: per pipeline rank, allocated bytes.
        stages: layer names per (virtual) stage; recompute: option per layer.
        fits: every rank's memory within capacity.
        stage_details: per pipeline rank: GPU, layers, time, memory (and its breakdown),
            in-flight micro-batches, exposed gradient sync and optimizer time per step.
        stage_timings: per (virtual) stage: forward, backward and send seconds of one
            micro-batch (what the timeline plays through the schedule).
    """

    step_time_s: float
    tokens_per_s: float | None
    samples_per_s: float
    tflops_per_gpu: float
    mfu: float
    hfu: float
    peak_memory_bytes: int
    memory_breakdown: dict[str, int]
    time_breakdown: dict[str, float]
    dp_sync_algorithm: str
    device_time_s: list[float]
    device_memory_bytes: list[int]
    stages: list[list[str]]
    recompute: list[str]
    fits: bool
    stage_details: list[dict[str, Any]] = field(default_factory=list)
    stage_timings: list[dict[str, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def proportional_shares(weights: list[float], total: int) -> tuple[int, ...]:
    """Integers summing to `total`, at least 1 each, proportional to `weights` (largest
    remainder: the shares furthest below their ideal get the leftover units)."""
    ideal = [total * w / sum(weights) for w in weights]
    shares = [max(1, int(x)) for x in ideal]
    while sum(shares) > total:
        shares[max(range(len(shares)), key=lambda i: shares[i] - ideal[i])] -= 1
    while sum(shares) < total:
        shares[max(range(len(shares)), key=lambda i: ideal[i] - shares[i])] += 1
    return tuple(shares)


def attention_io_bytes(op: Any) -> tuple[float, float]:
    """(query bytes, key + value bytes) entering a fused attention op, at the element size of its
    output (the compute dtype). Grouped-query attention has fewer K/V heads than query heads, which
    is what makes ring attention's K/V traffic smaller than Ulysses' all-to-alls. Falls back to
    thirds of the bytes read when shapes are missing."""
    shapes = op.input_shapes[:3]
    if len(shapes) < 3 or not op.output_shapes or not op.output_shapes[0]:
        return op.bytes_read / 3, 2 * op.bytes_read / 3
    element = op.output_bytes / max(1, math.prod(op.output_shapes[0]))
    return element * math.prod(shapes[0]), element * (math.prod(shapes[1]) + math.prod(shapes[2]))


def exposed_s(comm_s: float, compute_s: float) -> float:
    """Time a collective adds when overlapped with `compute_s` of independent work: what does not
    fit under the compute, plus OVERLAP_INTERFERENCE of what does (communication kernels take
    SMs and memory bandwidth from the overlapped computation)."""
    return max(0.0, comm_s - compute_s) + OVERLAP_INTERFERENCE * min(comm_s, compute_s)


# -- the module-level entry point ---------------------------------------------------------------

_PRICERS: "OrderedDict[tuple, PlanPricer]" = OrderedDict()
_SHARED: "OrderedDict[int, tuple[Any, ComputeModel, PropagationSplitter | None]]" = OrderedDict()
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


def _shared_models(profile: "ModelProfile") -> tuple[ComputeModel, PropagationSplitter | None]:
    """Compute model and TP propagation of a profile, shared by every pricer of it."""
    entry = _SHARED.get(id(profile))
    if entry is None or entry[0] is not profile:
        entry = (profile, ComputeModel(profile), PropagationSplitter(profile) if profile.ops else None)
        _SHARED[id(profile)] = entry
        while len(_SHARED) > _CACHE_SIZE:
            _SHARED.popitem(last=False)
    return entry[1], entry[2]


class PlanPricer:
    """Prices configurations of one model on one cluster; caches what repeats across calls.

    Args:
        profile: the traced model (autopar.profile.ModelProfile).
        cluster: where it runs.
        train: batch, precision, optimizer.
        tp_splitter: prices a layer under TP (default: the propagation of tp_sharding.py).
        recompute_options: the recompute choices the partition problem offers per layer.
    """

    def __init__(self, profile: "ModelProfile", cluster: ClusterSpec, train: TrainSpec,
                 tp_splitter: TPSplitter | None = None, recompute_options: tuple[str, ...] = RECOMPUTE_OPTIONS):
        self.profile = profile
        self.cluster = cluster
        self.train = train
        self.compute, propagation = _shared_models(profile)
        self.tp_splitter = tp_splitter or propagation
        self.recompute_options = tuple(recompute_options)
        self.layers = profile.layers
        self.layer_index = {layer.name: i for i, layer in enumerate(self.layers)}
        self.b0 = profile.micro_batch_size
        self._splits: dict[tuple, TPLayerSplit] = {}
        self._base_acts: dict[str, LayerActivations] = {}
        self._problems: dict[tuple, PartitionProblem | None] = {}
        self._shared_rows: dict[tuple, dict[str, Any] | None] = {}
        self._in_flight_cache: dict[tuple, list[float]] = {}
        self._totals_cache: dict[int, tuple[list, list]] = {}
        self._devices: dict[tuple, Any] = {}
        self._placements: dict[tuple, GroupPlacement] = {}
        self._collectives: dict[tuple, Any] = {}
        self._rank_gpus: dict[tuple, list[list[GPUSpec]]] = {}
        self._peak_flops = sum(self.cluster.gpu_of_rank(r).flops(self.compute.dtype)
                               for r in range(cluster.world_size))
        self._row_cache: dict[tuple, list] = {}
        self._largest_params = max((layer.param_count for layer in self.layers), default=0)
        self._largest_working_set = max((self._working_set_bytes(layer) for layer in self.layers), default=0)
        self._attention_bytes = self._attention_input_bytes()
        self._score_elements = self._attention_scores()
        self.heads = self._attention_heads()

    @property
    def weights_bytes(self) -> int:
        return state_bytes_per_param(self.train.precision, self.train.optimizer)[0]

    @property
    def grads_bytes(self) -> int:
        return state_bytes_per_param(self.train.precision, self.train.optimizer)[1]

    # -- placement ----------------------------------------------------------------------------

    def placement(self, layout: Any, axes: str | tuple[str, ...]) -> GroupPlacement:
        """Where the group through rank 0 along one mesh axis (or several) sits."""
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        key = (axes, tuple(layout.mesh_order), layout.tp, layout.cp, layout.pp, layout.dp)
        if key not in self._placements:
            self._placements[key] = self.cluster.group_links(Mesh.of(layout).group_ranks(axes))
        return self._placements[key]

    def grad_group(self, layout: Any) -> GroupPlacement:
        """Ranks holding the same parameters: data- x context-parallel (CP ranks see other
        tokens, so their gradients are summed too)."""
        return self.placement(layout, ("dp", "cp"))

    def _grad_size(self, layout: Any) -> int:
        return layout.dp * layout.cp

    def _shard_size(self, layout: Any) -> int:
        """Ranks ZeRO shards over: the gradient group, or its part on one node (hybrid)."""
        return self._shard_group(layout).size

    def _shard_group(self, layout: Any) -> GroupPlacement:
        if not layout.hybrid_shard:
            return self.grad_group(layout)
        key = ("shard", tuple(layout.mesh_order), layout.tp, layout.cp, layout.pp, layout.dp)
        if key not in self._placements:
            ranks = Mesh.of(layout).group_ranks(("dp", "cp"))
            self._placements[key] = self.cluster.group_links(
                [r for r in ranks if r // self.cluster.gpus_per_node == 0])
        return self._placements[key]

    def _replica_group(self, layout: Any) -> GroupPlacement:
        """Hybrid sharding's replicas: one rank per node of the gradient group."""
        key = ("replica", tuple(layout.mesh_order), layout.tp, layout.cp, layout.pp, layout.dp)
        if key not in self._placements:
            firsts: dict[int, int] = {}
            for rank in Mesh.of(layout).group_ranks(("dp", "cp")):
                firsts.setdefault(rank // self.cluster.gpus_per_node, rank)
            self._placements[key] = self.cluster.group_links(sorted(firsts.values()))
        return self._placements[key]

    def pp_rank_gpus(self, layout: Any) -> list[list[GPUSpec]]:
        """GPU types of the ranks of each pipeline rank."""
        key = (tuple(layout.mesh_order), layout.tp, layout.cp, layout.pp, layout.dp)
        if key not in self._rank_gpus:
            mesh = Mesh.of(layout)
            groups: list[list[GPUSpec]] = [[] for _ in range(layout.pp)]
            for rank in range(layout.world_size):
                groups[mesh.coordinate(rank, "pp")].append(self.cluster.gpu_of_rank(rank))
            self._rank_gpus[key] = groups
        return self._rank_gpus[key]

    def collective_s(self, op: Collective, nbytes: float, group: GroupPlacement) -> float:
        """Cheapest-algorithm time, memoised (the planner asks the same questions many times)."""
        key = (op, nbytes, group)
        if key not in self._collectives:
            self._collectives[key] = collective_time_s(op, nbytes, group)
        return self._collectives[key]

    def dp_sync_cost(self, layout: Any, nbytes: float) -> CollectiveCost:
        """Gradient all-reduce on the gradient group: the pinned algorithm or the layout's choice."""
        group = self.grad_group(layout)
        pinned = getattr(layout, "dp_sync", "auto") or "auto"
        algorithm = self.auto_dp_sync(layout) if pinned == "auto" else Algorithm(pinned)
        key = ("dp_sync", algorithm, nbytes, group)
        if key not in self._collectives:
            self._collectives[key] = CollectiveCost(Collective.ALL_REDUCE, algorithm,
                                                    collective_time_s(Collective.ALL_REDUCE, nbytes, group, algorithm))
        return self._collectives[key]

    def exposed_dp_sync_s(self, cost: CollectiveCost, backward_s: float) -> float:
        """What a gradient all-reduce adds to the step: FSDP's ring/tree reductions overlap the
        backward; the generated hierarchical and parameter-server exchanges run after it."""
        if cost.algorithm in POST_BACKWARD_SYNC:
            return cost.seconds
        return exposed_s(cost.seconds, backward_s)

    def auto_dp_sync(self, layout: Any) -> Algorithm:
        """The algorithm adding least to the step for the largest layer's gradients (one choice per
        layout: the generated code uses one): ring, tree, hierarchical, and with ZeRO-0 a
        parameter server (it holds the whole optimizer, which ZeRO-1 shards)."""
        group = self.grad_group(layout)
        key = ("auto_dp_sync", layout.zero_stage, layout.tp, layout.micro_batch_size, group)
        if key not in self._collectives:
            largest = max(self.layers, key=lambda layer: layer.param_count)
            nbytes = largest.param_count * self.grads_bytes / layout.tp
            gpu = self._device_facts(layout)[0]
            backward = (self.compute.layer(largest.name, gpu).backward_s * layout.micro_batch_size / self.b0
                        / (layout.tp * layout.cp))
            options = [Algorithm.RING, Algorithm.TREE] + ([Algorithm.HIERARCHICAL] if group.crosses_nodes else [])
            options += [Algorithm.PARAMETER_SERVER] if layout.zero_stage == 0 else []
            costs = [CollectiveCost(Collective.ALL_REDUCE, a, collective_time_s(Collective.ALL_REDUCE, nbytes, group, a))
                     for a in options]
            self._collectives[key] = min(costs, key=lambda c: (self.exposed_dp_sync_s(c, backward),
                                                               options.index(c.algorithm))).algorithm
        return self._collectives[key]

    def dp_bucket_bytes(self, layout: Any) -> int:
        """Bucket size of the generated hierarchical / parameter-server exchange: the smallest
        candidate whose per-bucket latency adds under 1% to the exchange of all gradients (small
        buckets bound the extra memory; too small ones pay a latency per bucket)."""
        group = self.grad_group(layout)
        if group.size == 1:
            return DP_BUCKET_BYTES
        algorithm = self.dp_sync_cost(layout, 1.0).algorithm
        total = sum(layer.param_count for layer in self.layers) * 4 / layout.tp / layout.pp  # fp32 gradients
        whole = collective_time_s(Collective.ALL_REDUCE, total, group, algorithm)
        latency = collective_time_s(Collective.ALL_REDUCE, 1.0, group, algorithm)
        for bucket in BUCKET_CHOICES_BYTES:
            if (math.ceil(total / bucket) - 1) * latency <= 0.01 * whole:
                return bucket
        return BUCKET_CHOICES_BYTES[-1]

    # -- per-layer prices ---------------------------------------------------------------------

    def split(self, layer_name: str, layout: Any, gpu: GPUSpec) -> TPLayerSplit:
        """The layer kind under the layout's TP degree on `gpu` (cached)."""
        kind = self.compute.kind(layer_name)
        group = self.placement(layout, "tp")
        key = (kind, layout.tp, group.nodes, group.per_node, gpu.signature)
        if key not in self._splits:
            if layout.tp == 1:
                compute = self.compute.layer(kind, gpu)
                self._splits[key] = TPLayerSplit(
                    compute=compute, replicated_forward_s=compute.forward_s, replicated_backward_s=compute.backward_s,
                    comm=(), tp_sharded_activation_fraction=0.0, tp_sharded_param_fraction=0.0,
                    activations=self._base_activations(kind))
            elif self.tp_splitter is None:
                raise ValueError("tp > 1 needs the profile's per-op detail (re-profile without include_ops=False)")
            else:
                self._splits[key] = self.tp_splitter.split(kind, layout.tp, group, gpu)
        return self._splits[key]

    def _base_activations(self, kind: str) -> LayerActivations:
        """Activation accounting without TP (every saved tensor whole)."""
        if kind not in self._base_acts:
            layer = self.profile.layer(kind)
            if self.profile.ops:
                forward = [op for op in self.compute.ops_by_layer.get(kind, []) if op.phase == "forward"]
                self._base_acts[kind] = layer_activations(layer, forward)
            else:  # no per-op detail: selective recomputation keeps everything
                total = float(layer.activation_bytes)
                self._base_acts[kind] = LayerActivations(0.0, total, 0.0, total, float(layer.input_bytes))
        return self._base_acts[kind]

    def layer_activations(self, layer: Any, split: TPLayerSplit) -> LayerActivations:
        if split.activations is not None:
            return split.activations
        kind = self.compute.kind(layer.name)
        return activations_from_fraction(layer, self._base_activations(kind), split.tp_sharded_activation_fraction)

    def partition_problem(self, layout: Any) -> PartitionProblem | None:
        """Per-layer prices of a configuration for the partition solver (None if it cannot run)."""
        key = (layout.dp, layout.tp, layout.pp, layout.cp, tuple(layout.mesh_order), layout.zero_stage,
               layout.hybrid_shard, layout.micro_batch_size, layout.num_micro_batches, layout.schedule,
               layout.chunks, layout.sequence_parallel, layout.cp_strategy, getattr(layout, "dp_sync", "auto"),
               tuple(getattr(layout, "dp_shares", ()) or ()))
        if key in self._problems:
            return self._problems[key]
        rows = self._partition_rows(layout)
        in_flight = self._in_flight(layout.schedule, layout.pp, layout.num_micro_batches, layout.chunks)
        shares = self.dp_shares(layout) if rows is not None else ()
        if shares:  # the rank with the largest share holds that many samples' activations
            in_flight = [held * max(shares) / layout.micro_batch_size for held in in_flight]
        problem = None if rows is None else PartitionProblem(
            **rows, devices=layout.pp, chunks=layout.chunks, micro_batches=layout.num_micro_batches,
            in_flight=in_flight, option_names=self.recompute_options)
        self._problems[key] = problem
        return problem

    def _partition_rows(self, layout: Any) -> dict[str, Any] | None:
        """The schedule-independent part of a partition problem (per-layer prices, memory per
        device, speeds), shared by the layouts that differ only in pipeline schedule and chunks."""
        key = (layout.dp, layout.tp, layout.pp, layout.cp, tuple(layout.mesh_order), layout.zero_stage,
               layout.hybrid_shard, layout.micro_batch_size, layout.sequence_parallel, layout.cp_strategy,
               getattr(layout, "dp_sync", "auto"), tuple(getattr(layout, "dp_shares", ()) or ()))
        if key in self._shared_rows:
            return self._shared_rows[key]
        validate_train(self.train, self.profile)
        devices = self._device_facts(layout)
        if devices is None:
            self._shared_rows[key] = None
            return None
        reference, speed, capacity = devices
        scale = layout.micro_batch_size / self.b0
        times = self._totals(self.time_parts_rows(layout, reference))
        keeps_attention = not self._ring_attention(layout)
        activations = self._rows("activation", layout, (layout.tp, layout.sequence_parallel, layout.cp,
                                                        layout.micro_batch_size, keeps_attention),
                                 lambda layer, split: [int(activation_bytes(self.layer_activations(layer, split), scale,
                                                                            layout.tp, layout.sequence_parallel,
                                                                            layout.cp, option, keeps_attention))
                                                       for option in self.recompute_options], reference)
        statics = self._rows("static", layout, (layout.tp, self._zero_key_static(layout)),
                             lambda layer, split: int(self._states(layer, split, layout).total_bytes), reference)
        sends = self._rows("send", layout, (layout.pp, self._span(layout, "pp"), layout.micro_batch_size,
                                            layout.cp, layout.tp if layout.sequence_parallel else 1),
                           lambda layer, split: self._send_s(layer, layout, scale), reference)
        per_step = self._totals(self.per_step_rows(layout, reference))
        overhead = self._overhead_bytes(layout, scale, reference)
        rows = dict(time_s=times, activation_bytes=activations, static_bytes=statics, send_s=sends,
                    capacity_bytes=capacity, overhead_bytes=[overhead] * layout.pp, speed=speed, per_step_s=per_step)
        self._shared_rows[key] = rows
        return rows

    def _totals(self, rows: list) -> list:
        """Each layer's parts summed (per option where a layer has several), memoised per table:
        `_rows` hands the same table to every layout it applies to."""
        cached = self._totals_cache.get(id(rows))
        if cached is None or cached[0] is not rows:
            cached = (rows, [[sum(parts.values()) for parts in row] if isinstance(row, list) else sum(row.values())
                             for row in rows])
            self._totals_cache[id(rows)] = cached
        return cached[1]

    def _in_flight(self, schedule: str, stages: int, micro_batches: int, chunks: int) -> list[float]:
        key = (schedule, stages, micro_batches, chunks)
        if key not in self._in_flight_cache:
            self._in_flight_cache[key] = [in_flight_micro_batches(schedule, stages, micro_batches, d, chunks)
                                          for d in range(stages)]
        return self._in_flight_cache[key]

    def time_parts_rows(self, layout: Any, reference: GPUSpec) -> list[list[dict[str, float]]]:
        """[layer][recompute option] -> seconds per micro-batch by kind (layer_time_parts)."""
        scale = layout.micro_batch_size / self.b0
        return self._rows("time", layout, (layout.tp, layout.cp, layout.sequence_parallel, layout.cp_strategy,
                                           layout.micro_batch_size, self._zero_key(layout),
                                           self._span(layout, "tp"), self._span(layout, "cp")),
                          lambda layer, split: [self.layer_time_parts(layer, split, layout, scale, option, reference)
                                                for option in self.recompute_options], reference)

    def per_step_rows(self, layout: Any, reference: GPUSpec) -> list[dict[str, float]]:
        """[layer] -> seconds once per step by kind (per_step_parts)."""
        scale = layout.micro_batch_size / self.b0
        return self._rows("per_step", layout, (layout.tp, layout.cp, layout.dp, layout.zero_stage,
                                               layout.hybrid_shard, self._span(layout, ("dp", "cp")),
                                               self._shard_size(layout), layout.micro_batch_size,
                                               getattr(layout, "dp_sync", "auto"), tuple(layout.mesh_order)),
                          lambda layer, split: self.per_step_parts(layer, split, layout, scale, reference), reference)

    def _rows(self, what: str, layout: Any, key: tuple, price: Any, reference: GPUSpec) -> list:
        """One value per layer, priced once per layer kind and cached by what the value depends on
        (the planner prices tens of thousands of configurations that share most of these)."""
        full_key = (what, reference.signature, key)
        if full_key not in self._row_cache:
            by_kind = {}
            for layer in self.layers:
                kind = self.compute.kind(layer.name)
                if kind not in by_kind:
                    by_kind[kind] = price(layer, self.split(layer.name, layout, reference))
            self._row_cache[full_key] = [by_kind[self.compute.kind(layer.name)] for layer in self.layers]
        return self._row_cache[full_key]

    def _span(self, layout: Any, axes: str | tuple[str, ...]) -> tuple[int, int, int, int]:
        """A cheap cache key for a group's placement."""
        group = self.placement(layout, axes)
        return (group.size, group.nodes, group.per_node, group.min_per_node)

    def _zero_key(self, layout: Any) -> tuple:
        if layout.zero_stage < 2 or self._grad_size(layout) == 1:
            return ()
        group = self._shard_group(layout)
        return (layout.zero_stage, group.size, group.nodes, group.per_node)

    def _zero_key_static(self, layout: Any) -> tuple:
        if self._grad_size(layout) == 1:
            return (0, 1)
        return (layout.zero_stage, self._shard_size(layout), self._uses_fsdp(layout), layout.pp > 1)

    def _device_facts(self, layout: Any) -> tuple[GPUSpec, list[float], list[int]] | None:
        """(reference GPU, speed factor and usable memory per pipeline rank), or None when a TP
        group would mix GPU types. Cached per rank layout."""
        key = (layout.tp, layout.cp, layout.pp, layout.dp, tuple(layout.mesh_order), layout.micro_batch_size,
               tuple(getattr(layout, "dp_shares", ()) or ()))
        if key not in self._devices:
            self._devices[key] = self._compute_device_facts(layout)
        return self._devices[key]

    def _compute_device_facts(self, layout: Any):
        if layout.tp > 1 and not self._tp_groups_homogeneous(layout):
            return None
        pp_gpus = self.pp_rank_gpus(layout)
        reference = pp_gpus[0][0]
        distinct = {gpu.name: gpu for group in pp_gpus for gpu in group}
        total = {name: sum(self.split(l.name, layout, gpu).compute.time_s(1.0, gpu.launch_overhead_s)
                           for l in self.layers) for name, gpu in distinct.items()}
        # A pipeline rank's data-parallel replicas run in lockstep: the slowest GPU type paces it,
        # unless each data-parallel rank gets a share of the batch (then the slowest share does).
        slowest_gpu = [max(group, key=lambda g: total[g.name]) for group in pp_gpus]
        speed = [total[g.name] / total[reference.name] if total[reference.name] else 1.0 for g in slowest_gpu]
        shares = self.dp_shares(layout, total)
        if shares and total[reference.name]:
            gpus = self.dp_rank_gpus(layout)
            speed = [max(b * total[g.name] for b, g in zip(shares, gpus))
                     / (layout.micro_batch_size * total[reference.name])]
        capacity = [int(min(g.memory_bytes for g in group) * (1 - self.cluster.memory_headroom_fraction))
                    for group in pp_gpus]
        return reference, speed, capacity

    def dp_rank_gpus(self, layout: Any) -> list[GPUSpec]:
        """GPU type of each data-parallel rank (its first rank: TP groups are one type)."""
        return [self.cluster.gpu_of_rank(r) for r in Mesh.of(layout).group_ranks("dp")]

    def dp_shares(self, layout: Any, total: dict[str, float] | None = None) -> tuple[int, ...]:
        """Samples per micro-batch of each data-parallel rank: the layout's own, or, when its
        data-parallel ranks mix GPU types (pp=1), shares in proportion to each GPU's speed
        (largest remainder, at least one each) so all finish together; () when even."""
        pinned = tuple(getattr(layout, "dp_shares", ()) or ())
        if pinned or layout.pp > 1 or layout.dp == 1:
            return pinned
        gpus = self.dp_rank_gpus(layout)
        if len({g.name for g in gpus}) == 1:
            return ()
        if total is None:
            total = {g.name: sum(self.split(l.name, layout, g).compute.time_s(1.0, g.launch_overhead_s)
                                 for l in self.layers) for g in gpus}
        return proportional_shares([1 / total[g.name] for g in gpus], layout.dp * layout.micro_batch_size)

    def tp_collectives(self, layout: ParallelLayout) -> dict[str, int]:
        """Collective -> how many the TP group issues per step under `layout`'s prices: each
        layer's split (forward ones again where fully recomputed) and, under sequence
        parallelism, its boundaries' gathers, times the micro-batches. What a test counts in a
        generated step."""
        if layout.tp == 1:
            return {}
        reference = self._device_facts(layout)[0]
        counts: dict[str, int] = {}
        options = self.layer_options(layout)
        for layer, option in zip(self.layers, options):
            split = self.split(layer.name, layout, reference)
            forward_count = len(split.comm) // 2 if split.forward_comm is None else split.forward_comm
            issued = list(split.comm) + (list(split.comm[:forward_count]) if self.recompute_options[option] == "full" else [])
            if layout.sequence_parallel:
                issued += list(split.sp.comm)
                if self.recompute_options[option] == "full":
                    issued += list(split.sp.comm[:split.sp.forward_comm])
            for op, _ in issued:
                counts[op] = counts.get(op, 0) + layout.num_micro_batches
        return counts

    def fixed_time_s(self, layout: Any) -> float:
        """Step time outside the per-layer prices: none (every cost is attributed to a layer)."""
        return 0.0

    def _tp_groups_homogeneous(self, layout: Any) -> bool:
        """A TP group never mixes GPU types (its ranks run in lockstep on sharded work)."""
        return all(len({self.cluster.gpu_of_rank(rank).name for rank in group}) == 1
                   for group in Mesh.of(layout).groups("tp"))

    def layer_time_parts(self, layer: Any, split: TPLayerSplit, layout: Any, scale: float, option: str,
                         gpu: GPUSpec) -> dict[str, float]:
        """Seconds one micro-batch spends on a layer, by kind (compute, recompute, tp_comm,
        cp_comm, dp_comm)."""
        compute = split.compute
        overhead = gpu.launch_overhead_s
        forward_passes, nongemm_passes = {"none": (1.0, 0.0), "selective": (1.0, 1.0), "full": (2.0, 0.0)}[option]
        per_token = scale / layout.cp
        plain = self._compute_s(split, layout, per_token, gpu)
        total = self._compute_s(split, layout, per_token, gpu, forward_passes, nongemm_passes)
        tp_group = self.placement(layout, "tp")
        forward_count = len(split.comm) // 2 if split.forward_comm is None else split.forward_comm
        tp_times = [self.collective_s(Collective(op), nbytes * per_token, tp_group) for op, nbytes in split.comm]
        tp_comm = sum(tp_times)
        if option == "full":  # the re-run forward repeats its collectives
            tp_comm += sum(tp_times[:forward_count])
        if layout.sequence_parallel and layout.tp > 1:
            # The gathers of the sequence into replicated modules (tp_layout.SP_BOUNDARY).
            sp_times = [self.collective_s(Collective(op), nbytes * per_token, tp_group) for op, nbytes in split.sp.comm]
            tp_comm += sum(sp_times) + (sum(sp_times[:split.sp.forward_comm]) if option == "full" else 0.0)
        recompute = total - plain
        if option == "selective" and self._ring_attention(layout):
            # Selective recomputation keeps attention's output, but ring attention runs in a
            # region it recomputes whole (its quadratic scores are never kept).
            recompute += compute.attention_forward_s * per_token
        return self._scaled({"compute": plain, "recompute": recompute, "tp_comm": tp_comm,
                             "cp_comm": self._cp_time_s(layer, layout, scale, compute, option),
                             "dp_comm": self._zero_micro_batch_s(layer, split, layout, compute, per_token, overhead)})

    def _scaled(self, parts: dict[str, float]) -> dict[str, float]:
        """Parts times the cluster's measured correction factors (1 unless calibrated from runs)."""
        if not self.cluster.time_scale:
            return parts
        return {part: seconds * self.cluster.scale_of(part) for part, seconds in parts.items()}

    @staticmethod
    def _compute_s(split: TPLayerSplit, layout: Any, per_token: float, gpu: GPUSpec, forward_passes: float = 1.0,
                   nongemm_passes: float = 0.0) -> float:
        """Compute seconds of a layer's micro-batch, recomputation included as asked."""
        seconds = split.compute.time_s(per_token, gpu.launch_overhead_s, forward_passes, nongemm_passes)
        if layout.sequence_parallel and layout.tp > 1:
            # The replicated ops that run on the rank's slice of the sequence (norms, residual
            # adds, dropout; not a replicated module's, which gathers the whole sequence: see
            # cost_models/tp_layout.py) do 1/t of the work.
            share = (1 - 1 / layout.tp) * per_token
            seconds -= share * (forward_passes * split.sp.forward_s + split.sp.backward_s)
        return seconds

    def compute_floor(self, layout: Any) -> tuple[list[float], list[float]] | None:
        """(per-layer compute seconds of a micro-batch, speed per pipeline rank), or None when the
        layout cannot run. No communication and no recomputation: every option's price is at
        least this, and it costs a fraction of `partition_problem`, so the search orders
        candidates by it and prices only those that could still win."""
        devices = self._device_facts(layout)
        if devices is None:
            return None
        reference, speed, _ = devices
        per_token = layout.micro_batch_size / self.b0 / layout.cp
        rows = self._rows("compute_floor", layout, (layout.tp, self._span(layout, "tp"), layout.sequence_parallel,
                                                    layout.cp, layout.micro_batch_size),
                          lambda layer, split: self._compute_s(split, layout, per_token, reference), reference)
        return rows, speed

    @staticmethod
    def _ring_attention(layout: Any) -> bool:
        """Whether attention runs as ring attention: blockwise scores in the working set, and
        nothing of it (scores or output) kept by selective recomputation, which reruns it whole."""
        return layout.cp > 1 and layout.cp_strategy == "ring"

    def _cp_time_s(self, layer: Any, layout: Any, scale: float, compute: LayerCompute, option: str = "none") -> float:
        if layout.cp == 1:
            return 0.0
        q, kv = (b * scale / (layout.cp * layout.tp)
                 for b in self._attention_bytes.get(self.compute.kind(layer.name), (0.0, 0.0)))
        if q + kv == 0:
            return 0.0
        group = self.placement(layout, "cp")
        # A recomputed layer (full, or selective, whose policy keeps GEMM, attention and TP
        # collective outputs but not ring passes or all-to-alls) repeats its forward exchanges.
        forwards = 2 if option in ("full", "selective") else 1
        if layout.cp_strategy == "ulysses":
            # Jacobs et al. 2023 (DeepSpeed-Ulysses): q, k, v to the head-sharded layout and the
            # output (q's size) back, one all-to-all each, and the same for their gradients; on
            # the critical path (attention needs all of them). A recomputed forward repeats them.
            return (forwards + 1) * (2 * self.collective_s(Collective.ALL_TO_ALL, q, group)
                                     + self.collective_s(Collective.ALL_TO_ALL, kv, group))
        # Ring attention (Liu et al. 2023): cp-1 steps pass this rank's K and V block forward (again
        # in a recomputed forward); backward passes K, V and their gradients; each transfer
        # overlaps the attention of the block in hand, so at long sequences (attention quadratic,
        # transfers linear) it hides.
        exchange = (forwards + 2) * (layout.cp - 1) * self.collective_s(Collective.SEND_RECV, kv, group)
        attention = (compute.attention_s + (forwards - 1) * compute.attention_forward_s
                     or 0.5 * (compute.forward_s + compute.backward_s))
        return exposed_s(exchange, attention * scale / layout.cp)

    def _zero_micro_batch_s(self, layer: Any, split: TPLayerSplit, layout: Any, compute: LayerCompute,
                            per_token: float, overhead: float) -> float:
        """ZeRO-2/3 traffic every micro-batch, prefetched behind the layer's compute."""
        if layout.zero_stage < 2 or self._grad_size(layout) == 1:
            return 0.0
        group = self._shard_group(layout)
        params = self._tp_params(layer, split, layout)
        rs = self.collective_s(Collective.REDUCE_SCATTER, params * self.grads_bytes, group)
        backward = compute.backward_s * per_token + compute.backward_launches * overhead
        if layout.zero_stage == 2:
            return exposed_s(rs, backward)
        gather = self.collective_s(Collective.ALL_GATHER, params * self.weights_bytes, group)
        forward = compute.forward_s * per_token + compute.forward_launches * overhead
        # ZeRO-3 gathers the layer's parameters before its forward and again before its backward.
        return exposed_s(gather, forward) + exposed_s(gather + rs, backward)

    def per_step_parts(self, layer: Any, split: TPLayerSplit, layout: Any, scale: float,
                       gpu: GPUSpec) -> dict[str, float]:
        """Seconds once per step for a layer: optimizer update and exposed gradient sync."""
        params = self._tp_params(layer, split, layout)
        grad_size = self._grad_size(layout)
        shard = self._shard_size(layout) if layout.zero_stage >= 1 and grad_size > 1 else 1
        bandwidth = gpu.memory_bandwidth_Bps * gpu.efficiency_of("elementwise")
        update = params / shard * OPTIMIZER_BYTES_PER_PARAM.get(self.train.optimizer, 28) / bandwidth
        if grad_size == 1 or params == 0:
            return self._scaled({"optimizer": update, "dp_comm": 0.0})
        per_token = scale / layout.cp
        backward = split.compute.backward_s * per_token + split.compute.backward_launches * gpu.launch_overhead_s
        exposed = 0.0
        if layout.zero_stage <= 1:
            exposed = self.exposed_dp_sync_s(self.dp_sync_cost(layout, params * self.grads_bytes), backward)
            if layout.zero_stage == 1:  # updated shards gathered back to every replica
                exposed += self.collective_s(Collective.ALL_GATHER, params * self.weights_bytes,
                                             self._shard_group(layout))
            return self._scaled({"optimizer": update, "dp_comm": exposed})
        if layout.hybrid_shard and self._shard_size(layout) < grad_size:
            exposed += self.collective_s(Collective.ALL_REDUCE, params * self.grads_bytes / self._shard_size(layout),
                                         self._replica_group(layout))
        if layout.zero_stage == 2:
            exposed += self.collective_s(Collective.ALL_GATHER, params * self.weights_bytes, self._shard_group(layout))
        return self._scaled({"optimizer": update, "dp_comm": exposed})

    def _tp_params(self, layer: Any, split: TPLayerSplit, layout: Any) -> float:
        sharded = layer.param_count * split.tp_sharded_param_fraction
        return sharded / layout.tp + (layer.param_count - sharded)

    def _states(self, layer: Any, split: TPLayerSplit, layout: Any):
        grad_size = self._grad_size(layout)
        return trained_model_states(self._tp_params(layer, split, layout), self.train.precision,
                                    self.train.optimizer, layout.zero_stage if grad_size > 1 else 0,
                                    self._shard_size(layout) if grad_size > 1 else 1, fsdp=self._uses_fsdp(layout),
                                    pipelined=layout.pp > 1)

    def _uses_fsdp(self, layout: Any) -> bool:
        """Whether the generated code wraps the model in FSDP: gradients averaged over ranks by
        FSDP's reduction, not the hierarchical / parameter-server exchange (ZeRO-0/1 only); on a
        lone data-parallel rank for its mixed precision when a GPU computes in 16 bit
        (codegen's `fsdp_wraps`)."""
        if self._grad_size(layout) == 1:
            return self.train.precision != "fp32" and any(gpu.name != "cpu" for gpu in self.cluster.node_gpus)
        return layout.zero_stage >= 2 or layout.cp > 1 or \
            self.dp_sync_cost(layout, 1.0).algorithm not in POST_BACKWARD_SYNC

    def _send_s(self, layer: Any, layout: Any, scale: float) -> float:
        """Activation to the next stage forward and its gradient back (Narayanan et al. 2021:
        b·s·h per micro-batch; ÷ t under SP, ÷ cp)."""
        if layout.pp == 1:
            return 0.0
        nbytes = layer.output_bytes * scale / layout.cp / (layout.tp if layout.sequence_parallel else 1)
        return 2 * self.collective_s(Collective.SEND_RECV, nbytes, self.placement(layout, "pp")) * \
            self.cluster.scale_of("pp_comm")

    def _overhead_bytes(self, layout: Any, scale: float, gpu: GPUSpec) -> int:
        return int(sum(self._buffers(layout, scale, gpu).values()))

    def _buffers(self, layout: Any, scale: float, gpu: GPUSpec) -> dict[str, float]:
        """Memory besides model states and stored activations (the gathered compute copy of
        ZeRO-0..2 parameters scales with a stage's layers: it is in `trained_model_states`)."""
        largest = self._largest_params / layout.tp
        buffers = {"cuda_context": CUDA_CONTEXT_BYTES if gpu.name != "cpu" else 0}
        if layout.zero_stage == 3 and self._grad_size(layout) > 1 and layout.pp == 1:
            # This layer's and the prefetched next layer's gathered parameters (FSDP's default;
            # a pipeline stage keeps all of its layers', see `trained_model_states`).
            buffers["zero3_gathered_params"] = 2 * largest * self.weights_bytes
        if self._uses_fsdp(layout):
            # FSDP reduces one layer's gradients at a time, from an fp32 copy (reduce_dtype).
            buffers["gradient_reduce"] = largest * 4
        elif self._grad_size(layout) > 1:
            # The generated hierarchical / parameter-server exchange: a flat bucket and its result.
            buffers["dp_buckets"] = 2 * self.dp_bucket_bytes(layout)
        # A layer's full activations while its backward (or its recomputation) runs; under ring
        # attention, where more, one K/V block's fp32 scores and their exponentials, alive
        # together while the block runs (in forward, and in backward, which recomputes them).
        # Transients of different moments: the larger counts, not their sum.
        ring = 0.0
        if self._ring_attention(layout):
            block = 4 * self._score_elements * scale / layout.tp / layout.cp ** 2
            ring = 2 * min(block, RING_TILE_SCORE_BYTES)  # codegen tiles a block's queries to this
        buffers["working_set"] = max(self._largest_working_set * scale / layout.tp / layout.cp, ring)
        return buffers

    def _working_set_bytes(self, layer: Any) -> float:
        """What a layer's backward holds beyond the stored activations, at the profiled
        micro-batch: its full activations (recomputed, or gradients as large) or, where more, its
        two largest gradient temporaries alive together (an op's incoming and outgoing gradient:
        a loss's logit gradients, twice what its log-softmax saved; on an H100 a 1B Llama at
        micro-batch 8 held 2 GB more than the layer's activations there)."""
        ops = self.compute.ops_by_layer.get(self.compute.kind(layer.name), [])
        gradients = sorted((op.output_bytes for op in ops if op.phase == "backward"), reverse=True)
        return max(float(layer.activation_bytes), float(sum(gradients[:2])))

    def _attention_input_bytes(self) -> dict[str, tuple[float, float]]:
        """Per layer, (query, key + value) bytes entering fused attention: what context
        parallelism moves. Only those inputs: a mask the model materialised (Hugging Face builds
        an S x S one when traced) is not part of the exchange."""
        result: dict[str, tuple[float, float]] = {}
        for op in self.profile.ops:
            if op.op_class == "attention" and op.phase == "forward":
                q, kv = attention_io_bytes(op)
                before = result.get(op.layer, (0.0, 0.0))
                result[op.layer] = (before[0] + q, before[1] + kv)
        return result

    def _attention_scores(self) -> float:
        """Elements of the largest fused attention's score matrix (batch x heads x queries x
        keys) at the profiled micro-batch: what ring attention's blocks materialise."""
        largest = 0.0
        for op in self.profile.ops:
            if op.op_class == "attention" and op.phase == "forward" and len(op.input_shapes) >= 2 and \
                    len(op.input_shapes[0]) == 4 and len(op.input_shapes[1]) == 4:
                batch, heads, queries, _ = op.input_shapes[0]
                largest = max(largest, float(batch * heads * queries * op.input_shapes[1][2]))
        return largest

    def _attention_heads(self) -> int | None:
        """Attention heads (dim 1 of the first fused attention's query), for Ulysses' divisibility."""
        for op in self.profile.ops:
            if op.op_class == "attention" and op.phase == "forward" and op.input_shapes and \
                    len(op.input_shapes[0]) == 4:
                return int(op.input_shapes[0][1])
        return None

    # -- a complete layout ----------------------------------------------------------------------

    def estimate(self, layout: ParallelLayout) -> Estimate:
        """Price a layout with its stage split (an even split when `layout.stages` is empty).

        Raises:
            ValueError: the layout or the training settings cannot run.
        """
        validate_train(self.train, self.profile)
        validate_layout(layout, self.cluster, self.train, [layer.name for layer in self.layers],
                        self.profile.tokens_per_sample, self.heads, self.recompute_options)
        problem = self.partition_problem(layout)
        if problem is None:
            raise ValueError("a tensor-parallel group would mix GPU types; change the mesh order or tp")
        starts = self.stage_starts(layout)
        options = self.layer_options(layout)
        partition = evaluate(problem, starts, options)
        fits = partition is not None
        if partition is None:
            partition = evaluate(replace(problem, capacity_bytes=[2**62] * problem.devices), starts, options)
        return self._assemble(layout, problem, partition, fits)

    def stage_starts(self, layout: ParallelLayout) -> list[int]:
        stages = layout.pp * layout.chunks
        if layout.stages:
            return [self.layer_index[stage[0]] for stage in layout.stages]
        count = len(self.layers)
        return [round(j * count / stages) for j in range(stages)]

    def layer_options(self, layout: ParallelLayout) -> list[int]:
        recompute = layout.recompute
        names = [recompute.get(layer.name, "none") if isinstance(recompute, dict) else recompute
                 for layer in self.layers]
        return [self.recompute_options.index(name) for name in names]

    def _assemble(self, layout: ParallelLayout, problem: PartitionProblem, partition: Partition,
                  fits: bool) -> Estimate:
        step = partition.step_time_s
        batch = self.train.global_batch_size
        samples = batch / step
        tokens = samples * self.profile.tokens_per_sample if self.profile.tokens_per_sample else None
        model_flops = self.profile.flops_total * batch / self.b0
        recompute_flops = sum(self._recompute_flops(layer, problem.option_names[option], layout)
                              for layer, option in zip(self.layers, partition.options)) * batch / self.b0
        peak = self._peak_flops
        slowest = max(range(layout.pp), key=lambda d: partition.device_time_s[d])
        peak_device = max(range(layout.pp), key=lambda d: partition.device_memory_bytes[d])
        stages = partition.stages(len(self.layers))
        return Estimate(
            step_time_s=step, tokens_per_s=tokens, samples_per_s=samples,
            tflops_per_gpu=model_flops / step / layout.world_size / 1e12,
            mfu=model_flops / step / peak, hfu=(model_flops + recompute_flops) / step / peak,
            peak_memory_bytes=int(partition.device_memory_bytes[peak_device]),
            memory_breakdown=self._memory_breakdown(layout, problem, partition, peak_device, stages),
            time_breakdown=self._time_breakdown(layout, problem, partition, slowest, stages),
            dp_sync_algorithm=self._dp_algorithm(layout),
            device_time_s=partition.device_time_s, device_memory_bytes=partition.device_memory_bytes,
            stages=[[self.layers[l].name for l in stage] for stage in stages],
            recompute=[problem.option_names[o] for o in partition.options], fits=fits,
            stage_details=self._stage_details(layout, problem, partition, stages),
            stage_timings=self._stage_timings(layout, problem, partition, stages))

    def _recompute_flops(self, layer: Any, option: str, layout: ParallelLayout) -> float:
        if option == "full":
            return layer.flops_forward
        if option == "selective":
            kept = ("gemm",) if self._ring_attention(layout) else ("gemm", "attention")
            return sum(c.flops for name, c in layer.forward_by_class.items() if name not in kept)
        return 0.0

    def _dp_algorithm(self, layout: ParallelLayout) -> str:
        if self._grad_size(layout) == 1:
            return "none"
        if layout.zero_stage >= 2:
            return "reduce_scatter (ring)"
        params = max(layer.param_count for layer in self.layers)
        return self.dp_sync_cost(layout, params * self.grads_bytes).algorithm.value

    def _device_layers(self, layout: ParallelLayout, stages: list[list[int]], device: int) -> list[int]:
        return [l for j, stage in enumerate(stages) if j % layout.pp == device for l in stage]

    def _memory_breakdown(self, layout, problem, partition, device, stages) -> dict[str, int]:
        reference = self._device_facts(layout)[0]
        states = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "compute_copy": 0.0}
        for l in self._device_layers(layout, stages, device):
            layer = self.layers[l]
            s = self._states(layer, self.split(layer.name, layout, reference), layout)
            states["params"] += s.params_bytes
            states["grads"] += s.grads_bytes
            states["optimizer"] += s.optimizer_bytes
            states["compute_copy"] += s.compute_copy_bytes
        activations = sum(problem.in_flight[device] * problem.activation_bytes[l][partition.options[l]]
                          for l in self._device_layers(layout, stages, device))
        memory = min(g.memory_bytes for g in self.pp_rank_gpus(layout)[device])
        copy = states.pop("compute_copy")
        return {**{k: int(v) for k, v in states.items()}, "activations": int(activations),
                "buffers": int(problem.overhead_bytes[device] + copy),
                "headroom": int(memory * self.cluster.memory_headroom_fraction),
                "capacity": int(problem.capacity_bytes[device])}

    def _time_breakdown(self, layout, problem, partition, device, stages) -> dict[str, float]:
        """Seconds per step on the critical pipeline rank, adding up to the step time."""
        m = layout.num_micro_batches
        reference = self._device_facts(layout)[0]
        time_rows = self.time_parts_rows(layout, reference)
        speed = problem.speed_of(device)
        parts = dict.fromkeys(("compute", "recompute", "tp_comm", "cp_comm", "pp_comm", "dp_comm"), 0.0)
        for l in self._device_layers(layout, stages, device):
            for name, seconds in time_rows[l][partition.options[l]].items():
                parts[name] += m * seconds * speed
        parts["pp_comm"] = m * speed * sum(problem.send_s[stage[-1]] for j, stage in enumerate(stages)
                                           if j % layout.pp == device and j < len(stages) - 1)
        per_device = self._per_step_by_device(layout, problem, stages)
        once = max(per_device, key=lambda totals: totals["optimizer"] + totals["dp_comm"])
        parts["dp_comm"] += once["dp_comm"]
        parts["optimizer"] = once["optimizer"]
        busy = sum(parts.values())
        parts["bubble"] = max(0.0, partition.step_time_s - busy)
        return {key: parts[key] for key in ("compute", "recompute", "tp_comm", "cp_comm", "pp_comm", "dp_comm",
                                            "bubble", "optimizer")}

    def _stage_details(self, layout, problem, partition, stages) -> list[dict[str, Any]]:
        pp_gpus = self.pp_rank_gpus(layout)
        per_step = self._per_step_by_device(layout, problem, stages)
        return [{"pp_rank": d, "gpu": sorted({g.name for g in pp_gpus[d]}),
                 "layers": [self.layers[l].name for l in self._device_layers(layout, stages, d)],
                 "time_per_micro_batch_s": partition.device_time_s[d],
                 "memory_bytes": partition.device_memory_bytes[d],
                 "capacity_bytes": problem.capacity_bytes[d],
                 "memory_breakdown": self._memory_breakdown(layout, problem, partition, d, stages),
                 "in_flight_micro_batches": problem.in_flight[d], "speed": problem.speed_of(d),
                 "dp_comm_s": per_step[d]["dp_comm"], "optimizer_s": per_step[d]["optimizer"]}
                for d in range(layout.pp)]

    def _per_step_by_device(self, layout, problem, stages) -> list[dict[str, float]]:
        """Per pipeline rank: exposed gradient synchronisation and optimizer seconds, once per step."""
        rows = self.per_step_rows(layout, self._device_facts(layout)[0])
        result = []
        for d in range(layout.pp):
            totals = {"optimizer": 0.0, "dp_comm": 0.0}
            for l in self._device_layers(layout, stages, d):
                for name, seconds in rows[l].items():
                    totals[name] += seconds * problem.speed_of(d)
            result.append(totals)
        return result

    def _stage_timings(self, layout, problem, partition, stages) -> list[dict[str, float]]:
        """Per (virtual) stage, one micro-batch: forward, backward (with its recomputation) and
        the send of its output to the next stage (half of the layer's send_s, the other half
        being the gradient coming back). A layer's time outside recomputation is split between
        forward and backward by its traced FLOPs (backward ~2x forward): the sum per device is
        the partition's device time, which the timeline plays through the schedule."""
        rows = self.time_parts_rows(layout, self._device_facts(layout)[0])
        timings = []
        for j, stage in enumerate(stages):
            speed = problem.speed_of(j % layout.pp)
            forward = backward = 0.0
            for l in stage:
                layer, option = self.layers[l], partition.options[l]
                recompute = rows[l][option]["recompute"] * speed
                rest = problem.time_s[l][option] * speed - recompute
                flops = layer.flops_forward + layer.flops_backward
                share = layer.flops_forward / flops if flops else 1 / 3
                forward += share * rest
                backward += (1 - share) * rest + recompute
            send = problem.send_s[stage[-1]] * speed / 2 if j < len(stages) - 1 else 0.0
            timings.append({"stage": j, "pp_rank": j % layout.pp, "forward_s": forward, "backward_s": backward,
                            "send_s": send})
        return timings

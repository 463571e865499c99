"""Step assembly: price a parallel layout into per-layer times and memory, then a step.

`PlanPricer.partition_problem` turns one configuration (degrees, mesh order, ZeRO, micro-batching,
schedule, SP/CP) into the per-layer prices the planner's partition ILP balances; `estimate`
prices a complete layout (with its stage split) through the same numbers, so a plan's
prediction and the solver's objective are one computation.

Per layer and micro-batch (compute from `compute.py`, collectives from `collectives.py`):
    time = compute / cp (÷ tp where sharded, replicated ops ÷ tp too under SP)
           + TP collectives on the critical path (the operator-wise split's all-reduces)
           + CP exchange (Ulysses: 4 all-to-alls each way; ring: K/V passed cp-1 times,
             overlapped with attention, only the excess exposed)
           + ZeRO-3 parameter all-gathers / ZeRO-2,3 gradient reduce-scatters beyond the
             compute they overlap with (prefetch)
           + recomputation (selective: element-wise forward again; full: forward again)
Once per step and layer: gradient synchronisation over DP not hidden behind that layer's
backward (bucketed overlap), ZeRO-1/2's parameter all-gather after the update, and the
optimizer's memory-bound update.
Memory per device: `memory.py`'s model states and activations × in-flight micro-batches of the
schedule (`pipeline.py`), plus buffers (prefetched parameters, DP buckets, the recomputed
layer's working set, the CUDA context) under (1 - headroom) of the GPU's memory.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from cost_models.collectives import Algorithm, Collective, best_algorithm, collective_time_s
from cost_models.compute import ComputeModel, LayerCompute
from cost_models.hardware import GiB, GPUSpec
from cost_models.memory import ActivationSplit, activation_bytes, model_states, state_bytes_per_param
from cost_models.pipeline import in_flight_micro_batches
from cost_models.topology import ClusterSpec, GroupPlacement

if TYPE_CHECKING:
    from autopar.profile import ModelProfile
    from cost_models.pipeline import Partition, PartitionProblem

CUDA_CONTEXT_BYTES = int(0.75 * GiB)
DP_BUCKET_BYTES = 25 * 2**20
OPTIMIZER_BYTES_PER_PARAM = {"adam": 28, "sgd": 16}  # read p, g, states; write p, states (fp32)
RECOMPUTE_OPTIONS = ("none", "selective", "full")
# Slowdown of computation running beside NCCL kernels, as a share of the overlapped
# communication time (typically 10-30% for overlapped GEMMs; calibration may refit it).
OVERLAP_INTERFERENCE = 0.2


@dataclass(frozen=True)
class TrainSpec:
    """Training settings the cost depends on."""

    global_batch_size: int
    precision: str = "bf16"
    optimizer: str = "adam"


@dataclass(frozen=True)
class ParallelLayout:
    """A plan as the cost model sees it (autopar.plan.Plan carries the same fields)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    mesh_order: tuple[str, ...] = ("tp", "cp", "pp", "dp")
    zero_stage: int = 0
    hybrid_shard: bool = False
    micro_batch_size: int = 1
    num_micro_batches: int = 1
    schedule: str = "1f1b"
    chunks: int = 1
    sequence_parallel: bool = False
    cp_strategy: str = "ulysses"
    dp_sync: str = "auto"
    stages: tuple[tuple[str, ...], ...] = ()
    recompute: Any = "none"  # one option for every layer, or {layer: option}

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def degree(self, axis: str) -> int:
        return getattr(self, axis)


@dataclass(frozen=True)
class TPLayerSplit:
    """A layer kind under tensor parallelism of degree t, at the profiled micro-batch."""

    compute: LayerCompute  # after sharding
    replicated_forward_s: float  # part of compute.forward_s that sequence parallelism divides
    replicated_backward_s: float
    comm: tuple[tuple[str, float], ...]  # (collective, bytes) per micro-batch, forward + backward
    tp_sharded_activation_fraction: float
    tp_sharded_param_fraction: float
    styles: dict[str, str] = field(default_factory=dict)


class TPSplitter(Protocol):
    """Chooses and prices a layer's operator-wise TP split (autopar's intra-op ILP)."""

    def split(self, layer_name: str, tp: int, group: GroupPlacement, gpu: GPUSpec) -> TPLayerSplit: ...


@dataclass
class Estimate:
    """The predicted cost of one training step of a layout."""

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def exposed_s(comm_s: float, compute_s: float) -> float:
    """Time a collective adds when overlapped with `compute_s` of independent work: what does not
    fit under the compute, plus OVERLAP_INTERFERENCE of what does (communication kernels take
    SMs and memory bandwidth from the overlapped computation)."""
    return max(0.0, comm_s - compute_s) + OVERLAP_INTERFERENCE * min(comm_s, compute_s)


def mesh_strides(layout: Any) -> dict[str, int]:
    """Rank stride of each mesh axis (innermost axis stride 1)."""
    strides, stride = {}, 1
    for axis in layout.mesh_order:
        strides[axis] = stride
        stride *= layout.degree(axis)
    return strides


class PlanPricer:
    """Prices configurations of one model on one cluster; caches what repeats across calls."""

    def __init__(self, profile: "ModelProfile", cluster: ClusterSpec, train: TrainSpec,
                 tp_splitter: TPSplitter | None = None, recompute_options: tuple[str, ...] = RECOMPUTE_OPTIONS):
        self.profile = profile
        self.cluster = cluster
        self.train = train
        self.tp_splitter = tp_splitter
        self.recompute_options = tuple(recompute_options)
        self.compute = ComputeModel(profile)
        self.layers = profile.layers
        self.layer_index = {layer.name: i for i, layer in enumerate(self.layers)}
        self.b0 = profile.micro_batch_size
        self._splits: dict[tuple, TPLayerSplit] = {}
        self._problems: dict[tuple, "PartitionProblem"] = {}
        self._devices: dict[tuple, Any] = {}
        self._placements: dict[tuple, GroupPlacement] = {}
        self._collectives: dict[tuple, float] = {}
        self._row_cache: dict[tuple, list] = {}
        self._largest_params = max(layer.param_count for layer in self.layers)
        self._largest_activation = max(layer.activation_bytes for layer in self.layers)
        self._fractions = {layer.name: self._selective_keep_fraction(layer.name) for layer in self.layers}
        self._attention_bytes = self._attention_input_bytes()

    # -- placement --------------------------------------------------------------------------

    def placement(self, layout: Any, axis: str) -> GroupPlacement:
        key = (axis, tuple(layout.mesh_order), layout.tp, layout.cp, layout.pp, layout.dp)
        if key not in self._placements:
            self._placements[key] = self.cluster.strided_placement(layout.degree(axis), mesh_strides(layout)[axis])
        return self._placements[key]

    def pp_rank_gpus(self, layout: Any) -> list[list[GPUSpec]]:
        """GPU types of the ranks of each pipeline rank."""
        strides = mesh_strides(layout)
        groups: list[list[GPUSpec]] = [[] for _ in range(layout.pp)]
        for rank in range(layout.world_size):
            groups[(rank // strides["pp"]) % layout.pp].append(self.cluster.gpu_of_rank(rank))
        return groups

    # -- per-layer prices ---------------------------------------------------------------------

    def split(self, layer_name: str, layout: Any, gpu: GPUSpec) -> TPLayerSplit:
        kind = self.compute.kind(layer_name)
        group = self.placement(layout, "tp")
        key = (kind, layout.tp, group.nodes, group.per_node, gpu.name)
        if key not in self._splits:
            if layout.tp == 1:
                compute = self.compute.layer(kind, gpu)
                self._splits[key] = TPLayerSplit(compute=compute, replicated_forward_s=compute.forward_s,
                                                 replicated_backward_s=compute.backward_s, comm=(),
                                                 tp_sharded_activation_fraction=0.0, tp_sharded_param_fraction=0.0)
            elif self.tp_splitter is None:
                raise ValueError("tensor parallelism needs an operator-wise splitter (autopar's intra-op solver)")
            else:
                self._splits[key] = self.tp_splitter.split(kind, layout.tp, group, gpu)
        return self._splits[key]

    def partition_problem(self, layout: Any) -> "PartitionProblem | None":
        """Per-layer prices of a configuration for the partition solver (None if it cannot run)."""
        from cost_models.pipeline import PartitionProblem

        key = (layout.dp, layout.tp, layout.pp, layout.cp, tuple(layout.mesh_order), layout.zero_stage,
               layout.hybrid_shard, layout.micro_batch_size, layout.num_micro_batches, layout.schedule,
               layout.chunks, layout.sequence_parallel, layout.cp_strategy, getattr(layout, "dp_sync", "auto"))
        if key in self._problems:
            return self._problems[key]
        devices = self._device_facts(layout)
        if devices is None:
            self._problems[key] = None
            return None
        reference, speed, capacity = devices
        scale = layout.micro_batch_size / self.b0
        times = self._rows("time", layout, (layout.tp, layout.cp, layout.sequence_parallel, layout.cp_strategy,
                                            layout.micro_batch_size, self._zero_key(layout),
                                            self._span(layout, "tp"), self._span(layout, "cp")),
                           lambda layer, split: [self._layer_time_s(layer, split, layout, scale, option)
                                                 for option in self.recompute_options], reference)
        activations = self._rows("activation", layout, (layout.tp, layout.sequence_parallel, layout.cp,
                                                        layout.micro_batch_size),
                                 lambda layer, split: [int(self._activation_bytes(layer, split, layout, scale, option))
                                                       for option in self.recompute_options], reference)
        statics = self._rows("static", layout, (layout.tp, layout.zero_stage if layout.dp > 1 else 0,
                                                self._shard_size(layout) if layout.dp > 1 else 1),
                             lambda layer, split: int(self._static_bytes(layer, split, layout)), reference)
        sends = self._rows("send", layout, (layout.pp, self._span(layout, "pp"), layout.micro_batch_size,
                                            layout.cp, layout.tp if layout.sequence_parallel else 1),
                           lambda layer, split: self._send_s(layer, layout, scale), reference)
        per_step = self._rows("per_step", layout, (layout.tp, layout.cp, layout.dp, layout.zero_stage,
                                                   layout.hybrid_shard, self._span(layout, "dp"),
                                                   self._shard_size(layout), layout.micro_batch_size,
                                                   getattr(layout, "dp_sync", "auto")),
                              lambda layer, split: self._per_step_s(layer, split, layout, scale, reference), reference)
        overhead = self._overhead_bytes(layout, scale)
        problem = PartitionProblem(
            time_s=times, activation_bytes=activations, static_bytes=statics, send_s=sends,
            devices=layout.pp, chunks=layout.chunks, micro_batches=layout.num_micro_batches,
            in_flight=[in_flight_micro_batches(layout.schedule, layout.pp, layout.num_micro_batches, d, layout.chunks)
                       for d in range(layout.pp)],
            capacity_bytes=capacity, overhead_bytes=[overhead] * layout.pp, speed=speed,
            option_names=self.recompute_options, per_step_s=per_step)
        self._problems[key] = problem
        return problem

    def _rows(self, what: str, layout: Any, key: tuple, price: Any, reference: GPUSpec) -> list:
        """One value per layer, priced once per layer kind and cached by what the value depends on
        (the planner prices tens of thousands of configurations that share most of these)."""
        full_key = (what, reference.name, key)
        if full_key not in self._row_cache:
            by_kind = {}
            for layer in self.layers:
                kind = self.compute.kind(layer.name)
                if kind not in by_kind:
                    by_kind[kind] = price(layer, self.split(layer.name, layout, reference))
            self._row_cache[full_key] = [by_kind[self.compute.kind(layer.name)] for layer in self.layers]
        return self._row_cache[full_key]

    def _span(self, layout: Any, axis: str) -> tuple[int, int, int]:
        """A cheap cache key for a group's placement: (size, nodes, ranks per node)."""
        group = self.placement(layout, axis)
        return (group.size, group.nodes, group.per_node)

    def _zero_key(self, layout: Any) -> tuple:
        if layout.zero_stage < 2 or layout.dp == 1:
            return ()
        group = self._shard_group(layout)
        return (layout.zero_stage, group.size, group.nodes, group.per_node)

    def _device_facts(self, layout: Any) -> tuple[GPUSpec, list[float], list[int]] | None:
        """(reference GPU, speed factor and usable memory per pipeline rank), or None when a TP
        group would mix GPU types. Cached per rank layout."""
        key = (layout.tp, layout.cp, layout.pp, layout.dp, tuple(layout.mesh_order))
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
        slowest_gpu = [max(group, key=lambda g: total[g.name]) for group in pp_gpus]
        speed = [total[g.name] / total[reference.name] for g in slowest_gpu]
        capacity = [int(min(g.memory_bytes for g in group) * (1 - self.cluster.memory_headroom_fraction))
                    for group in pp_gpus]
        return reference, speed, capacity

    def collective_s(self, op: Collective, nbytes: float, group: GroupPlacement) -> float:
        """Cheapest-algorithm time, memoised (the planner asks the same questions many times)."""
        key = (op, nbytes, group)
        if key not in self._collectives:
            self._collectives[key] = collective_time_s(op, nbytes, group)
        return self._collectives[key]

    def fixed_time_s(self, layout: Any) -> float:
        """Step time outside the per-layer prices: none (every cost is attributed to a layer)."""
        return 0.0

    def _tp_groups_homogeneous(self, layout: Any) -> bool:
        """A TP group never mixes GPU types (its ranks run in lockstep)."""
        strides = mesh_strides(layout)
        for rank in range(layout.world_size):
            if (rank // strides["tp"]) % layout.tp == 0:
                types = {self.cluster.gpu_of_rank(rank + i * strides["tp"]).name for i in range(layout.tp)}
                if len(types) > 1:
                    return False
        return True

    def _layer_time_s(self, layer: Any, split: TPLayerSplit, layout: Any, scale: float, option: str) -> float:
        gpu_overhead = self.cluster.node_gpus[0].launch_overhead_s
        compute = split.compute
        forward_passes, nongemm_passes = {"none": (1.0, 0.0), "selective": (1.0, 1.0), "full": (2.0, 0.0)}[option]
        per_token = scale / layout.cp
        seconds = compute.time_s(per_token, gpu_overhead, forward_passes, nongemm_passes)
        if layout.sequence_parallel and layout.tp > 1:
            saved = (1 - 1 / layout.tp) * per_token * (forward_passes * split.replicated_forward_s
                                                       + split.replicated_backward_s)
            seconds -= saved
        tp_group = self.placement(layout, "tp")
        tp_comm = sum(self.collective_s(Collective(op), nbytes * per_token, tp_group) for op, nbytes in split.comm)
        seconds += tp_comm * (1.5 if option == "full" else 1.0)  # full recompute repeats the forward half
        seconds += self._cp_time_s(layer, layout, scale, compute)
        seconds += self._zero_micro_batch_s(layer, split, layout, compute, per_token)
        return seconds

    def _cp_time_s(self, layer: Any, layout: Any, scale: float, compute: LayerCompute) -> float:
        if layout.cp == 1:
            return 0.0
        nbytes = self._attention_bytes.get(self.compute.kind(layer.name), 0.0) * scale / (layout.cp * layout.tp)
        if nbytes == 0:
            return 0.0
        group = self.placement(layout, "cp")
        if layout.cp_strategy == "ulysses":
            # q, k, v to head-sharded layout and the output back: forward and backward.
            return 8 * self.collective_s(Collective.ALL_TO_ALL, nbytes / 3, group)
        # Ring: cp-1 steps pass this rank's K and V block; backward passes K, V and their grads.
        step = self.collective_s(Collective.SEND_RECV, 2 * nbytes / 3, group)
        exchange = 3 * (layout.cp - 1) * step
        attention = (compute.forward_s + compute.backward_s) * scale / layout.cp * 0.5
        return exposed_s(exchange, attention)

    def _zero_micro_batch_s(self, layer: Any, split: TPLayerSplit, layout: Any, compute: LayerCompute,
                            per_token: float) -> float:
        if layout.zero_stage < 2 or layout.dp == 1:
            return 0.0
        group = self._shard_group(layout)
        params = self._tp_params(layer, split, layout)
        weights, grads, _ = state_bytes_per_param(self.train.precision, self.train.optimizer)
        rs = self.collective_s(Collective.REDUCE_SCATTER, params * grads, group)
        backward = compute.backward_s * per_token
        if layout.zero_stage == 2:
            return exposed_s(rs, backward)
        gather = self.collective_s(Collective.ALL_GATHER, params * weights, group)
        # ZeRO-3 gathers the layer's parameters before its forward and again before its backward.
        return exposed_s(gather, compute.forward_s * per_token) + exposed_s(gather + rs, backward)

    def _per_step_s(self, layer: Any, split: TPLayerSplit, layout: Any, scale: float, gpu: GPUSpec) -> float:
        params = self._tp_params(layer, split, layout)
        weights, grads, _ = state_bytes_per_param(self.train.precision, self.train.optimizer)
        shard = self._shard_size(layout) if layout.zero_stage >= 1 else 1
        update = params / shard * OPTIMIZER_BYTES_PER_PARAM.get(self.train.optimizer, 28) / gpu.memory_bandwidth_Bps
        if layout.dp == 1 or params == 0:
            return update
        backward = split.compute.backward_s * scale / layout.cp
        if layout.zero_stage <= 1:
            sync = self.dp_sync_cost(layout, params * grads).seconds
            exposed = exposed_s(sync, backward)
            if layout.zero_stage == 1:
                exposed += self.collective_s(Collective.ALL_GATHER, params * weights, self._shard_group(layout))
            return update + exposed
        exposed = 0.0
        if layout.hybrid_shard and self._shard_size(layout) < layout.dp:
            replicas = self.cluster.strided_placement(layout.dp // self._shard_size(layout),
                                                      mesh_strides(layout)["dp"] * self._shard_size(layout))
            exposed = self.collective_s(Collective.ALL_REDUCE, params * grads / self._shard_size(layout), replicas)
        if layout.zero_stage == 2:
            exposed += self.collective_s(Collective.ALL_GATHER, params * weights, self._shard_group(layout))
        return update + exposed

    def dp_sync_cost(self, layout: Any, nbytes: float):
        """Gradient all-reduce on the DP group: the pinned algorithm or the cheapest."""
        group = self.placement(layout, "dp")
        algorithm = getattr(layout, "dp_sync", "auto")
        if algorithm in (None, "auto"):
            return best_algorithm(Collective.ALL_REDUCE, nbytes, group)
        from cost_models.collectives import CollectiveCost

        chosen = Algorithm(algorithm)
        return CollectiveCost(Collective.ALL_REDUCE, chosen, collective_time_s(Collective.ALL_REDUCE, nbytes, group, chosen))

    def _shard_size(self, layout: Any) -> int:
        if not layout.hybrid_shard:
            return layout.dp
        group = self.placement(layout, "dp")
        return group.per_node

    def _shard_group(self, layout: Any) -> GroupPlacement:
        if not layout.hybrid_shard:
            return self.placement(layout, "dp")
        return self.cluster.strided_placement(self._shard_size(layout), mesh_strides(layout)["dp"])

    def _tp_params(self, layer: Any, split: TPLayerSplit, layout: Any) -> float:
        sharded = layer.param_count * split.tp_sharded_param_fraction
        return sharded / layout.tp + (layer.param_count - sharded)

    def _static_bytes(self, layer: Any, split: TPLayerSplit, layout: Any) -> float:
        shard = self._shard_size(layout) if layout.dp > 1 else 1
        return model_states(self._tp_params(layer, split, layout), self.train.precision, self.train.optimizer,
                            layout.zero_stage if layout.dp > 1 else 0, shard).total_bytes

    def _activation_bytes(self, layer: Any, split: TPLayerSplit, layout: Any, scale: float, option: str) -> float:
        fractions = ActivationSplit(tp_sharded_fraction=split.tp_sharded_activation_fraction,
                                    keep_fraction_selective=self._fractions[layer.name])
        return activation_bytes(layer.activation_bytes, layer.input_bytes, scale, fractions, layout.tp,
                                layout.sequence_parallel, layout.cp, option)

    def _send_s(self, layer: Any, layout: Any, scale: float) -> float:
        if layout.pp == 1:
            return 0.0
        nbytes = layer.output_bytes * scale / layout.cp / (layout.tp if layout.sequence_parallel else 1)
        return 2 * self.collective_s(Collective.SEND_RECV, nbytes, self.placement(layout, "pp"))

    def _overhead_bytes(self, layout: Any, scale: float) -> int:
        weights, _, _ = state_bytes_per_param(self.train.precision, self.train.optimizer)
        largest = self._largest_params / layout.tp
        overhead = CUDA_CONTEXT_BYTES if self.cluster.node_gpus[0].name != "cpu" else 0
        if layout.zero_stage == 3 and layout.dp > 1:
            overhead += 2 * largest * weights  # this layer's and the prefetched next layer's params
        if layout.dp > 1:
            overhead += 2 * DP_BUCKET_BYTES
        # The layer being recomputed holds its full activations while its backward runs.
        overhead += self._largest_activation * scale / layout.tp / layout.cp
        return int(overhead)

    def _selective_keep_fraction(self, layer_name: str) -> float:
        kind = self.compute.kind(layer_name)
        saved = [op for op in self.profile.ops if op.layer == kind and op.saved_for_backward_bytes]
        total = sum(op.saved_for_backward_bytes for op in saved)
        kept = sum(op.saved_for_backward_bytes for op in saved if op.op_class in ("gemm", "attention"))
        return kept / total if total else 1.0

    def _attention_input_bytes(self) -> dict[str, float]:
        result: dict[str, float] = {}
        for op in self.profile.ops:
            if op.op_class == "attention" and op.phase == "forward":
                result[op.layer] = result.get(op.layer, 0.0) + op.bytes_read
        return result

    # -- a complete layout ----------------------------------------------------------------------

    def estimate(self, layout: ParallelLayout) -> Estimate:
        """Price a layout with its stage split (balanced when `layout.stages` is empty)."""
        from cost_models.pipeline import evaluate

        validate_layout(layout, self.cluster, self.train, len(self.layers))
        problem = self.partition_problem(layout)
        if problem is None:
            raise ValueError("a tensor-parallel group would mix GPU types; change the mesh order or tp")
        starts = self.stage_starts(layout)
        options = self.layer_options(layout)
        partition = evaluate(problem, starts, options)
        fits = partition is not None
        if partition is None:
            partition = evaluate(_unbounded(problem), starts, options)
        return self._assemble(layout, problem, partition, fits)

    def stage_starts(self, layout: ParallelLayout) -> list[int]:
        stages = layout.pp * layout.chunks
        if layout.stages:
            if len(layout.stages) != stages:
                raise ValueError(f"{len(layout.stages)} stages given for pp={layout.pp} × chunks={layout.chunks}")
            return [self.layer_index[stage[0]] for stage in layout.stages]
        count = len(self.layers)
        if count < stages:
            raise ValueError(f"{count} layers cannot fill {stages} pipeline stages")
        return [round(j * count / stages) for j in range(stages)]

    def layer_options(self, layout: ParallelLayout) -> list[int]:
        recompute = layout.recompute
        names = [recompute.get(layer.name, "none") if isinstance(recompute, dict) else recompute
                 for layer in self.layers]
        unknown = sorted(set(names) - set(self.recompute_options))
        if unknown:
            raise ValueError(f"recompute '{unknown[0]}' is not one of {', '.join(self.recompute_options)}")
        return [self.recompute_options.index(name) for name in names]

    def _assemble(self, layout: ParallelLayout, problem: "PartitionProblem", partition: "Partition",
                  fits: bool) -> Estimate:
        step = partition.step_time_s
        samples = self.train.global_batch_size / step
        tokens = samples * self.profile.tokens_per_sample if self.profile.tokens_per_sample else None
        model_flops = self.profile.flops_total * self.train.global_batch_size / self.b0
        recompute_flops = sum(
            layer.flops_forward * (1.0 if problem.option_names[option] == "full" else 0.0)
            for layer, option in zip(self.layers, partition.options)) * self.train.global_batch_size / self.b0
        peak = sum(self.cluster.gpu_of_rank(r).flops(self.compute.dtype) for r in range(layout.world_size))
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
            recompute=[problem.option_names[o] for o in partition.options], fits=fits)

    def _dp_algorithm(self, layout: ParallelLayout) -> str:
        if layout.dp == 1:
            return "none"
        if layout.zero_stage >= 2:
            return "reduce_scatter (ring)"
        params = max(layer.param_count for layer in self.layers)
        return self.dp_sync_cost(layout, params * 2).algorithm.value

    def _memory_breakdown(self, layout, problem, partition, device, stages) -> dict[str, int]:
        layers = [l for j, stage in enumerate(stages) if j % layout.pp == device for l in stage]
        states = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
        for l in layers:
            layer = self.layers[l]
            split = self.split(layer.name, layout, self.cluster.node_gpus[0])
            shard = self._shard_size(layout) if layout.dp > 1 else 1
            s = model_states(self._tp_params(layer, split, layout), self.train.precision, self.train.optimizer,
                             layout.zero_stage if layout.dp > 1 else 0, shard)
            states["params"] += s.params_bytes
            states["grads"] += s.grads_bytes
            states["optimizer"] += s.optimizer_bytes
        activations = sum(problem.in_flight[device] * problem.activation_bytes[l][partition.options[l]] for l in layers)
        gpu = self.cluster.node_gpus[0]
        return {**{k: int(v) for k, v in states.items()}, "activations": int(activations),
                "buffers": int(problem.overhead_bytes[device]),
                "capacity": int(problem.capacity_bytes[device]),
                "headroom": int(gpu.memory_bytes * self.cluster.memory_headroom_fraction)}

    def _time_breakdown(self, layout, problem, partition, device, stages) -> dict[str, float]:
        m = layout.num_micro_batches
        scale = layout.micro_batch_size / self.b0
        layers = [l for j, stage in enumerate(stages) if j % layout.pp == device for l in stage]
        gpu = self.cluster.node_gpus[0]
        compute = tp = cp = zero = 0.0
        for l in layers:
            layer = self.layers[l]
            option = problem.option_names[partition.options[l]]
            split = self.split(layer.name, layout, gpu)
            total = problem.time_s[l][partition.options[l]]
            tp_part = sum(collective_time_s(Collective(op), n * scale / layout.cp, self.placement(layout, "tp"))
                          for op, n in split.comm) * (1.5 if option == "full" else 1.0)
            cp_part = self._cp_time_s(layer, layout, scale, split.compute)
            zero_part = self._zero_micro_batch_s(layer, split, layout, split.compute, scale / layout.cp)
            tp, cp, zero = tp + tp_part, cp + cp_part, zero + zero_part
            compute += total - tp_part - cp_part - zero_part
        sends = sum(problem.send_s[stage[-1]] for j, stage in enumerate(stages)
                    if j % layout.pp == device and j < len(stages) - 1)
        per_step = max(sum(problem.per_step_s[l] for j, stage in enumerate(stages) if j % layout.pp == d for l in stage)
                       * problem.speed_of(d) for d in range(layout.pp))
        busy = m * partition.device_time_s[device]
        speed = problem.speed_of(device)
        return {"compute": m * compute * speed, "tp_comm": m * tp * speed, "cp_comm": m * cp * speed,
                "zero_comm": m * zero * speed, "pp_comm": m * sends * speed,
                "bubble": max(0.0, partition.step_time_s - busy - per_step),
                "dp_sync_and_optimizer": per_step}


def validate_layout(layout: ParallelLayout, cluster: ClusterSpec, train: TrainSpec, num_layers: int) -> None:
    """Clear errors for layouts that cannot run, before pricing them."""
    if layout.world_size != cluster.world_size:
        raise ValueError(f"dp×tp×pp×cp = {layout.dp}×{layout.tp}×{layout.pp}×{layout.cp} = {layout.world_size}, "
                         f"but the cluster has {cluster.world_size} GPUs")
    if layout.dp * layout.micro_batch_size * layout.num_micro_batches != train.global_batch_size:
        raise ValueError(f"global batch {train.global_batch_size} ≠ dp {layout.dp} × micro-batch "
                         f"{layout.micro_batch_size} × micro-batches {layout.num_micro_batches}")
    if layout.pp * layout.chunks > num_layers:
        raise ValueError(f"{num_layers} layers cannot fill pp {layout.pp} × chunks {layout.chunks} stages")
    if layout.schedule not in ("gpipe", "1f1b", "interleaved_1f1b"):
        raise ValueError(f"unknown schedule '{layout.schedule}': use gpipe, 1f1b or interleaved_1f1b")
    if layout.schedule != "interleaved_1f1b" and layout.chunks != 1:
        raise ValueError("chunks > 1 needs schedule=interleaved_1f1b")
    if layout.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {layout.zero_stage}")


def _unbounded(problem: "PartitionProblem") -> "PartitionProblem":
    """The same problem with unlimited memory (to price a plan that does not fit)."""
    from dataclasses import replace

    return replace(problem, capacity_bytes=[2**62] * problem.devices)

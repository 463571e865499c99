"""What the report reads of a priced layout: the `Estimate` assembled from a partition, with the
peak rank's memory and time breakdowns, per pipeline rank details and per stage timings.

`EstimateAssembler` (the pricer's `assembler`) reads them off a solved partition and the per-layer
price tables the partition was priced from, which `PlanPricer` hands it:

    assembler.assemble(layout, problem, partition, fits, time_rows, per_step_rows, fixed_s)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from autopar.domain.layout import ParallelLayout
from autopar.domain.vocabulary import Recompute
from cost_models.dp_sync import GradientSync
from cost_models.layer_cost import LayerPrices, ring_attention
from cost_models.layer_split import LayerSplits
from cost_models.pipeline import Partition, PartitionProblem, held_activation_bytes
from cost_models.placement import LayoutGroups
from cost_models.ranks import PipelineRanks
from cost_models.topology import ClusterSpec

if TYPE_CHECKING:
    from autopar.domain.layout import TrainSpec
    from autopar.model_profile import LayerProfile, ModelProfile

# [layer][recompute option] -> seconds per micro-batch by kind (`LayerPrices.layer_time_parts`)
TimeRows = list[list[dict[str, float]]]
# [layer] -> seconds once per step by kind (`LayerPrices.per_step_parts`)
PerStepRows = list[dict[str, float]]


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
        memory_breakdown: the peak rank's bytes: params, grads, optimizer, activations, buffers;
            headroom (kept free) and capacity (what may be allocated). At the rank's peak moment:
            backward, or the optimizer step (then activations are 0 and optimizer_step holds the
            step's transients).
        time_breakdown: seconds per step: compute, recompute, tp_comm, cp_comm, ep_comm, pp_comm,
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


class EstimateAssembler:
    """Assembles an Estimate and its breakdowns from a priced partition.

    Args:
        profile: the traced model (FLOPs, tokens per sample, the profiled micro-batch).
        cluster: where it runs (the GPUs' peak FLOPs, the memory headroom).
        train: the training settings (global batch).
        groups: where a layout's groups sit (the GPU types of each pipeline rank).
        sync: the data-parallel gradient synchronisation (the algorithm reported).
        splits: each layer kind's TP split.
        ranks: the reference GPU of a layout's pipeline ranks.
        layer_prices: each layer's model states under a layout.
        dtype: the compute dtype whose peak FLOPs MFU divides by.
    """

    def __init__(self, profile: "ModelProfile", cluster: ClusterSpec, train: "TrainSpec", groups: LayoutGroups,
                 sync: GradientSync, splits: LayerSplits, ranks: PipelineRanks, layer_prices: LayerPrices,
                 dtype: str):
        self.profile = profile
        self.cluster = cluster
        self.train = train
        self.groups = groups
        self.sync = sync
        self.splits = splits
        self.ranks = ranks
        self.layer_prices = layer_prices
        self.layers = profile.layers
        self.b0 = profile.micro_batch_size
        self._peak_flops = sum(cluster.gpu_of_rank(r).flops(dtype) for r in range(cluster.world_size))

    def assemble(self, layout: ParallelLayout, problem: PartitionProblem, partition: Partition, fits: bool,
                 time_rows: TimeRows, per_step_rows: PerStepRows, fixed_s: float) -> Estimate:
        """The Estimate of ``layout`` split as ``partition`` solved ``problem``: ``time_rows`` and
        ``per_step_rows`` are the per-layer tables the problem was priced from, ``fixed_s`` the step
        time outside them (`PlanPricer.fixed_time_s`)."""
        step = partition.step_time_s + fixed_s  # + gradient clipping's all-reduce
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
            time_breakdown=self._time_breakdown(layout, problem, partition, slowest, stages, time_rows,
                                                per_step_rows, fixed_s),
            dp_sync_algorithm=self._dp_algorithm(layout),
            device_time_s=partition.device_time_s, device_memory_bytes=partition.device_memory_bytes,
            stages=[[self.layers[index].name for index in stage] for stage in stages],
            recompute=[problem.option_names[o] for o in partition.options], fits=fits,
            stage_details=self._stage_details(layout, problem, partition, stages, per_step_rows),
            stage_timings=self._stage_timings(layout, problem, partition, stages, time_rows))

    def _recompute_flops(self, layer: "LayerProfile", option: str, layout: ParallelLayout) -> float:
        if option == Recompute.FULL:
            return layer.flops_forward
        if option == Recompute.SELECTIVE:
            kept = ("gemm",) if ring_attention(layout) else ("gemm", "attention")
            return sum(c.flops for name, c in layer.forward_by_class.items() if name not in kept)
        return 0.0

    def _dp_algorithm(self, layout: ParallelLayout) -> str:
        if self.groups.grad_size(layout) == 1:
            return "none"
        if layout.zero_stage >= 2:
            return "reduce_scatter (ring)"
        params = max(layer.param_count for layer in self.layers)
        return self.sync.cost(layout, params * self.layer_prices.grads_bytes).algorithm.value

    def _device_layers(self, layout: ParallelLayout, stages: list[list[int]], device: int) -> list[int]:
        return [index for j, stage in enumerate(stages) if j % layout.pp == device for index in stage]

    def _memory_breakdown(self, layout: ParallelLayout, problem: PartitionProblem, partition: Partition,
                          device: int, stages: list[list[int]]) -> dict[str, int]:
        reference = self.ranks.reference_gpu(layout)
        states = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "compute_copy": 0.0}
        for index in self._device_layers(layout, stages, device):
            layer = self.layers[index]
            s = self.layer_prices.states(layer, self.splits.split(layer.name, layout, reference), layout)
            states["params"] += s.params_bytes
            states["grads"] += s.grads_bytes
            states["optimizer"] += s.optimizer_bytes
            states["compute_copy"] += s.compute_copy_bytes
        held = self._device_layers(layout, stages, device)
        activations = held_activation_bytes(problem, partition, device)[0]
        memory = min(g.memory_bytes for g in self.groups.pp_rank_gpus(layout)[device])
        copy = states.pop("compute_copy")
        moment = {"activations": int(activations), "buffers": int(problem.overhead_bytes[device] + copy)}
        if problem.step_bytes:
            step = sum(problem.step_bytes[index] for index in held)  # the step's transients less the copy
            if step + problem.step_overhead_bytes[device] > sum(moment.values()) - copy:  # beyond the static bytes
                # The rank's peak is its optimizer step: activations, backward's buffers and the
                # compute copy are gone.
                moment = {"activations": 0, "buffers": int(problem.step_overhead_bytes[device]),
                          "optimizer_step": int(step + copy)}
        return {**{k: int(v) for k, v in states.items()}, **moment,
                "headroom": int(memory * self.cluster.memory_headroom_fraction),
                "capacity": int(problem.capacity_bytes[device])}

    def _time_breakdown(self, layout: ParallelLayout, problem: PartitionProblem, partition: Partition, device: int,
                        stages: list[list[int]], time_rows: TimeRows, per_step_rows: PerStepRows,
                        fixed_s: float) -> dict[str, float]:
        """Seconds per step on the critical pipeline rank, adding up to the step time."""
        m = layout.num_micro_batches
        speed = problem.speed_of(device)
        parts = dict.fromkeys(("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "pp_comm", "dp_comm"), 0.0)
        for index in self._device_layers(layout, stages, device):
            for name, seconds in time_rows[index][partition.options[index]].items():
                parts[name] += m * seconds * speed
        parts["pp_comm"] = m * speed * sum(problem.send_s[stage[-1]] for j, stage in enumerate(stages)
                                           if j % layout.pp == device and j < len(stages) - 1)
        per_device = self._per_step_by_device(layout, problem, stages, per_step_rows)
        once = max(per_device, key=lambda totals: sum(totals.values()))
        parts["dp_comm"] += once["dp_comm"]
        parts["tp_comm"] += once["tp_comm"]  # partial gradients summed once per step (key/value groups)
        parts["optimizer"] = once["optimizer"]
        parts["dp_comm"] += fixed_s  # gradient clipping's all-reduce over every rank
        busy = sum(parts.values())
        parts["bubble"] = max(0.0, partition.step_time_s + fixed_s - busy)
        return {key: parts[key] for key in ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "pp_comm",
                                            "dp_comm", "bubble", "optimizer")}

    def _stage_details(self, layout: ParallelLayout, problem: PartitionProblem, partition: Partition,
                       stages: list[list[int]], per_step_rows: PerStepRows) -> list[dict[str, Any]]:
        pp_gpus = self.groups.pp_rank_gpus(layout)
        per_step = self._per_step_by_device(layout, problem, stages, per_step_rows)
        return [{"pp_rank": d, "gpu": sorted({g.name for g in pp_gpus[d]}),
                 "layers": [self.layers[index].name for index in self._device_layers(layout, stages, d)],
                 "time_per_micro_batch_s": partition.device_time_s[d],
                 "memory_bytes": partition.device_memory_bytes[d],
                 "capacity_bytes": problem.capacity_bytes[d],
                 "memory_breakdown": self._memory_breakdown(layout, problem, partition, d, stages),
                 "in_flight_micro_batches": list(held_activation_bytes(problem, partition, d)[1]),
                 "speed": problem.speed_of(d),
                 "dp_comm_s": per_step[d]["dp_comm"], "optimizer_s": per_step[d]["optimizer"]}
                for d in range(layout.pp)]

    def _per_step_by_device(self, layout: ParallelLayout, problem: PartitionProblem, stages: list[list[int]],
                            rows: PerStepRows) -> list[dict[str, float]]:
        """Per pipeline rank: exposed gradient synchronisation and optimizer seconds, once per step."""
        result = []
        for d in range(layout.pp):
            totals = {"optimizer": 0.0, "dp_comm": 0.0, "tp_comm": 0.0}
            for index in self._device_layers(layout, stages, d):
                for name, seconds in rows[index].items():
                    totals[name] += seconds * problem.speed_of(d)
            result.append(totals)
        return result

    def _stage_timings(self, layout: ParallelLayout, problem: PartitionProblem, partition: Partition,
                       stages: list[list[int]], rows: TimeRows) -> list[dict[str, float]]:
        """Per (virtual) stage, one micro-batch: forward, backward (with its recomputation) and
        the send of its output to the next stage (half of the layer's send_s, the other half
        being the gradient coming back). A layer's time outside recomputation is split between
        forward and backward by its traced FLOPs (backward ~2x forward): the sum per device is
        the partition's device time, which the timeline plays through the schedule."""
        timings = []
        for j, stage in enumerate(stages):
            speed = problem.speed_of(j % layout.pp)
            forward = backward = 0.0
            for index in stage:
                layer, option = self.layers[index], partition.options[index]
                recompute = rows[index][option]["recompute"] * speed
                rest = problem.time_s[index][option] * speed - recompute
                flops = layer.flops_forward + layer.flops_backward
                share = layer.flops_forward / flops if flops else 1 / 3
                forward += share * rest
                backward += (1 - share) * rest + recompute
            send = problem.send_s[stage[-1]] * speed / 2 if j < len(stages) - 1 else 0.0
            timings.append({"stage": j, "pp_rank": j % layout.pp, "forward_s": forward, "backward_s": backward,
                            "send_s": send})
        return timings

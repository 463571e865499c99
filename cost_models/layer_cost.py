"""Per-layer prices of a layout: a layer's seconds per micro-batch by kind (compute,
recomputation, TP / CP / ZeRO communication), its once-per-step parts (optimizer, exposed
gradient sync), its model states, activations and the buffers beside them.

`LayerPrices` answers these for one model on one cluster, from the collaborators `PlanPricer`
holds (the groups, the gradient synchronisation, the model's structure, the TP splits, the
pipeline ranks); the formulas are listed in step.py's docstring.

    prices = LayerPrices(profile, cluster, train, compute, groups, sync, structure, experts, splits, ranks)
    prices.layer_time_parts(layer, split, layout, 1.0, ("none", "full"), gpu)   # [{'compute': ...}, ...]
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from autopar.domain.layout import ParallelLayout
from autopar.domain.vocabulary import CPStrategy, Recompute
from cost_models.engine_overlap import MEGATRON_CORE, param_gather_exposed_s, tp_comm_exposed_s
from cost_models.collectives import Algorithm, Collective, exposed_s
from cost_models.compute import ComputeModel, LayerCompute
from cost_models.deepspeed_zero3 import PerTensorZero3, per_tensor_buffers
from cost_models.dp_sync import GradientSync
from cost_models.expert_parallel import (COUNT_BYTES, ExpertFacts, MoELayer, all_to_alls, count_exchanges,
                                         dispatch_bytes, expert_tp_sums, routing_pace)
from cost_models.hardware import GiB, GPUSpec
from cost_models.host import host_s
from cost_models.layer_split import LayerSplits, TPLayerSplit
from cost_models.memory import (FP32_BYTES, ModelStates, optimizer_step_bytes, reduced_gradient_bytes,
                                 ring_attention_extra_bytes, state_bytes_per_param, trained_model_states)
from cost_models.placement import LayoutGroups
from cost_models.ranks import PipelineRanks
from cost_models.structure import ModelStructure
from cost_models.topology import ClusterSpec, GroupPlacement
from cost_models.uncertainty import RING_ATTENTION

if TYPE_CHECKING:
    from autopar.domain.layout import TrainSpec
    from autopar.model_profile import LayerProfile, ModelProfile

CUDA_CONTEXT_BYTES = int(0.75 * GiB)  # CUDA context + cuBLAS/NCCL workspaces, typical on H100/A100
RING_TILE_SCORE_BYTES = 256 * 2**20  # fp32 scores of one ring-attention query tile (codegen's context_parallel)
# Fused AdamW streams p, g, m, v in and p, m, v out in fp32 (7 x 4 bytes per parameter); SGD with
# momentum p, g, buf in and p, buf out; plain SGD p, g in and p out.
OPTIMIZER_BYTES_PER_PARAM = {"adam": 28, "sgd": 20, "sgd_plain": 12}
# Gradient all-reduces FSDP runs itself, one per FSDP unit (the others are gradient_sync.py's).
FSDP_ALGORITHMS = (Algorithm.RING, Algorithm.TREE)


def cuda_context_bytes(gpu: GPUSpec) -> int:
    """What a GPU process holds before any tensor (none on a CPU rank)."""
    return CUDA_CONTEXT_BYTES if gpu.name != "cpu" else 0


# (forward passes, non-GEMM forward passes) a recompute option runs per micro-batch: selective
# recomputation re-runs the forward's non-GEMM ops, full recomputation the whole forward.
RECOMPUTE_PASSES: dict[str, tuple[float, float]] = {Recompute.NONE: (1.0, 0.0), Recompute.SELECTIVE: (1.0, 1.0),
                                                    Recompute.FULL: (2.0, 0.0)}


def tp_issued(split: TPLayerSplit, layout: ParallelLayout, full_recompute: bool, boundaries: bool = True
              ) -> tuple[tuple[str, float], ...]:
    """(collective, bytes per token) a layer's TP group issues per micro-batch: its split's,
    those full recomputation's re-run forward issues again, and under sequence parallelism
    (``boundaries``) the gathers of the sequence into replicated modules
    (tp_layout.SP_BOUNDARY). What is priced and what is counted."""
    if layout.tp == 1:
        return ()
    sp = bool(layout.sequence_parallel)
    issued = tuple(split.collectives(sp)[0]) + (tuple(split.recomputed_collectives(sp)) if full_recompute else ())
    if sp and boundaries:
        issued += tuple(split.sp.comm) + (tuple(split.sp.comm[:split.sp.forward_comm]) if full_recompute else ())
    return issued


def ring_attention(layout: ParallelLayout) -> bool:
    """Whether attention runs as ring attention: blockwise scores in the working set, and
    nothing of it (scores or output) kept by selective recomputation, which reruns it whole."""
    return layout.cp > 1 and layout.cp_strategy == CPStrategy.RING


def expert_tp(layout: ParallelLayout) -> int:
    """Ranks each expert's width is split over: tp under expert tensor parallelism, else 1."""
    return layout.tp if getattr(layout, "expert_tp", False) and layout.tp > 1 else 1


def cp_passes(strategy: str, recompute: str) -> int:
    """Times a context-parallel attention layer exchanges per micro-batch: forward, backward, and
    each forward a recomputation reruns. Measured on cp2 GPT (4 blocks, 2 micro-batches): 2
    without recomputation; Ulysses 3 under full or selective recomputation (88 all-to-alls for
    blocks recomputed full, selective, none, selective); ring attention 3 under full and 5 under
    selective (24 and 40 exchanges with every block so: selective recomputation keeps nothing of
    ring attention, `never_kept_by_selective`, and the backward reran its ring passes three
    times, a cost of codegen's query tiles being checkpointed inside the recomputed layer that
    is priced here as it runs)."""
    if recompute == Recompute.NONE:
        return 2
    return 5 if strategy == CPStrategy.RING and recompute == Recompute.SELECTIVE else 3


class LayerPrices:
    """Prices one layer kind under a layout.

    Args:
        profile: the traced model (its parameters' shapes, for DeepSpeed's per-tensor ZeRO-3).
        cluster: where it runs (its measured correction factors, the overlaps it leaves exposed).
        train: batch, precision, optimizer and runtimes.
        compute: the model's compute prices.
        groups: where a layout's groups sit and what their collectives cost.
        sync: the data-parallel gradient synchronisation.
        structure: FSDP units, attention sizes and the largest layer of the model.
        experts: the model's MoE layers (none for a dense model).
        splits: each layer kind's TP split.
        ranks: the reference GPU of a layout's pipeline ranks.
    """

    def __init__(self, profile: "ModelProfile", cluster: ClusterSpec, train: "TrainSpec", compute: ComputeModel,
                 groups: LayoutGroups, sync: GradientSync, structure: ModelStructure, experts: ExpertFacts,
                 splits: LayerSplits, ranks: PipelineRanks):
        self.profile = profile
        self.cluster = cluster
        self.train = train
        self.compute = compute
        self.groups = groups
        self.sync = sync
        self.structure = structure
        self.experts = experts
        self.splits = splits
        self.ranks = ranks
        self.layers = profile.layers
        self._unit_params: dict[tuple, float] = {}

    @property
    def weights_bytes(self) -> int:
        return state_bytes_per_param(self.train.precision, self.train.optimizer)[0]

    @property
    def grads_bytes(self) -> int:
        """Bytes of one parameter's gradient as the run reduces it."""
        return reduced_gradient_bytes(self.train.precision, self.train.grad_reduce_dtype)

    def layer_time_parts(self, layer: "LayerProfile", split: TPLayerSplit, layout: ParallelLayout, scale: float,
                         options: tuple[str, ...], gpu: GPUSpec) -> list[dict[str, float]]:
        """Seconds one micro-batch spends on a layer, by kind (compute, recompute, tp_comm,
        cp_comm, ep_comm, dp_comm), one dict per recompute option of `options`. What no option
        changes (compute without recomputation, the collectives' prices, ZeRO's traffic) is
        priced once for all of them: the planner prices every layer kind under each option."""
        compute = split.compute
        per_token = scale / layout.cp
        plain = self._compute_s(split, layout, per_token, gpu)
        # The TP group's collectives (tp_issued), priced once with and once without full
        # recomputation's re-run forward, whichever the options need.
        fulls = {o == Recompute.FULL for o in options}
        tp_comm_s = {full: self._tp_comm_s(split, layout, per_token, full) for full in fulls}
        zero_s = {full: self._zero_micro_batch_s(layer, split, layout, compute, per_token, gpu, full) for full in fulls}
        parts = []
        for option in options:
            forward_passes, rerun_passes = RECOMPUTE_PASSES[option]
            total = self._compute_s(split, layout, per_token, gpu, forward_passes, rerun_passes)
            recompute = total - plain
            if option == Recompute.SELECTIVE and ring_attention(layout):
                # Selective recomputation keeps attention's output, but ring attention runs in a
                # region it recomputes whole (its quadratic scores are never kept).
                recompute += compute.attention_forward_s * per_token
            parts.append(self._scaled({
                "compute": plain + self._ep_wait_s(layer, split, layout, per_token, forward_passes),
                "recompute": recompute, "tp_comm": tp_comm_s[option == Recompute.FULL],
                "cp_comm": self._cp_time_s(layer, layout, scale, compute, option),
                "ep_comm": self._ep_time_s(layer, layout, scale, option), "dp_comm": zero_s[option == Recompute.FULL]}))
        return parts

    def _tp_comm_s(self, split: TPLayerSplit, layout: ParallelLayout, per_token: float, full_recompute: bool,
                   boundaries: bool = True) -> float:
        """Seconds of `tp_issued` for one micro-batch."""
        group = self.groups.placement(layout, "tp")
        seconds = sum(self.groups.collective_s(Collective(op), nbytes * per_token, group)
                      for op, nbytes in tp_issued(split, layout, full_recompute, boundaries))
        if self.train.tp_runtime == MEGATRON_CORE and layout.sequence_parallel:
            return tp_comm_exposed_s(seconds, layout.tp)
        return seconds

    def _scaled(self, parts: dict[str, float]) -> dict[str, float]:
        """Parts times the cluster's measured correction factors (1 unless calibrated from runs)."""
        if not self.cluster.time_scale:
            return parts
        return {part: seconds * self.cluster.scale_of(part) for part, seconds in parts.items()}

    def _compute_s(self, split: TPLayerSplit, layout: ParallelLayout, per_token: float, gpu: GPUSpec,
                   forward_passes: float = 1.0, rerun_passes: float = 0.0) -> float:
        """Compute seconds of a layer's micro-batch, recomputation included as asked."""
        seconds = split.compute.time_s(per_token, gpu.launch_overhead_s, forward_passes, rerun_passes)
        if layout.sequence_parallel and layout.tp > 1:
            # The replicated ops that run on the rank's slice of the sequence (norms, residual
            # adds, dropout; not a replicated module's, which gathers the whole sequence: see
            # cost_models/tp_layout.py) do 1/t of the work, and so does selective
            # recomputation's rerun of them (element-wise work, never kept).
            share = (1 - 1 / layout.tp) * per_token
            seconds -= share * ((forward_passes + rerun_passes) * split.sp.forward_s + split.sp.backward_s)
        if layout.tp > 1 and self.train.tp_runtime == "dtensor":  # the host dispatching DTensor modules: a floor
            # Recomputation dispatches again what it re-runs: the forward (full), or the share of
            # its ops that selective recomputation runs again.
            compute = split.compute
            rerun = rerun_passes * compute.selective_rerun_launches / max(compute.forward_launches, 1)
            seconds = max(seconds, host_s(split.dtensor_modules(layout.sequence_parallel), forward_passes + rerun))
        return seconds

    def floor_s(self, layer: "LayerProfile", split: TPLayerSplit, layout: ParallelLayout, scale: float,
                options: tuple[str, ...], gpu: GPUSpec) -> float:
        """A layer's micro-batch seconds below each of `options`' `layer_time_parts` total."""
        compute = (self._compute_s(split, layout, scale / layout.cp, gpu)
                   + self._ep_wait_s(layer, split, layout, scale / layout.cp)) * self.cluster.scale_of("compute")
        per_token = scale / layout.cp
        tp_comm_s = {rerun: self._tp_comm_s(split, layout, per_token, rerun, boundaries=False)
                     for rerun in (False, True)}
        comm = []
        for option in options:
            comm.append(tp_comm_s[option == Recompute.FULL] * self.cluster.scale_of("tp_comm")
                        + self._cp_time_s(layer, layout, scale, split.compute, option)
                          * self.cluster.scale_of("cp_comm")
                        + self._ep_time_s(layer, layout, scale, option) * self.cluster.scale_of("ep_comm"))
        return compute + min(comm)

    def _cp_time_s(self, layer: "LayerProfile", layout: ParallelLayout, scale: float, compute: LayerCompute,
                   option: str = Recompute.NONE) -> float:
        if layout.cp == 1:
            return 0.0
        q, kv = (b * scale / (layout.cp * layout.tp)
                 for b in self.structure.attention_bytes.get(self.compute.kind(layer.name), (0.0, 0.0)))
        if q + kv == 0:
            return 0.0
        group = self.groups.placement(layout, "cp")
        # Each pass of the layer's attention (forward, backward, recomputed forwards: `cp_passes`,
        # counted in a generated step) exchanges once more.
        passes = cp_passes(layout.cp_strategy, option)
        forwards = passes - 1
        if layout.cp_strategy == CPStrategy.ULYSSES:
            # Jacobs et al. 2023 (DeepSpeed-Ulysses): q, k, v to the head-sharded layout and the
            # output (q's size) back, one all-to-all each, and the same for their gradients; on
            # the critical path (attention needs all of them).
            return passes * (2 * self.groups.collective_s(Collective.ALL_TO_ALL, q, group)
                             + self.groups.collective_s(Collective.ALL_TO_ALL, kv, group))
        # Ring attention (Liu et al. 2023): cp-1 steps pass this rank's stacked K/V block forward
        # (again in a recomputed forward); backward passes its gradient back the same way; each
        # transfer overlaps the attention of the block in hand, so at long sequences (attention
        # quadratic, transfers linear) it hides. The generated ring passes its block in fp32 with
        # K and V expanded to the queries' heads: twice the queries' bytes in fp32.
        block = 2 * q * FP32_BYTES / self.element_bytes
        exchange = passes * (layout.cp - 1) * self.groups.collective_s(Collective.SEND_RECV, block, group)
        if RING_ATTENTION in self.cluster.exposed_overlap:
            return exchange  # the pessimistic price: no published run measured this overlap
        attention = (compute.attention_s + (forwards - 1) * compute.attention_forward_s
                     or 0.5 * (compute.forward_s + compute.backward_s))
        return exposed_s(exchange, attention * scale / layout.cp)

    @property
    def element_bytes(self) -> int:
        """Bytes of an element in the profile's activations (its precision)."""
        return 2 if self.profile.precision in ("bf16", "fp16") else FP32_BYTES

    def ring_kept_bytes(self, layer: "LayerProfile", layout: ParallelLayout, scale: float) -> float:
        """What ring attention keeps for backward beyond the profiled attention
        (`memory.ring_attention_extra_bytes`) in one micro-batch of `scale` profiled ones, on
        one rank of a layer kept without recomputation; 0 without ring attention."""
        if not ring_attention(layout):
            return 0.0
        q, kv = self.structure.attention_bytes.get(self.compute.kind(layer.name), (0.0, 0.0))
        share = scale / (layout.cp * layout.tp)
        return ring_attention_extra_bytes(q * share, kv * share, layout.cp, self.element_bytes) if q else 0.0

    def ep_key(self, layout: ParallelLayout) -> tuple:
        """What expert parallelism's prices read of a layout (a cache key)."""
        if not self.experts.has_experts or (layout.ep == 1 and not expert_tp(layout)):
            return ()
        return (layout.ep, self.groups.span(layout, "ep"), layout.cp, expert_tp(layout))

    def _ep_time_s(self, layer: "LayerProfile", layout: ParallelLayout, scale: float,
                   option: str = Recompute.NONE) -> float:
        """Dispatch and combine all-to-alls of an MoE layer's micro-batch over the expert-parallel
        group (cost_models.expert_parallel), on the critical path: the experts need their
        tokens, the next op their outputs; and under expert tensor parallelism the sums of its
        slices' partial results over the TP group (`_expert_tp_time_s`)."""
        moe = self.experts.experts_of(layer.name)
        if moe is None:
            return 0.0
        sums = self._expert_tp_time_s(moe, layout, scale, option)
        if layout.ep == 1:
            return sums
        pace = self._pace(moe, layout)
        nbytes = dispatch_bytes(moe, scale, layout.cp, pace)
        group = self.groups.placement(layout, "ep")
        exchanges = all_to_alls(option) * self.groups.collective_s(Collective.ALL_TO_ALL, nbytes, group)
        if moe.dropless:  # the per-expert counts go first, so each rank knows what it receives
            exchanges += count_exchanges(option) * self.groups.collective_s(
                Collective.ALL_TO_ALL, COUNT_BYTES * moe.experts, group)
        return exchanges + sums

    def _pace(self, moe: MoELayer, layout: ParallelLayout) -> float:
        """The busiest expert-parallel rank's share of the mean (routing_pace), from the measured
        load of the layer's experts where the training settings hold one."""
        measured = dict(self.train.expert_load)
        load = tuple(sum(counts) for counts in zip(*(measured[m] for m in moe.modules if m in measured)))
        return routing_pace(layout.ep, self.train.moe_imbalance, moe.dropless, load)

    def _expert_tp_time_s(self, moe: MoELayer, layout: ParallelLayout, scale: float, option: str) -> float:
        """Expert tensor parallelism's all-reduces over the TP group per micro-batch
        (cost_models.expert_parallel.expert_tp_sums): the output's partial sums in each
        forward, the input's (and a dropless module's gates') partial gradients in backward."""
        if expert_tp(layout) == 1:
            return 0.0
        group = self.groups.placement(layout, "tp")
        return sum(count * self.groups.collective_s(Collective.ALL_REDUCE, nbytes, group)
                   for count, nbytes in expert_tp_sums(moe, scale, layout.cp, option))

    def _ep_wait_s(self, layer: "LayerProfile", split: TPLayerSplit, layout: ParallelLayout, per_token: float,
                   forward_passes: float = 1.0) -> float:
        """Seconds the experts' compute differs from the layer's traced share of it: waiting for
        the most-loaded rank (x pace), and under expert tensor parallelism a tp-th of it each
        (the experts are otherwise whole on every TP rank): the experts' share of the layer's
        compute times (pace / expert tp - 1)."""
        moe = self.experts.experts_of(layer.name)
        if moe is None or (layout.ep == 1 and expert_tp(layout) == 1):
            return 0.0
        pace = self._pace(moe, layout)
        compute = split.compute
        expert_s = (forward_passes * moe.expert_forward_share * compute.forward_s
                    + moe.expert_backward_share * compute.backward_s) * per_token
        return (pace / expert_tp(layout) - 1.0) * expert_s

    def _zero_micro_batch_s(self, layer: "LayerProfile", split: TPLayerSplit, layout: ParallelLayout,
                            compute: LayerCompute, per_token: float, gpu: GPUSpec, full_recompute: bool) -> float:
        """ZeRO-2/3 traffic every micro-batch, prefetched behind the layer's compute: the layer's
        share of its FSDP unit's messages (`IssuedCollectives._fsdp_collectives` counts them);
        under train.zero3_runtime=deepspeed_2021, one collective per tensor instead, overlapped only by
        its coordinator's prefetch."""
        if layout.zero_stage < 2 or self.groups.grad_size(layout) == 1:
            return 0.0
        overhead = gpu.launch_overhead_s
        if self._deepspeed_2021(layout):
            forward = compute.forward_s * per_token + compute.forward_launches * overhead
            backward = compute.backward_s * per_token + compute.backward_launches * overhead
            return self._per_tensor_zero3(layer, split, layout, gpu).seconds(self.groups.collective_s, forward,
                                                                             backward, full_recompute)
        _, is_root = self.structure.fsdp_unit_of(layer.name)
        if layout.pp > 1 and (layout.zero_stage == 2 or is_root):
            return 0.0  # gathered and reduced once per step under a pipeline schedule (per_step_parts)
        group = self.groups.shard_group(layout)
        gather = self._unit_share_s(Collective.ALL_GATHER, layer, split, layout, self.weights_bytes, group)
        forward = compute.forward_s * per_token + compute.forward_launches * overhead
        if layout.pp > 1:  # ZeRO-3 in a pipeline: only the forward gathers come every micro-batch
            return exposed_s(gather, forward)
        rs = self._unit_share_s(Collective.REDUCE_SCATTER, layer, split, layout, self.grads_bytes, group)
        backward = compute.backward_s * per_token + compute.backward_launches * overhead
        # Hybrid sharding's all-reduce across replicas follows each reduce-scatter; priced exposed
        # (not overlapped with backward), as it was when priced once per step.
        replicas = self._replica_reduce_s(layer, split, layout)
        if layout.zero_stage == 2 or is_root:
            # FSDP without resharding after forward (ZeRO-2, and the root under ZeRO-3) still
            # reshards after backward, so every micro-batch's forward gathers the parameters
            # again (measured: one all-gather per unit and micro-batch), not once per step.
            return exposed_s(gather, forward) + exposed_s(rs, backward) + replicas
        # ZeRO-3 gathers the unit's parameters before its forward and again before its backward.
        return exposed_s(gather, forward) + exposed_s(gather + rs, backward) + replicas

    def _deepspeed_2021(self, layout: ParallelLayout) -> bool:
        """ZeRO-3 priced as DeepSpeed's stage 3 of 2021 ran it (cost_models.deepspeed_zero3)."""
        return layout.zero_stage == 3 and self.train.zero3_runtime == "deepspeed_2021"

    def _per_tensor_zero3(self, layer: "LayerProfile", split: TPLayerSplit, layout: ParallelLayout,
                          gpu: GPUSpec) -> PerTensorZero3:
        """The layer's tensors as DeepSpeed's stage 3 gathers them (cost_models.deepspeed_zero3),
        each shrunk by the layer's TP share."""
        numels = [math.prod(self.profile.param_shapes.get(name, [0])) for name in layer.param_names]
        share = self.tp_params(layer, split, layout) / max(1, sum(numels))
        return PerTensorZero3(tuple(n * share for n in numels), self.weights_bytes, self.grads_bytes,
                              self.groups.shard_group(layout), gpu.launch_overhead_s,
                              gpu.memory_bandwidth_Bps * gpu.efficiency_of("elementwise"))

    def _unit_share_s(self, op: Collective, layer: "LayerProfile", split: TPLayerSplit, layout: ParallelLayout,
                      bytes_per_param: float, group: GroupPlacement) -> float:
        """The layer's share (by parameters) of one collective over its whole FSDP unit: units
        that hold several layers (the embeddings at the root, the final norm with the head)
        move them in one message, paying one latency."""
        params = self.tp_params(layer, split, layout)
        unit, _ = self.structure.fsdp_unit_of(layer.name)
        unit_params = self._layers_params(layout, unit)
        if unit_params <= params:
            return self.groups.collective_s(op, params * bytes_per_param, group)
        return self.groups.collective_s(op, unit_params * bytes_per_param, group) * params / unit_params

    def _layers_params(self, layout: ParallelLayout, names: tuple[str, ...]) -> float:
        """Parameters the named layers hold on one rank (after TP), memoised by what they depend
        on (the split of each layer, tp and ep): every layer of an FSDP unit asks for its unit's."""
        reference = self.ranks.reference_gpu(layout)
        group = self.groups.placement(layout, "tp")
        key = (names, layout.tp, layout.ep, group.nodes, group.per_node, reference.signature)
        if key not in self._unit_params:
            layers = [self.layers[self.structure.layer_index[name]] for name in names]
            self._unit_params[key] = sum(self.tp_params(layer, self.splits.split(layer.name, layout, reference), layout)
                                         for layer in layers)
        return self._unit_params[key]

    def _replica_reduce_s(self, layer: "LayerProfile", split: TPLayerSplit, layout: ParallelLayout) -> float:
        """Hybrid sharding's all-reduce of the layer's reduced shard across the replicas (FSDP
        runs it after each reduce-scatter: measured 12 on the 2 x 2 hybrid plan, 6 units x 2
        micro-batches)."""
        if not layout.hybrid_shard or self.groups.shard_size(layout) >= self.groups.grad_size(layout):
            return 0.0
        params = self.tp_params(layer, split, layout)
        nbytes = params * self.grads_bytes / self.groups.shard_size(layout)
        return self.groups.collective_s(Collective.ALL_REDUCE, nbytes, self.groups.replica_group(layout))

    def per_step_parts(self, layer: "LayerProfile", split: TPLayerSplit, layout: ParallelLayout, scale: float,
                       gpu: GPUSpec) -> dict[str, float]:
        """Seconds once per step for a layer: optimizer update and exposed gradient sync."""
        params = self.tp_params(layer, split, layout)
        grad_size = self.groups.grad_size(layout)
        shard = self.groups.shard_size(layout) if layout.zero_stage >= 1 and grad_size > 1 else 1
        bandwidth = gpu.memory_bandwidth_Bps * gpu.efficiency_of("elementwise")
        dense, experts = self._rank_params(layer, split, layout)
        # Expert states are sharded over the expert-data-parallel group, ep times smaller.
        expert_shard = max(1, shard // layout.ep)
        update = (dense / shard + experts / expert_shard) * OPTIMIZER_BYTES_PER_PARAM.get(self.train.optimizer, 28) \
            / bandwidth
        if grad_size == 1 or params == 0:
            return self._scaled({"optimizer": update, "dp_comm": 0.0})
        per_token = scale / layout.cp
        backward = split.compute.backward_s * per_token + split.compute.backward_launches * gpu.launch_overhead_s
        if layout.zero_stage <= 1:
            forward = split.compute.forward_s * per_token + split.compute.forward_launches * gpu.launch_overhead_s
            return self._scaled({"optimizer": update,
                                 "dp_comm": self._replica_sync_s(layer, split, layout, backward, forward)})
        if layout.pp == 1:  # ZeRO-2/3 reduce every micro-batch (_zero_micro_batch_s)
            regather = (self._per_tensor_zero3(layer, split, layout, gpu).persistent_regather_s()
                        if self._deepspeed_2021(layout) else 0.0)
            return self._scaled({"optimizer": update, "dp_comm": regather})
        return self._scaled({"optimizer": update, "dp_comm": self._pipelined_zero_s(layer, split, layout, backward)})

    def _replica_sync_s(self, layer: "LayerProfile", split: TPLayerSplit, layout: ParallelLayout,
                        backward_s: float, forward_s: float) -> float:
        """ZeRO-0/1: the gradients' all-reduce after the last micro-batch (per FSDP unit, or the
        generated exchange's buckets), and ZeRO-1's all-gather of the updated parameters: one
        flat message per pipeline rank (ShardedAdamW; the layer's share of the model's
        parameters over pp, as a stage's share is not known per layer), exposed. Megatron-Core's
        distributed optimizer (`cost_models.engine_overlap`) reduce-scatters the gradients
        instead, under the backward, and gathers the parameters behind the forward (`forward_s`)."""
        params = self.tp_params(layer, split, layout)
        megatron_core = self.train.tp_runtime == MEGATRON_CORE
        if megatron_core and layout.zero_stage == 1:  # its distributed optimizer reduce-scatters, under backward
            scatter = self.groups.collective_s(Collective.REDUCE_SCATTER, params * self.grads_bytes,
                                               self.groups.shard_group(layout))
            exposed = exposed_s(scatter, backward_s)
        elif self.sync.cost(layout, 1.0).algorithm not in FSDP_ALGORITHMS:  # the generated exchange's buckets
            exposed = self.sync.exposed_s(self.sync.cost(layout, params * self.grads_bytes), backward_s)
        else:
            unit, _ = self.structure.fsdp_unit_of(layer.name)
            unit_params = max(params, self._layers_params(layout, unit))
            cost = self.sync.cost(layout, unit_params * self.grads_bytes)
            exposed = self.sync.exposed_s(replace(cost, seconds=cost.seconds * params / unit_params), backward_s)
        if layout.zero_stage == 1:  # updated shards gathered back to every replica
            flat = self._layers_params(layout, tuple(layer.name for layer in self.layers)) / layout.pp
            # Megatron-Core gathers its 16-bit parameters; the generated ShardedAdamW its fp32 shards.
            gathered_bytes = self.weights_bytes if megatron_core else FP32_BYTES
            gather = self.groups.collective_s(Collective.ALL_GATHER, max(flat, params) * gathered_bytes,
                                              self.groups.shard_group(layout)) * params / max(flat, params)
            exposed += param_gather_exposed_s(gather, forward_s) if megatron_core else gather
        return exposed

    def _pipelined_zero_s(self, layer: "LayerProfile", split: TPLayerSplit, layout: ParallelLayout,
                          backward_s: float) -> float:
        """ZeRO-2/3 under a pipeline schedule, once per step: the schedule keeps gradients
        unreduced until the last micro-batch's backward (one reduce-scatter per unit, measured),
        ZeRO-2 and the root gather once, and ZeRO-3's other units once more for backward."""
        group = self.groups.shard_group(layout)
        rs = self._unit_share_s(Collective.REDUCE_SCATTER, layer, split, layout, self.grads_bytes, group)
        gather = self._unit_share_s(Collective.ALL_GATHER, layer, split, layout, self.weights_bytes, group)
        return gather + exposed_s(rs, backward_s) + self._replica_reduce_s(layer, split, layout)

    def tp_params(self, layer: "LayerProfile", split: TPLayerSplit, layout: ParallelLayout) -> float:
        """Parameters of the layer on one rank (after TP and expert parallelism): what its
        gradient synchronisation and ZeRO gathers move. Expert gradients are summed over the
        expert-data-parallel group (dp / ep ranks), priced as the whole gradient group's
        collective at 1/ep of their bytes (a ring's time depends on bytes, not ranks, to within
        (n-1)/n)."""
        return sum(self._rank_params(layer, split, layout))

    def _rank_params(self, layer: "LayerProfile", split: TPLayerSplit, layout: ParallelLayout) -> tuple[float, float]:
        """(dense, expert) parameters of the layer on one rank: TP's split applied to both
        alike, the stacked experts further divided by ep."""
        sharded = layer.param_count * split.tp_sharded_param_fraction
        on_rank = sharded / layout.tp + (layer.param_count - sharded)
        moe = self.experts.experts_of(layer.name)
        if moe is None or not layer.param_count:
            return on_rank, 0.0
        expert_share = moe.expert_params / layer.param_count
        return on_rank * (1 - expert_share), on_rank * expert_share / layout.ep / expert_tp(layout)

    def states(self, layer: "LayerProfile", split: TPLayerSplit, layout: ParallelLayout) -> ModelStates:
        dense, experts = self._rank_params(layer, split, layout)
        zero, shard = self._zero_and_shard(layout)
        kwargs = dict(fsdp=self.sync.uses_fsdp(layout), pipelined=layout.pp > 1)
        states = trained_model_states(dense, self.train.precision, self.train.optimizer, zero, shard, **kwargs)
        if not experts:
            return states
        # Expert weights are replicated over dp / ep ranks: ZeRO shards their states there.
        expert = trained_model_states(experts, self.train.precision, self.train.optimizer, zero,
                                      max(1, shard // layout.ep), **kwargs)
        return ModelStates(states.params_bytes + expert.params_bytes, states.grads_bytes + expert.grads_bytes,
                           states.optimizer_bytes + expert.optimizer_bytes,
                           states.compute_copy_bytes + expert.compute_copy_bytes)

    def step_bytes(self, layer: "LayerProfile", split: TPLayerSplit, layout: ParallelLayout) -> float:
        """What the layer adds to its static bytes at the optimizer step: its share of the step's
        transients (`optimizer_step_bytes`, sharded as `states` shards its states), less its
        compute copy, freed after backward (negative where the copy is the larger)."""
        dense, experts = self._rank_params(layer, split, layout)
        zero, shard = self._zero_and_shard(layout)
        step = optimizer_step_bytes(dense, self.train.optimizer, zero, shard)
        if experts:
            step += optimizer_step_bytes(experts, self.train.optimizer, zero, max(1, shard // layout.ep))
        return step - self.states(layer, split, layout).compute_copy_bytes

    def _zero_and_shard(self, layout: ParallelLayout) -> tuple[int, int]:
        """(ZeRO stage, ranks the states are sharded over) as the rank keeps them: none without
        a gradient group."""
        if self.groups.grad_size(layout) == 1:
            return 0, 1
        return layout.zero_stage, self.groups.shard_size(layout)

    def send_s(self, layer: "LayerProfile", layout: ParallelLayout, scale: float) -> float:
        """Activation to the next stage forward and its gradient back (Narayanan et al. 2021:
        b·s·h per micro-batch; ÷ t under SP, ÷ cp)."""
        if layout.pp == 1:
            return 0.0
        nbytes = layer.output_bytes * scale / layout.cp / (layout.tp if layout.sequence_parallel else 1)
        return 2 * self.groups.collective_s(Collective.SEND_RECV, nbytes, self.groups.placement(layout, "pp")) * \
            self.cluster.scale_of("pp_comm")

    @staticmethod
    def step_overhead_bytes(gpu: GPUSpec) -> int:
        """Memory beside the model states at the optimizer step whatever the layers: the CUDA
        context (backward's buffers and working set are freed by then)."""
        return cuda_context_bytes(gpu)

    def overhead_bytes(self, layout: ParallelLayout, scale: float, gpu: GPUSpec) -> int:
        return int(sum(self._buffers(layout, scale, gpu).values()))

    def _buffers(self, layout: ParallelLayout, scale: float, gpu: GPUSpec) -> dict[str, float]:
        """Memory besides model states and stored activations (the gathered compute copy of
        ZeRO-0..2 parameters scales with a stage's layers: it is in `trained_model_states`)."""
        largest = self._largest_params_on_rank(layout.ep) / layout.tp
        buffers: dict[str, float] = {"cuda_context": cuda_context_bytes(gpu)}
        sharded = self.groups.grad_size(layout) > 1
        if sharded and self._deepspeed_2021(layout):
            # One tensor at a time, not a block (cost_models.deepspeed_zero3).
            buffers.update(per_tensor_buffers(self.structure.largest_tensor / layout.tp, self.weights_bytes,
                                              self.grads_bytes))
        else:
            if layout.zero_stage == 3 and sharded and layout.pp == 1:
                # This layer's and the prefetched next layer's gathered parameters (FSDP's default;
                # a pipeline stage keeps all of its layers', see `trained_model_states`).
                buffers["zero3_gathered_params"] = 2 * largest * self.weights_bytes
            if self.sync.uses_fsdp(layout):
                # FSDP reduces one layer's gradients at a time, from an fp32 copy (reduce_dtype).
                buffers["gradient_reduce"] = largest * FP32_BYTES
            elif sharded:
                # The generated hierarchical / parameter-server exchange: a flat bucket and its result.
                buffers["dp_buckets"] = 2 * self.sync.bucket_bytes(layout)
        # A layer's full activations while its backward (or its recomputation) runs; under ring
        # attention, where more, one K/V block's fp32 scores and their exponentials, alive
        # together while the block runs (in forward, and in backward, which recomputes them).
        # Transients of different moments: the larger counts, not their sum.
        ring = 0.0
        if ring_attention(layout):
            block = 4 * self.structure.score_elements * scale / layout.tp / layout.cp ** 2
            ring = 2 * min(block, RING_TILE_SCORE_BYTES)  # codegen tiles a block's queries to this
        if layout.ep > 1 and self.experts.has_experts:
            # The tokens an MoE layer receives from its expert-parallel group and their outputs
            # before the combine, one layer at a time.
            buffers["ep_dispatch"] = max(2 * dispatch_bytes(moe, scale, layout.cp,
                                                            self._pace(moe, layout))
                                         for moe in self.experts.layers.values())
        buffers["working_set"] = max(self.structure.largest_working_set(scale, layout.tp, layout.cp), ring)
        return buffers

    def _largest_params_on_rank(self, ep: int) -> float:
        """The most parameters one layer holds on a rank before TP: its experts divided by ep."""
        if ep == 1 or not self.experts.has_experts:
            return self.structure.largest_params
        return max(layer.param_count - (moe.expert_params - moe.expert_params / ep if (moe := self.experts.experts_of(
            layer.name)) else 0) for layer in self.layers)

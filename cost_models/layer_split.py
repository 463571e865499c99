"""A layer kind as a layout's tensor parallelism splits it: `TPLayerSplit` (what the split leaves
on a rank: compute, collectives, sharded shares, activations) and `LayerSplits`, which asks the
planner's `TPSplitter` for each (layer kind, tp degree, TP group, GPU) once and keeps the answer.

    splits = LayerSplits(profile, compute, LayoutGroups(cluster), ILPSplitter(profile))
    splits.split("blocks.0", ParallelLayout(tp=2), cluster.node_gpus[0]).styles
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from autopar.domain.layout import ParallelLayout
from cost_models.compute import ComputeModel, LayerCompute
from cost_models.hardware import GPUSpec
from cost_models.host import dtensor_modules
from cost_models.memory import LayerActivations, activations_from_fraction, layer_activations
from cost_models.placement import LayoutGroups
from cost_models.topology import GroupPlacement
from cost_models.tp_layout import SPParts

if TYPE_CHECKING:
    from autopar.model_profile import LayerProfile, ModelProfile


@dataclass(frozen=True)
class TPLayerSplit:
    """A layer kind under tensor parallelism of degree t, at the profiled micro-batch.

    Attributes:
        compute: roofline and launches after sharding (sharded ops' work ÷ t).
        replicated_forward_s, replicated_backward_s: roofline seconds of ops TP leaves
            replicated.
        comm: (collective, bytes) per micro-batch, forward then backward.
        tp_sharded_activation_fraction: share of the saved bytes that TP shards.
        tp_sharded_param_fraction: share of the layer's parameters TP splits.
        styles: module FQN -> colwise | rowwise | vocab_parallel | sharded.
        activations: per-op activation accounting (None: use the fraction above).
        forward_comm: how many leading entries of `comm` are forward (None: half of them).
        sp: what sequence parallelism changes (`cost_models.tp_layout`): the replicated work
            that runs on the sequence slice and the collectives of the styles' boundaries.
        rerun_comm, rerun_comm_under_sp: the forward collectives full recomputation issues
            again, without and with sequence parallelism (None: every forward one). The re-run
            forward stops at the last tensor the layer's backward reads (non-reentrant
            checkpointing's early stop), so a collective after it (a block's last row-parallel
            output) is not issued again.
    """

    compute: LayerCompute
    replicated_forward_s: float
    replicated_backward_s: float
    comm: tuple[tuple[str, float], ...]
    tp_sharded_activation_fraction: float
    tp_sharded_param_fraction: float
    styles: dict[str, str] = field(default_factory=dict)
    activations: LayerActivations | None = None
    forward_comm: int | None = None
    sp: SPParts = SPParts()
    comm_under_sp: tuple[tuple[str, float], ...] | None = None
    forward_comm_under_sp: int | None = None
    rerun_comm: tuple[tuple[str, float], ...] | None = None
    rerun_comm_under_sp: tuple[tuple[str, float], ...] | None = None

    def collectives(self, sequence_parallel: bool) -> tuple[tuple[tuple[str, float], ...], int]:
        """(comm, how many of it lead in forward) as the styles issue them, with or without
        sequence parallelism (under it a split region gathers and reduce-scatters the sequence
        where it would all-reduce)."""
        if sequence_parallel and self.comm_under_sp is not None:
            return self.comm_under_sp, self.forward_comm_under_sp or 0
        return self.comm, len(self.comm) // 2 if self.forward_comm is None else self.forward_comm

    def dtensor_modules(self, sequence_parallel: bool) -> int:
        """Modules of the layer that run on DTensors (what the host dispatches: cost_models.host)."""
        return dtensor_modules(self.styles) + (self.sp.norms if sequence_parallel else 0)

    def recomputed_collectives(self, sequence_parallel: bool) -> tuple[tuple[str, float], ...]:
        """The collectives full recomputation's re-run forward issues again (SP boundaries apart)."""
        rerun = self.rerun_comm_under_sp if sequence_parallel and self.comm_under_sp is not None else self.rerun_comm
        if rerun is not None:
            return rerun
        comm, forward_count = self.collectives(sequence_parallel)
        return comm[:forward_count]


class TPSplitter(Protocol):
    """Chooses and prices a layer's operator-wise TP split."""

    def split(self, layer_name: str, tp: int, group: GroupPlacement, gpu: GPUSpec) -> TPLayerSplit: ...


class LayerSplits:
    """Each layer kind's TP split under a layout, cached per (kind, tp, TP group, GPU).

    Args:
        profile: the traced model (its per-op detail accounts for the activations).
        compute: the model's compute prices (the split of tp = 1 is its layer as traced).
        groups: where a layout's TP group sits (the split's collectives are priced on it).
        tp_splitter: chooses and prices a layer's split under TP (None: tp = 1 only).
    """

    def __init__(self, profile: "ModelProfile", compute: ComputeModel, groups: LayoutGroups,
                 tp_splitter: TPSplitter | None):
        self.profile = profile
        self.compute = compute
        self.groups = groups
        self.tp_splitter = tp_splitter
        self._splits: dict[tuple, TPLayerSplit] = {}
        self._base_acts: dict[str, LayerActivations] = {}

    def split(self, layer_name: str, layout: ParallelLayout, gpu: GPUSpec) -> TPLayerSplit:
        """The layer kind under the layout's TP degree on `gpu` (cached)."""
        kind = self.compute.kind(layer_name)
        group = self.groups.placement(layout, "tp")
        key = (kind, layout.tp, group.nodes, group.per_node, gpu.signature)
        if key not in self._splits:
            if layout.tp == 1:
                compute = self.compute.layer(kind, gpu)
                self._splits[key] = TPLayerSplit(
                    compute=compute, replicated_forward_s=compute.forward_s, replicated_backward_s=compute.backward_s,
                    comm=(), tp_sharded_activation_fraction=0.0, tp_sharded_param_fraction=0.0,
                    activations=self._base_activations(kind))
            elif self.tp_splitter is None:
                raise ValueError("pricing tp > 1 needs a TP splitter: the planner's "
                                 "(autopar.solver.tp_split.ILPSplitter, which reads the profile's per-op detail)")
            else:
                self._splits[key] = self.tp_splitter.split(kind, layout.tp, group, gpu)
        return self._splits[key]

    def _base_activations(self, kind: str) -> LayerActivations:
        """Activation accounting without TP (every saved tensor whole)."""
        if kind not in self._base_acts:
            layer = self.profile.layer(kind)
            if self.profile.ops:
                forward = [op for op in self.compute.ops_by_layer.get(kind, []) if op.phase == "forward"]
                self._base_acts[kind] = layer_activations(layer, forward,
                                                          rerun_products=self.compute.rerun_products)
            else:  # no per-op detail: selective recomputation keeps everything
                total = float(layer.activation_bytes)
                self._base_acts[kind] = LayerActivations(0.0, total, 0.0, total, float(layer.input_bytes))
        return self._base_acts[kind]

    def layer_activations(self, layer: "LayerProfile", split: TPLayerSplit) -> LayerActivations:
        """The activations a layer saves under its split (per op where the split accounts for them)."""
        if split.activations is not None:
            return split.activations
        kind = self.compute.kind(layer.name)
        return activations_from_fraction(layer, self._base_activations(kind), split.tp_sharded_activation_fraction)

"""Gradient synchronisation of the data-parallel ranks under ZeRO-0/1: which all-reduce algorithm a
layout runs (pinned, or the one adding least to the step), what it costs on the layout's gradient
group, how much of it the backward hides, and the buckets of the generated exchanges.

Built from the pricer's groups, the compute model and the layers alone (`PlanPricer.sync`), so it
can be priced and tested without the rest of the pricer.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from autopar.domain.layout import ParallelLayout
from autopar.domain.vocabulary import DP_BUCKET_BYTES, DPSync
from cost_models.collectives import Algorithm, Collective, CollectiveCost, collective_time_s, exposed_s
from cost_models.compute import ComputeModel
from cost_models.memory import FP32_BYTES
from cost_models.placement import LayoutGroups

BUCKET_CHOICES_BYTES = tuple(mib * 2**20 for mib in (4, 16, 25, 64, 256, 1024))
# Run after backward by the generated gradient_sync.py (no overlap with backward).
POST_BACKWARD_SYNC = (Algorithm.HIERARCHICAL, Algorithm.HALVING_DOUBLING, Algorithm.PARAMETER_SERVER)


class GradientSync:
    """Prices the gradient all-reduce of a layout's data- x context-parallel group.

    Args:
        groups: where the layout's groups sit (the pricer's).
        compute: the model's compute prices (a layer's backward hides part of the all-reduce).
        layers: the profile's layers (their parameter counts).
        grads_bytes: bytes of one parameter's gradient (the precision's).
        traced_micro_batch: the micro-batch the profile was traced with (compute scales from it).
        precision: the training precision (a lone GPU rank is wrapped in FSDP for mixed precision).
    """

    def __init__(self, groups: LayoutGroups, compute: ComputeModel, layers: Sequence[Any], grads_bytes: int,
                 traced_micro_batch: int, precision: str):
        self.groups = groups
        self.compute = compute
        self.layers = layers
        self.grads_bytes = grads_bytes
        self.traced_micro_batch = traced_micro_batch
        self.precision = precision
        self._costs: dict[tuple, CollectiveCost] = {}
        self._chosen: dict[tuple, Algorithm] = {}

    def cost(self, layout: ParallelLayout, nbytes: float) -> CollectiveCost:
        """Gradient all-reduce on the gradient group: the pinned algorithm or the layout's choice."""
        group = self.groups.grad_group(layout)
        pinned = getattr(layout, "dp_sync", None) or DPSync.AUTO
        algorithm = self.auto(layout) if pinned == DPSync.AUTO else Algorithm(pinned)
        key = (algorithm, nbytes, group)
        if key not in self._costs:
            self._costs[key] = CollectiveCost(Collective.ALL_REDUCE, algorithm,
                                              collective_time_s(Collective.ALL_REDUCE, nbytes, group, algorithm))
        return self._costs[key]

    @staticmethod
    def exposed_s(cost: CollectiveCost, backward_s: float) -> float:
        """What a gradient all-reduce adds to the step: FSDP's ring/tree reductions overlap the
        backward; the generated hierarchical and parameter-server exchanges run after it."""
        if cost.algorithm in POST_BACKWARD_SYNC:
            return cost.seconds
        return exposed_s(cost.seconds, backward_s)

    def auto(self, layout: ParallelLayout) -> Algorithm:
        """The algorithm adding least to the step for the largest layer's gradients (one choice per
        layout: the generated code uses one): ring, tree, hierarchical, and with ZeRO-0 a
        parameter server (it holds the whole optimizer, which ZeRO-1 shards). The largest layer's
        backward is timed on the first pipeline rank's GPU."""
        group = self.groups.grad_group(layout)
        key = (layout.zero_stage, layout.tp, layout.micro_batch_size, group)
        if key not in self._chosen:
            largest = max(self.layers, key=lambda layer: layer.param_count)
            nbytes = largest.param_count * self.grads_bytes / layout.tp
            gpu = self.groups.pp_rank_gpus(layout)[0][0]
            backward = (self.compute.layer(largest.name, gpu).backward_s * layout.micro_batch_size
                        / self.traced_micro_batch / (layout.tp * layout.cp))
            options = [Algorithm.RING, Algorithm.TREE] + ([Algorithm.HIERARCHICAL] if group.crosses_nodes else [])
            options += [Algorithm.PARAMETER_SERVER] if layout.zero_stage == 0 else []
            costs = [CollectiveCost(Collective.ALL_REDUCE, a,
                                    collective_time_s(Collective.ALL_REDUCE, nbytes, group, a)) for a in options]
            self._chosen[key] = min(costs, key=lambda c: (self.exposed_s(c, backward),
                                                          options.index(c.algorithm))).algorithm
        return self._chosen[key]

    def bucket_bytes(self, layout: ParallelLayout) -> int:
        """Bucket size of the generated hierarchical / parameter-server exchange: the smallest
        candidate whose per-bucket latency adds under 1% to the exchange of all gradients (small
        buckets bound the extra memory; too small ones pay a latency per bucket)."""
        group = self.groups.grad_group(layout)
        if group.size == 1:
            return DP_BUCKET_BYTES
        algorithm = self.cost(layout, 1.0).algorithm
        # The generated exchange flattens the gradients to fp32 whatever they are reduced in elsewhere.
        total = sum(layer.param_count for layer in self.layers) * FP32_BYTES / layout.tp / layout.pp
        whole = collective_time_s(Collective.ALL_REDUCE, total, group, algorithm)
        latency = collective_time_s(Collective.ALL_REDUCE, 1.0, group, algorithm)
        for bucket in BUCKET_CHOICES_BYTES:
            if (math.ceil(total / bucket) - 1) * latency <= 0.01 * whole:
                return bucket
        return BUCKET_CHOICES_BYTES[-1]

    def uses_fsdp(self, layout: ParallelLayout) -> bool:
        """Whether the generated code wraps the model in FSDP: gradients averaged over ranks by
        FSDP's reduction, not the hierarchical / parameter-server exchange (ZeRO-0/1 only); on a
        lone data-parallel rank for its mixed precision when a GPU computes in 16 bit
        (codegen's `fsdp_wraps`)."""
        if self.groups.grad_size(layout) == 1:
            return self.precision != "fp32" and any(gpu.name != "cpu" for gpu in self.groups.cluster.node_gpus)
        return layout.zero_stage >= 2 or layout.cp > 1 or self.cost(layout, 1.0).algorithm not in POST_BACKWARD_SYNC

"""Gradient synchronisation priced alone (cost_models.dp_sync.GradientSync, built from the groups,
the compute model and the layers): the pinned algorithm as priced by the collectives, what the
backward hides, the automatic choice's options, the generated exchange's buckets."""
from __future__ import annotations

import math

from autopar.domain.layout import ParallelLayout
from cost_models.collectives import Algorithm, Collective, collective_time_s
from cost_models.compute import ComputeModel
from cost_models.dp_sync import BUCKET_CHOICES_BYTES, DP_BUCKET_BYTES, GradientSync
from cost_models.collectives import OVERLAP_INTERFERENCE
from cost_models.placement import LayoutGroups
from cost_models.topology import ClusterConfig, ClusterSpec
from tests.profiles import gpt


def _sync(nodes: int = 2, precision: str = "bf16") -> GradientSync:
    profile = gpt()
    cluster = ClusterSpec.from_config(ClusterConfig(name="t", gpu="H100-SXM", nodes=nodes, gpus_per_node=8))
    return GradientSync(LayoutGroups(cluster), ComputeModel(profile), profile.layers, 2, profile.micro_batch_size,
                        precision)


def test_a_pinned_algorithm_is_priced_as_the_collective_runs_it():
    sync = _sync()
    layout = ParallelLayout(dp=16, dp_sync="tree")
    cost = sync.cost(layout, 2**24)
    group = sync.groups.grad_group(layout)
    assert cost.algorithm is Algorithm.TREE
    assert cost.seconds == collective_time_s(Collective.ALL_REDUCE, 2**24, group, Algorithm.TREE)


def test_what_the_backward_hides():
    """FSDP's ring overlaps the backward (interference aside); the generated parameter server runs after it."""
    sync = _sync()
    ring = sync.cost(ParallelLayout(dp=16, dp_sync="ring"), 2**24)
    ps = sync.cost(ParallelLayout(dp=16, dp_sync="ps"), 2**24)
    assert math.isclose(sync.exposed_s(ring, 10.0), OVERLAP_INTERFERENCE * ring.seconds)
    assert sync.exposed_s(ring, 0.0) == ring.seconds
    assert sync.exposed_s(ps, 10.0) == ps.seconds


def test_the_automatic_choice_is_the_cheapest_of_what_can_run():
    """The choice adds least to the step of what can run: inside one node no hierarchical exchange
    (nothing to cross), a parameter server only with replicated optimizer states (ZeRO-0); each
    option priced as if pinned, on the largest layer's gradients against its backward."""
    for nodes, zero, allowed in ((1, 0, (Algorithm.RING, Algorithm.TREE, Algorithm.PARAMETER_SERVER)),
                                 (2, 1, (Algorithm.RING, Algorithm.TREE, Algorithm.HIERARCHICAL))):
        sync = _sync(nodes)
        layout = ParallelLayout(dp=8 * nodes, zero_stage=zero)
        largest = max(sync.layers, key=lambda layer: layer.param_count)
        gpu = sync.groups.cluster.node_gpus[0]
        backward = sync.compute.layer(largest.name, gpu).backward_s
        added = {a: sync.exposed_s(sync.cost(ParallelLayout(dp=8 * nodes, zero_stage=zero, dp_sync=a.value),
                                             largest.param_count * 2), backward) for a in allowed}
        assert sync.auto(layout) in allowed
        assert added[sync.auto(layout)] == min(added.values())


def test_buckets_add_under_one_percent_of_latency():
    sync = _sync()
    assert sync.bucket_bytes(ParallelLayout(dp=1)) == DP_BUCKET_BYTES  # nothing to exchange
    layout = ParallelLayout(dp=16, dp_sync="hierarchical")
    bucket = sync.bucket_bytes(layout)
    group, algorithm = sync.groups.grad_group(layout), Algorithm.HIERARCHICAL
    total = sum(layer.param_count for layer in sync.layers) * 4
    whole = collective_time_s(Collective.ALL_REDUCE, total, group, algorithm)
    latency = collective_time_s(Collective.ALL_REDUCE, 1.0, group, algorithm)

    def adds(size: int) -> float:
        return (math.ceil(total / size) - 1) * latency

    assert adds(bucket) <= 0.01 * whole or bucket == BUCKET_CHOICES_BYTES[-1]
    smaller = [size for size in BUCKET_CHOICES_BYTES if size < bucket]
    assert all(adds(size) > 0.01 * whole for size in smaller)


def test_when_the_generated_code_wraps_the_model_in_fsdp():
    sync = _sync()
    assert sync.uses_fsdp(ParallelLayout(dp=16, zero_stage=2))
    assert sync.uses_fsdp(ParallelLayout(dp=16, dp_sync="ring"))  # FSDP's reduction
    assert not sync.uses_fsdp(ParallelLayout(dp=16, dp_sync="hierarchical"))  # the generated exchange
    assert sync.uses_fsdp(ParallelLayout(tp=16))  # a lone rank on GPUs, for mixed precision
    assert not _sync(precision="fp32").uses_fsdp(ParallelLayout(tp=16))

"""Megatron-Core's communication overlaps as a pricing runtime (`train.tp_runtime=megatron_core`,
cost_models/engine_overlap.py): TP collectives under sequence parallelism hidden but for one
chunk, the distributed optimizer's gradients reduce-scattered under the backward and its
parameters gathered behind the forward. Checked by hand against the plain runtime's prices."""
from __future__ import annotations

import pytest

from cost_models.collectives import OVERLAP_INTERFERENCE, Collective, collective_time_s, exposed_s
from cost_models.engine_overlap import param_gather_exposed_s, tp_comm_exposed_s
from cost_models.step import ParallelLayout, TrainSpec, estimate
from cost_models.topology import ClusterConfig, ClusterSpec
from tests.profiles import gpt, planner_splitter


def test_userbuffers_leave_one_chunk_of_each_exchange_exposed():
    # 8 ranks: 1/8 of the exchange exposed, the other 7/8 under the GEMM at the interference cost.
    assert tp_comm_exposed_s(1.0, 8) == pytest.approx(1 / 8 + OVERLAP_INTERFERENCE * 7 / 8)
    assert tp_comm_exposed_s(0.4, 2) == pytest.approx(0.2 + OVERLAP_INTERFERENCE * 0.2)
    # The parameter gather is a prefetch: hidden up to the forward it runs beside.
    assert param_gather_exposed_s(1.0, 0.25) == pytest.approx(0.75 + OVERLAP_INTERFERENCE * 0.25)
    assert param_gather_exposed_s(0.1, 1.0) == pytest.approx(OVERLAP_INTERFERENCE * 0.1)


def _priced(runtime: str, **layout):
    profile = gpt()
    cluster = ClusterSpec.from_config(ClusterConfig(name="t", gpu="H100-SXM", nodes=2, gpus_per_node=2,
                                                    inter_node_bandwidth_GBps=1))
    plan = ParallelLayout(dp=2, tp=2, micro_batch_size=2, num_micro_batches=2, **layout)
    return estimate(profile, cluster, plan, TrainSpec(global_batch_size=8, tp_runtime=runtime),
                    planner_splitter(profile))


def test_tp_collectives_overlap_only_under_sequence_parallelism():
    plain = _priced("plain", sequence_parallel=True, zero_stage=0)
    overlapped = _priced("megatron_core", sequence_parallel=True, zero_stage=0)
    assert plain.time_breakdown["tp_comm"] > 0
    assert overlapped.time_breakdown["tp_comm"] == pytest.approx(
        plain.time_breakdown["tp_comm"] * (1 / 2 + OVERLAP_INTERFERENCE / 2))
    # TransformerEngine overlaps the sequence-parallel gathers and scatters, not all-reduces.
    assert _priced("megatron_core", zero_stage=0).time_breakdown["tp_comm"] == \
        pytest.approx(_priced("plain", zero_stage=0).time_breakdown["tp_comm"])


def test_distributed_optimizer_moves_half_and_hides_it():
    """ZeRO-1 over a slow network (1 GB/s between nodes): autopar's runtime all-reduces the
    gradients and gathers the parameters after the update, exposed; Megatron-Core's
    reduce-scatters (half a ring all-reduce's bytes) and prefetches the gather, so its data-parallel
    time is what a reduce-scatter and an all-gather leave beyond the compute they overlap."""
    plain = _priced("plain", sequence_parallel=True, zero_stage=1)
    overlapped = _priced("megatron_core", sequence_parallel=True, zero_stage=1)
    assert overlapped.time_breakdown["dp_comm"] < 0.75 * plain.time_breakdown["dp_comm"]
    profile = gpt()
    cluster = ClusterSpec.from_config(ClusterConfig(name="t", gpu="H100-SXM", nodes=2, gpus_per_node=2,
                                                    inter_node_bandwidth_GBps=1))
    group = cluster.group_links([0, 2])  # the data-parallel pair, one rank on each node
    params = profile.param_count / 2  # half the parameters on each TP rank
    # Gradients reduced in fp32 (Megatron-LM turns that on under bf16), bf16 parameters gathered.
    both = collective_time_s(Collective.REDUCE_SCATTER, 4 * params, group) + \
        collective_time_s(Collective.ALL_GATHER, 2 * params, group)
    compute = overlapped.time_breakdown["compute"]
    # Never more than both collectives exposed, never less than what the whole step's compute hides.
    assert exposed_s(both, compute) * 0.9 <= overlapped.time_breakdown["dp_comm"] <= both

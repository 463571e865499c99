"""Mixed GPU types: the planner gives faster GPUs more work (more layers per pipeline stage, more
samples per data-parallel rank) and beats treating every GPU as the slower type."""
from __future__ import annotations

import pytest

from autopar.config import PlanPins, SolverConfig
from autopar.model_file import load_model_file
from autopar.profile import profile_model
from autopar.solver.planner import Planner
from autopar.domain.mesh import Mesh
from cost_models.step import PlanPricer, TrainSpec, proportional_shares
from cost_models.topology import ClusterConfig, ClusterSpec, NodeGroupConfig

GPT_1B = {"layers": 24, "hidden": 2048, "heads": 16, "seq_len": 2048, "vocab": 50304}
_PROFILE: list = []


def gpt(examples_dir):
    if not _PROFILE:
        _PROFILE.append(profile_model(load_model_file(examples_dir / "gpt.py"), GPT_1B, 1, "bf16"))
    return _PROFILE[0]


def mixed() -> ClusterSpec:
    """One DGX H100 node and one DGX A100-80GB node (ranks 0-7 H100, 8-15 A100)."""
    return ClusterSpec.from_config(ClusterConfig(name="mixed", gpus_per_node=8, inter_node_bandwidth_GBps=25,
                                                 node_groups=[NodeGroupConfig("H100-SXM", 1),
                                                              NodeGroupConfig("A100-80GB", 1)]))


def a100s() -> ClusterSpec:
    return ClusterSpec.from_config(ClusterConfig(name="a100", gpu="A100-80GB", nodes=2, gpus_per_node=8,
                                                 inter_node_bandwidth_GBps=25))


TRAIN = TrainSpec(global_batch_size=64)


def test_mixed_cluster_beats_all_a100_and_gives_h100_stages_more_layers(examples_dir):
    profile = gpt(examples_dir)
    plan = Planner(profile, mixed(), TRAIN, SolverConfig(top_k=0), PlanPins()).run().plan
    slower = Planner(profile, a100s(), TRAIN, SolverConfig(top_k=0), PlanPins()).run().plan
    assert plan.predicted.tokens_per_s > slower.predicted.tokens_per_s
    # A pipeline across the two node types: the H100 pipeline ranks hold more layers.
    pinned = Planner(profile, mixed(), TRAIN, SolverConfig(top_k=0), PlanPins(pp=2, tp=8)).run().plan
    gpus, stride = mixed().gpu_types(), Mesh.of(pinned).stride("pp")
    layers = {"H100-SXM": 0, "A100-80GB": 0}
    for j, stage in enumerate(pinned.stages):
        layers[gpus[(j % pinned.pp) * stride]] += len(stage)
    assert layers["H100-SXM"] > layers["A100-80GB"] > 0


def test_data_parallel_ranks_of_mixed_types_get_shares_by_speed(examples_dir):
    """pp=1 on the mixed cluster: every data-parallel rank is one GPU; H100 ranks get more
    samples per micro-batch, the shares add up, and the plan is faster than even shares."""
    profile = gpt(examples_dir)
    pins = PlanPins(pp=1, tp=1, cp=1, zero_stage=1, micro_batch_size=2)
    planner = Planner(profile, mixed(), TRAIN, SolverConfig(top_k=0), pins)
    plan = planner.run().plan
    assert len(plan.dp_shares) == 16 and sum(plan.dp_shares) == 16 * plan.micro_batch_size
    assert min(plan.dp_shares[:8]) > max(plan.dp_shares[8:])
    even = Planner(profile, mixed(), TRAIN, SolverConfig(top_k=0),
                   PlanPins(pp=1, tp=1, cp=1, zero_stage=1, micro_batch_size=2, dp_shares=[2] * 16)).run().plan
    assert plan.predicted.step_time_s < even.predicted.step_time_s


@pytest.mark.parametrize("weights, total", [([1.0, 1.0], 4), ([3.0, 1.0], 4), ([2.9, 1.0, 1.0], 10), ([1.0] * 5, 7),
                                            ([100.0, 1.0], 3)])
def test_proportional_shares(weights, total):
    shares = proportional_shares(weights, total)
    assert sum(shares) == total and min(shares) >= 1
    ideal = [total * w / sum(weights) for w in weights]
    assert all(abs(s - x) < 1 + 1e-9 or s == 1 for s, x in zip(shares, ideal))


def test_pricer_prices_pinned_shares_by_the_slowest_share(examples_dir):
    """On identical GPUs uneven shares only slow the step: the rank with 3 of 4 samples paces it."""
    profile = gpt(examples_dir)
    pricer = PlanPricer(profile, a100s(), TrainSpec(global_batch_size=32))
    from autopar.domain.layout import ParallelLayout

    even = pricer.estimate(ParallelLayout(dp=16, micro_batch_size=2, num_micro_batches=1))
    uneven = pricer.estimate(ParallelLayout(dp=16, micro_batch_size=2, num_micro_batches=1,
                                            dp_shares=(3, 1) + (2,) * 14))
    assert uneven.step_time_s > even.step_time_s

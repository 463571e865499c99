"""The step pricer on real profiles: Megatron's activation formulas, estimate() invariants."""
from __future__ import annotations

import pytest

from autopar.model_file import load_model_file
from autopar.profile import profile_model
from autopar.solver.tp_split import ILPSplitter
from cost_models.memory import megatron_layer_activation_bytes
from cost_models.step import ParallelLayout, PlanPricer, TrainSpec
from cost_models.topology import ClusterConfig, ClusterSpec, NodeGroupConfig

S, H, A, B = 256, 256, 4, 2
GPT = {"layers": 4, "hidden": H, "heads": A, "seq_len": S, "vocab": 512}


@pytest.fixture(scope="module")
def gpt_profile(examples_dir):
    return profile_model(load_model_file(examples_dir / "gpt.py"), GPT, micro_batch_size=B, precision="bf16")


def pricer_for(profile, gpus=8, nodes=1, batch=16, gpu="A100-80GB"):
    cluster = ClusterSpec.from_config(ClusterConfig(name="t", gpu=gpu, nodes=nodes, gpus_per_node=gpus))
    return PlanPricer(profile, cluster, TrainSpec(global_batch_size=batch), ILPSplitter(profile))


def block_activation(pricer, layout, option="none"):
    layer = pricer.profile.layer("blocks.1")
    split = pricer.split(layer.name, layout, pricer.cluster.node_gpus[0])
    return pricer._activation_bytes(layer, split, layout, 1.0, option)


# Megatron's 16-bit formula for flash attention (no 5as/h term) and no dropout (our GPT has none);
# the profile also holds LayerNorm statistics and the attention log-sum-exp (fp32, ~0.4% here).
@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (4, False), (2, True), (4, True)])
def test_block_activation_matches_megatron_formula(gpt_profile, tp, sp):
    pricer = pricer_for(gpt_profile, gpus=tp, batch=B)
    layout = ParallelLayout(tp=tp, sequence_parallel=sp, micro_batch_size=B)
    expected = megatron_layer_activation_bytes(S, B, H, A, t=tp, sequence_parallel=sp, flash=True, dropout=False)
    assert block_activation(pricer, layout) == pytest.approx(expected, rel=0.02)


def test_full_recompute_keeps_only_the_layer_input(gpt_profile):
    pricer = pricer_for(gpt_profile, gpus=1, batch=B)
    kept = block_activation(pricer, ParallelLayout(micro_batch_size=B), "full")
    assert kept == 2 * S * B * H  # Korthikanti et al.: 2sbh per layer with full recomputation


def test_estimate_reports_consistent_numbers(gpt_profile):
    pricer = pricer_for(gpt_profile, gpus=8, batch=16)
    estimate = pricer.estimate(ParallelLayout(dp=2, tp=2, pp=2, micro_batch_size=2, num_micro_batches=4))
    assert estimate.fits
    assert estimate.samples_per_s == pytest.approx(16 / estimate.step_time_s)
    assert estimate.tokens_per_s == pytest.approx(estimate.samples_per_s * S)
    assert 0 < estimate.mfu <= estimate.hfu <= 1
    assert sum(estimate.time_breakdown.values()) == pytest.approx(estimate.step_time_s, rel=0.02)
    assert set(estimate.memory_breakdown) >= {"params", "grads", "optimizer", "activations", "buffers"}
    assert [len(stage) for stage in estimate.stages] == [4, 4]


def test_zero_stages_reduce_memory_in_order(gpt_profile):
    pricer = pricer_for(gpt_profile, gpus=8, batch=16)
    peaks = [pricer.estimate(ParallelLayout(dp=8, zero_stage=z, micro_batch_size=2)).memory_breakdown
             for z in range(4)]
    states = [p["params"] + p["grads"] + p["optimizer"] for p in peaks]
    assert states[0] > states[1] > states[2] > states[3]


def test_bad_layouts_fail_clearly(gpt_profile):
    pricer = pricer_for(gpt_profile, gpus=8, batch=16)
    with pytest.raises(ValueError, match="cluster has 8 GPUs"):
        pricer.estimate(ParallelLayout(dp=4, micro_batch_size=4))
    with pytest.raises(ValueError, match="global batch 16"):
        pricer.estimate(ParallelLayout(dp=8, micro_batch_size=4))


def test_mixed_cluster_slower_stage_has_speed_factor(examples_dir):
    """At this size the A100 stage runs GEMMs ~2-3x slower than the H100 stage
    (312·0.87 vs 989·0.80 TFLOP/s), memory-bound ops 1.6x (2.0 vs 3.35 TB/s), launches alike."""
    gpt_profile = profile_model(load_model_file(examples_dir / "gpt.py"),
                                {"layers": 2, "hidden": 1024, "heads": 8, "seq_len": 1024, "vocab": 512}, 2, "bf16")
    cluster = ClusterSpec.from_config(ClusterConfig(
        name="mixed", gpus_per_node=2, node_groups=[NodeGroupConfig("H100-SXM", 1), NodeGroupConfig("A100-80GB", 1)]))
    pricer = PlanPricer(gpt_profile, cluster, TrainSpec(global_batch_size=8), ILPSplitter(gpt_profile))
    problem = pricer.partition_problem(ParallelLayout(tp=2, pp=2, micro_batch_size=2, num_micro_batches=4))
    assert problem.speed[0] == 1.0 and 1.3 < problem.speed[1] < 3.0  # A100 stage slower than the H100 one
    # A TP group may not span both GPU types.
    assert pricer.partition_problem(ParallelLayout(tp=2, pp=2, micro_batch_size=2, num_micro_batches=4,
                                                   mesh_order=("pp", "tp", "cp", "dp"))) is None

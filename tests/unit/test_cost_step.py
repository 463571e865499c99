"""estimate(): a training step assembled from the parts, checked by hand where the arithmetic is
small and by invariants (the breakdown adds up, ZeRO shrinks states, recomputation trades memory
for time) where it is not."""
from __future__ import annotations

import dataclasses
import json
import time

import pytest

from cost_models import step as step_module
from cost_models.collectives import Collective, collective_time_s
from cost_models.compute import ComputeModel
from cost_models.memory import trained_model_states
from cost_models.step import (CUDA_CONTEXT_BYTES, OPTIMIZER_BYTES_PER_PARAM, ParallelLayout, PlanPricer, TrainSpec,
                               estimate)
from cost_models.topology import ClusterConfig, ClusterSpec, NodeGroupConfig
from tests.profiles import B, S, gpt, planner_splitter, traced

GPT_LAYERS = 8  # wte, wpe, 4 blocks, ln_f, lm_head


def spec(gpu="A100-80GB", nodes=1, per_node=8, **kw) -> ClusterSpec:
    return ClusterSpec.from_config(ClusterConfig(name="t", gpu=gpu, nodes=nodes, gpus_per_node=per_node, **kw))


def test_single_device_step_by_hand():
    """No parallelism: m x (every layer's forward + backward roofline and launches) + one
    optimizer pass over every parameter (28 bytes each at the element-wise bandwidth)."""
    profile, cluster = gpt(), spec("cpu", per_node=1)
    gpu = cluster.node_gpus[0]
    m = 3
    est = estimate(profile, cluster, ParallelLayout(micro_batch_size=B, num_micro_batches=m),
                   TrainSpec(global_batch_size=m * B))
    compute = ComputeModel(profile)
    per_micro_batch = sum(compute.layer(layer.name, gpu).time_s(1.0, gpu.launch_overhead_s) for layer in profile.layers)
    update = profile.param_count * OPTIMIZER_BYTES_PER_PARAM["adam"] / (
        gpu.memory_bandwidth_Bps * gpu.efficiency["elementwise"])
    assert est.step_time_s == pytest.approx(m * per_micro_batch + update, rel=1e-4)  # µs rounding of the ILP units
    assert est.time_breakdown["compute"] == pytest.approx(m * per_micro_batch, rel=1e-4)
    assert est.time_breakdown["bubble"] == pytest.approx(0.0, abs=1e-5)
    assert est.dp_sync_algorithm == "none"


def test_reported_numbers_are_consistent():
    profile = gpt()
    est = estimate(profile, spec(), ParallelLayout(dp=2, tp=2, pp=2, micro_batch_size=2, num_micro_batches=4),
                   TrainSpec(global_batch_size=16), planner_splitter(profile))
    assert est.fits
    assert est.samples_per_s == pytest.approx(16 / est.step_time_s)
    assert est.tokens_per_s == pytest.approx(est.samples_per_s * S)
    assert est.tflops_per_gpu * 1e12 * 8 * est.step_time_s == pytest.approx(profile.flops_total * 16 / B)
    assert 0 < est.mfu <= est.hfu <= 1 and est.mfu == pytest.approx(est.tflops_per_gpu * 1e12 / 312e12)
    assert sum(est.time_breakdown.values()) == pytest.approx(est.step_time_s, rel=1e-6)
    assert set(est.time_breakdown) == {"compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "pp_comm", "dp_comm",
                                       "bubble", "optimizer"}
    assert est.time_breakdown["tp_comm"] > 0 and est.time_breakdown["dp_comm"] > 0
    assert set(est.memory_breakdown) >= {"params", "grads", "optimizer", "activations", "buffers", "headroom"}
    assert est.peak_memory_bytes == max(est.device_memory_bytes)
    assert [len(stage) for stage in est.stages] == [4, 4]
    assert [d["layers"] for d in est.stage_details] == est.stages
    data = json.loads(json.dumps(est.to_dict()))
    assert data["step_time_s"] == est.step_time_s and data["stage_details"][1]["pp_rank"] == 1


def test_model_states_per_rank_follow_zero():
    """dp = 8, one stage: each rank's states are the generated code's (FSDP2) accounting of the
    whole model; the gathered bf16 copy of ZeRO-0..2 is reported with the buffers."""
    profile = gpt()
    for zero in range(4):
        est = estimate(profile, spec(), ParallelLayout(dp=8, zero_stage=zero, micro_batch_size=2, dp_sync="ring"),
                       TrainSpec(global_batch_size=16))
        states = trained_model_states(profile.param_count, "bf16", "adam", zero, 8)
        got = est.memory_breakdown
        assert got["params"] == pytest.approx(states.params_bytes, abs=8)  # per-layer int rounding
        assert got["grads"] == pytest.approx(states.grads_bytes, abs=8)
        assert got["optimizer"] == pytest.approx(states.optimizer_bytes, abs=8)
        assert got["buffers"] >= states.compute_copy_bytes + CUDA_CONTEXT_BYTES


def test_pipeline_first_stage_holds_p_micro_batches():
    """1F1B, p = 2: rank 0 keeps 2 micro-batches of its layers' saved activations, rank 1 one."""
    profile = gpt()
    est = estimate(profile, spec(per_node=2), ParallelLayout(pp=2, micro_batch_size=B, num_micro_batches=4),
                   TrainSpec(global_batch_size=4 * B))
    first = sum(profile.layer(name).activation_bytes for name in est.stages[0])
    assert est.memory_breakdown["activations"] == pytest.approx(2 * first, abs=GPT_LAYERS)
    assert est.device_memory_bytes[0] > est.device_memory_bytes[1]
    gpipe = estimate(profile, spec(per_node=2), ParallelLayout(pp=2, micro_batch_size=B, num_micro_batches=4,
                                                               schedule="gpipe"), TrainSpec(global_batch_size=4 * B))
    second = sum(profile.layer(name).activation_bytes for name in est.stages[1])  # has the logits: the peak now
    assert gpipe.memory_breakdown["activations"] == pytest.approx(4 * max(first, second), abs=GPT_LAYERS)


def test_gradient_sync_hides_behind_backward_until_the_network_is_slow():
    profile = gpt()
    layout = ParallelLayout(dp=2, micro_batch_size=2, num_micro_batches=4)
    train = TrainSpec(global_batch_size=16)
    fast = estimate(profile, spec(nodes=2, per_node=1, inter_node_bandwidth_GBps=400), layout, train)
    slow = estimate(profile, spec(nodes=2, per_node=1, inter_node_bandwidth_GBps=0.05), layout, train)
    # Gradients reduced in fp32 (as the generated module reduces them under bf16): 4 bytes per
    # parameter over 2 ranks by ring, 2(n-1)/n·M = M bytes on the wire.
    wire_s = 4 * profile.param_count / (0.05e9 * 0.96)
    assert slow.time_breakdown["dp_comm"] == pytest.approx(wire_s, rel=0.15)  # minus the backward it overlaps
    # An engine reducing the 16-bit gradients as computed moves half.
    halved = estimate(profile, spec(nodes=2, per_node=1, inter_node_bandwidth_GBps=0.05), layout,
                      TrainSpec(global_batch_size=16, grad_reduce_dtype="compute"))
    assert halved.time_breakdown["dp_comm"] == pytest.approx(wire_s / 2, rel=0.15)
    assert fast.time_breakdown["dp_comm"] < 0.02 * slow.time_breakdown["dp_comm"]
    pinned = estimate(profile, spec(nodes=8, per_node=1, inter_node_bandwidth_GBps=1),
                      ParallelLayout(dp=8, micro_batch_size=2, num_micro_batches=1, dp_sync="ps"), train)
    ring = estimate(profile, spec(nodes=8, per_node=1, inter_node_bandwidth_GBps=1),
                    ParallelLayout(dp=8, micro_batch_size=2, num_micro_batches=1, dp_sync="ring"), train)
    assert pinned.dp_sync_algorithm == "ps" and ring.dp_sync_algorithm == "ring"
    assert pinned.time_breakdown["dp_comm"] > 3 * ring.time_breakdown["dp_comm"]


def test_zero1_gathers_the_optimizers_fp32_shards_back():
    """The generated ZeRO-1 optimizer updates fp32 shards and all-gathers them, exposed, after the
    gradients' all-reduce: over 2 ranks (n-1)/n of 4 bytes per parameter on the wire."""
    profile = gpt()
    train = TrainSpec(global_batch_size=16)
    slow = spec(nodes=2, per_node=1, inter_node_bandwidth_GBps=0.05)
    zero = {stage: estimate(profile, slow, ParallelLayout(dp=2, micro_batch_size=2, num_micro_batches=4,
                                                          zero_stage=stage), train)
            for stage in (0, 1)}
    gather_s = 2 * profile.param_count / (0.05e9 * 0.96)
    assert zero[1].time_breakdown["dp_comm"] - zero[0].time_breakdown["dp_comm"] == pytest.approx(gather_s, rel=0.15)


def test_halving_doubling_runs_after_backward_so_nothing_hides_it():
    """At 2 ranks halving-doubling moves what a ring moves (2(n-1)/n of the gradients each way, 2
    latencies), but the generated exchange (gradient_sync.py) runs after backward, not under it."""
    profile, train = gpt(), TrainSpec(global_batch_size=16)
    fast = spec(nodes=2, per_node=1, inter_node_bandwidth_GBps=400)
    layout = ParallelLayout(dp=2, micro_batch_size=2, num_micro_batches=4)
    ring = estimate(profile, fast, dataclasses.replace(layout, dp_sync="ring"), train)
    halving = estimate(profile, fast, dataclasses.replace(layout, dp_sync="halving_doubling"), train)
    assert halving.dp_sync_algorithm == "halving_doubling"
    assert halving.time_breakdown["dp_comm"] > 3 * ring.time_breakdown["dp_comm"]  # ring: mostly under backward


def test_recomputation_trades_memory_for_time():
    profile = gpt()
    runs = {option: estimate(profile, spec(per_node=1), ParallelLayout(micro_batch_size=2, recompute=option),
                             TrainSpec(global_batch_size=2)) for option in ("none", "selective", "full")}
    acts = {k: v.memory_breakdown["activations"] for k, v in runs.items()}
    assert acts["none"] > acts["selective"] > acts["full"]
    # Full keeps each layer's input (or what it saves, if less: the positional embedding's
    # indices), and what the loss saves outside the model's modules (no wrapper reruns it).
    outside = {layer.name: sum(op.saved_for_backward_bytes for op in profile.ops
                               if op.phase == "forward" and op.layer == layer.name and op.module is None)
               for layer in profile.layers}
    assert sum(outside.values()) > 0
    assert acts["full"] == pytest.approx(sum(min(layer.input_bytes + outside[layer.name], layer.activation_bytes)
                                             for layer in profile.layers), abs=GPT_LAYERS)
    assert runs["none"].step_time_s < runs["selective"].step_time_s < runs["full"].step_time_s
    assert runs["full"].hfu > runs["full"].mfu and runs["none"].hfu == runs["none"].mfu
    # Full recomputation runs every forward again.
    assert runs["full"].time_breakdown["recompute"] == pytest.approx(
        runs["full"].time_breakdown["compute"] * 0.3, rel=0.25)
    per_layer = estimate(profile, spec(per_node=1), ParallelLayout(micro_batch_size=2, recompute={"blocks.0": "full"}),
                         TrainSpec(global_batch_size=2))
    assert per_layer.recompute.count("full") == 1


def test_sequence_and_context_parallelism_split_activations():
    profile = gpt()
    train = TrainSpec(global_batch_size=2)
    pricer = PlanPricer(profile, spec(per_node=4), train, planner_splitter(profile))
    without, under = ParallelLayout(tp=4, micro_batch_size=2), ParallelLayout(tp=4, sequence_parallel=True,
                                                                              micro_batch_size=2)
    tp, sp = pricer.estimate(without), pricer.estimate(under)
    # A block keeps sbh(8 + 24/t) without SP and sbh(4 + 30/t) with torch's SP (the all-gathered
    # GEMM inputs stay whole, see cost_models/memory.py): 11.5/14 at t = 4.
    assert sp.memory_breakdown["activations"] < 0.85 * tp.memory_breakdown["activations"]
    # TP communication is every layer's collectives as its styles issue them (under SP each
    # block's all-reduce becomes a reduce-scatter and an all-gather, counted by hand in
    # test_plan_vocabulary.py); SP adds the gather of the gradient where the first block slices
    # the stream (cost_models/tp_layout.py).
    group = spec(per_node=4).group_links([0, 1, 2, 3])

    def issued_s(layout: ParallelLayout) -> float:
        splits = [pricer.split(layer.name, layout, pricer.cluster.node_gpus[0]) for layer in profile.layers]
        return sum(collective_time_s(Collective(kind), nbytes, group) for split in splits
                   for kind, nbytes in split.collectives(layout.sequence_parallel)[0])

    entry = collective_time_s(Collective.ALL_GATHER, profile.layer("blocks.0").input_bytes, group)
    assert tp.time_breakdown["tp_comm"] == pytest.approx(issued_s(without))
    assert sp.time_breakdown["tp_comm"] == pytest.approx(issued_s(under) + entry)
    # Ulysses keeps a quarter of every activation at cp = 4; the generated ring attention keeps
    # that and its fp32 queries, K/V blocks and merged outputs beyond what the profile's attention
    # kept (memory.ring_attention_extra_bytes, counted on a run by test_ring_attention_memory.py).
    ring_layout = ParallelLayout(cp=4, micro_batch_size=2, cp_strategy="ring", zero_stage=2)
    ulysses = estimate(profile, spec(per_node=4), dataclasses.replace(ring_layout, cp_strategy="ulysses"), train)
    cp = estimate(profile, spec(per_node=4), ring_layout, train)
    alone = estimate(profile, spec(per_node=1), ParallelLayout(micro_batch_size=2), train)
    assert ulysses.memory_breakdown["activations"] == pytest.approx(alone.memory_breakdown["activations"] / 4,
                                                                    abs=GPT_LAYERS)
    ring_pricer = PlanPricer(profile, spec(per_node=4), train)
    scale = 2 / profile.micro_batch_size
    extra = sum(int(ring_pricer.layer_prices.ring_kept_bytes(layer, ring_layout, scale)) for layer in profile.layers)
    assert extra > 0
    assert cp.memory_breakdown["activations"] == pytest.approx(ulysses.memory_breakdown["activations"] + extra,
                                                               abs=GPT_LAYERS)
    assert cp.time_breakdown["cp_comm"] > 0 and cp.dp_sync_algorithm != "none"  # CP ranks sum gradients


def test_bad_layouts_fail_clearly():
    profile, cluster, train = gpt(), spec(), TrainSpec(global_batch_size=16)
    cases = [
        (ParallelLayout(dp=4, micro_batch_size=4), "cluster has 8 GPUs"),
        (ParallelLayout(dp=8, micro_batch_size=4), "global batch 16"),
        (ParallelLayout(dp=4, pp=2, micro_batch_size=2, num_micro_batches=2, chunks=2), "needs schedule=interleaved"),
        (ParallelLayout(dp=4, pp=2, micro_batch_size=4, schedule="zigzag"), "unknown schedule"),
        (ParallelLayout(dp=8, micro_batch_size=2, recompute="some"), "recompute 'some'"),
        (ParallelLayout(dp=8, micro_batch_size=2, mesh_order=("tp", "dp")), "mesh_order"),
        (ParallelLayout(dp=8, micro_batch_size=2, hybrid_shard=True), "hybrid_shard needs zero_stage"),
        (ParallelLayout(dp=4, pp=2, micro_batch_size=4, stages=(("wte",), ("wpe",))), "every layer exactly once"),
        (ParallelLayout(cp=8, micro_batch_size=16, cp_strategy="ulysses", zero_stage=2), "Ulysses needs"),  # 4 heads
        (ParallelLayout(dp=8, micro_batch_size=2, dp_sync="gossip"), "unknown dp_sync"),
        # The generated code shards CP gradients with FSDP: ZeRO-0/1 has no runtime under CP.
        (ParallelLayout(cp=8, micro_batch_size=16, cp_strategy="ring"), "needs ZeRO-2 or 3"),
        (ParallelLayout(dp=8, micro_batch_size=2, dp_sync="ps", zero_stage=1), "dp_sync=ps needs ZeRO 0"),
    ]
    for layout, message in cases:
        with pytest.raises(ValueError, match=message):
            estimate(profile, cluster, layout, train)
    with pytest.raises(ValueError, match="256 is not divisible into 6 chunks for cp=3"):  # ring: 2·cp chunks
        estimate(profile, spec(per_node=3), ParallelLayout(cp=3, micro_batch_size=16, cp_strategy="ring", zero_stage=2),
                 train)
    with pytest.raises(ValueError, match="traced in bf16 but training is fp32"):
        estimate(profile, cluster, ParallelLayout(dp=8, micro_batch_size=2), TrainSpec(16, precision="fp32"))


def test_explicit_stages_are_priced_as_given():
    profile = gpt()
    names = [layer.name for layer in profile.layers]
    uneven = (tuple(names[:2]), tuple(names[2:]))
    est = estimate(profile, spec(per_node=2), ParallelLayout(pp=2, micro_batch_size=2, num_micro_batches=4,
                                                             stages=uneven), TrainSpec(global_batch_size=8))
    assert est.stages == [list(stage) for stage in uneven]
    assert est.device_time_s[1] > 3 * est.device_time_s[0]


def test_mixed_cluster_paces_by_the_slower_gpus():
    """H100 node then A100 node, pp = 2: the A100 stage is slower; TP may not mix the two."""
    profile = gpt()
    cluster = ClusterSpec.from_config(ClusterConfig(
        name="mixed", gpus_per_node=2, node_groups=[NodeGroupConfig("H100-SXM", 1), NodeGroupConfig("A100-80GB", 1)]))
    est = estimate(profile, cluster, ParallelLayout(tp=2, pp=2, micro_batch_size=2, num_micro_batches=4),
                   TrainSpec(global_batch_size=8), planner_splitter(profile))
    assert est.stage_details[0]["gpu"] == ["H100-SXM"] and est.stage_details[1]["gpu"] == ["A100-80GB"]
    assert 1.0 < est.stage_details[1]["speed"] < 3.3  # 989·0.80 / (312·0.87) at most, launches alike
    with pytest.raises(ValueError, match="mix GPU types"):
        estimate(profile, cluster, ParallelLayout(tp=2, pp=2, micro_batch_size=2, num_micro_batches=4,
                                                  mesh_order=("pp", "tp", "cp", "dp")), TrainSpec(global_batch_size=8),
                 planner_splitter(profile))


def test_per_layer_prices_are_reused_across_calls():
    profile, cluster, train = gpt(), spec(), TrainSpec(global_batch_size=16)
    layouts = [ParallelLayout(dp=8, zero_stage=z, micro_batch_size=2, recompute=r)
               for z in (0, 1, 2, 3) for r in ("none", "full")]
    estimate(profile, cluster, layouts[0], train)
    pricer = next(p for p in step_module._PRICERS.values() if p.profile is profile and p.cluster is cluster)
    start = time.perf_counter()
    for layout in layouts:
        estimate(profile, cluster, layout, train)
    assert (time.perf_counter() - start) / len(layouts) < 0.05
    assert next(p for p in step_module._PRICERS.values() if p.profile is profile and p.cluster is cluster) is pricer


def test_models_without_a_sequence_report_samples_only():
    profile = traced("mlp.py", "fp32", 4, width=64, layers=3)
    est = estimate(profile, spec("cpu", per_node=2), ParallelLayout(dp=2, micro_batch_size=4),
                   TrainSpec(global_batch_size=8, precision="fp32"))
    assert est.tokens_per_s is None and est.samples_per_s == pytest.approx(8 / est.step_time_s)


def test_profiles_saved_without_ops_price_from_class_totals():
    """A profile stored with include_ops=False still prices tp = 1 plans (a roofline per op class
    of each layer instead of per op: close, and never slower, since summed work hides neither
    per-op rooflines nor GEMM shapes), not tp > 1."""
    profile = gpt()
    bare = dataclasses.replace(profile, ops=[])
    layout, train = ParallelLayout(dp=8, micro_batch_size=2), TrainSpec(global_batch_size=16)
    full, coarse = estimate(profile, spec(), layout, train), estimate(bare, spec(), layout, train)
    assert 0.85 * full.step_time_s <= coarse.step_time_s <= full.step_time_s
    assert coarse.memory_breakdown["activations"] == full.memory_breakdown["activations"]
    with pytest.raises(ValueError, match="per-op detail"):
        estimate(bare, spec(), ParallelLayout(dp=4, tp=2, micro_batch_size=4), train)


def test_zero2_gathers_parameters_every_micro_batch():
    """FSDP without resharding after forward still reshards after backward, so ZeRO-2 gathers
    every layer's parameters at each micro-batch's forward (profiled: 6 all-gathers per micro-batch
    for a dp2 GPT). On a network so slow that nothing hides, two more micro-batches add two more
    gathers and reduce-scatters of every layer's gradients' worth of bytes, by hand."""
    from cost_models.step import PlanPricer

    profile = gpt()
    cluster = spec("cpu", per_node=2, intra_node_latency_us=1e4, intra_node_bandwidth_GBps=1e-3)
    pricer = PlanPricer(profile, cluster, TrainSpec(global_batch_size=8, precision=profile.precision))
    two, four = (pricer.estimate(ParallelLayout(dp=2, micro_batch_size=4 // m, num_micro_batches=m, zero_stage=2))
                 for m in (2, 4))
    layout = ParallelLayout(dp=2, micro_batch_size=1, num_micro_batches=4, zero_stage=2)
    group = pricer.groups.placement(layout, ("dp", "cp"))
    prices = pricer.layer_prices
    by_hand = sum(collective_time_s(Collective.ALL_GATHER, layer.param_count * prices.weights_bytes, group)
                  + collective_time_s(Collective.REDUCE_SCATTER, layer.param_count * prices.grads_bytes, group)
                  for layer in profile.layers if layer.param_count)
    assert four.time_breakdown["dp_comm"] - two.time_breakdown["dp_comm"] == pytest.approx(2 * by_hand, rel=0.02)


def test_the_peak_moment_is_reported_whole():
    """The breakdown adds up to the peak rank's memory at its peak moment: in backward for the
    test GPT at micro-batch 2 (ZeRO-3 on 8 ranks), at the optimizer step for a 16-block GPT over
    32 tokens under ZeRO-1, where the step's all-gathered fp32 vector and slices (5 bytes a
    parameter on 8 ranks) outweigh the activations; activations are gone then."""
    from cost_models.memory import optimizer_step_bytes

    deep = traced("gpt.py", "bf16", 2, layers=16, hidden=512, heads=8, seq_len=32, vocab=1024)
    parts = ("params", "grads", "optimizer", "activations", "buffers", "optimizer_step")
    for profile, zero, at_step in ((gpt(), 3, False), (deep, 1, True)):
        est = estimate(profile, spec(), ParallelLayout(dp=8, zero_stage=zero, micro_batch_size=2),
                       TrainSpec(global_batch_size=16))
        got = est.memory_breakdown
        assert sum(got.get(part, 0) for part in parts) == pytest.approx(est.peak_memory_bytes, abs=4 * GPT_LAYERS * 2)
        assert ("optimizer_step" in got) == at_step
        if at_step:
            assert got["activations"] == 0 and got["buffers"] == CUDA_CONTEXT_BYTES
            assert got["optimizer_step"] == pytest.approx(optimizer_step_bytes(profile.param_count, "adam", 1, 8),
                                                          abs=4 * len(profile.layers))

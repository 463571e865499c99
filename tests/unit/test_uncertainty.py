"""Prediction intervals and the pessimistic price of what the cost model extrapolates
(cost_models.uncertainty), against hand counts."""
from __future__ import annotations

import math

import pytest

from cost_models.collectives import Algorithm, Collective, Protocol, collective_time_s
from cost_models.topology import NCCL_NET_STEP_OVERHEAD_S, ClusterConfig, ClusterSpec
from cost_models.uncertainty import (NETWORK_FALL_PER_DOUBLING, RESIDUAL_HIGH, RESIDUAL_LOW, UNCALIBRATED_GPU_SLOWDOWN,
                                     PredictionInterval,
                                     extrapolations, pessimistic_cluster)


def cluster(gpu: str = "A100-80GB", nodes: int = 192, network: str = "infiniband") -> ClusterSpec:
    return ClusterSpec.from_config(ClusterConfig(name="t", gpu=gpu, nodes=nodes, gpus_per_node=8,
                                                 inter_node_bandwidth_GBps=25, network=network))


def test_groups_beyond_the_measured_nodes_are_extrapolated():
    """192 nodes of InfiniBand, 48 measured: two doublings beyond, bandwidth / 1.8^2 pessimistically;
    within 48 nodes nothing is extrapolated; an uncalibrated GPU slows compute by
    UNCALIBRATED_GPU_SLOWDOWN (26% today: cost_models/calibration.json)."""
    spec = cluster()
    wide = extrapolations(spec, 192)
    assert wide.network_factor == pytest.approx(NETWORK_FALL_PER_DOUBLING ** 2)
    assert wide.compute_factor == 1.0 and "192 nodes of infiniband" in wide.reasons[0]
    assert not extrapolations(spec, 48).any
    l40s = extrapolations(cluster("L40S", 4), 4)
    assert l40s.compute_factor == 1 + UNCALIBRATED_GPU_SLOWDOWN and l40s.network_factor == 1.0 \
        and "L40S" in l40s.reasons[0]
    assert extrapolations(cluster(network="roce", nodes=2), 2).network_factor == pytest.approx(1.8)  # none measured


def test_pessimistic_price_slows_only_the_extrapolated_groups():
    """Hand count: a ring all-gather over all 1536 ranks (192 nodes) loses 1.8^log2(192/48) of its
    bandwidth (its 191 steps across a node pay the network's latency, the 1344 others the
    NVLink's, at least three network post overheads at Simple); one over 32 nodes and a
    point-to-point send keep their nominal price."""
    spec = cluster()
    slow = pessimistic_cluster(spec, extrapolations(spec, 192))
    s = 1e9
    everyone = list(range(spec.world_size))
    nominal = spec.group_links(everyone).ring_link.bandwidth_Bps
    n = spec.world_size
    intra_step = max(spec.intra.latency_s, 3 * NCCL_NET_STEP_OVERHEAD_S)
    expected = (191 * spec.inter.latency_s + (n - 1 - 191) * intra_step
                + (n - 1) / n * s / (nominal / NETWORK_FALL_PER_DOUBLING ** math.log2(4)))
    simple = (Algorithm.RING, Protocol.SIMPLE)  # the hand count is Simple's
    assert collective_time_s(Collective.ALL_GATHER, s, slow.group_links(everyone), *simple) == pytest.approx(expected)
    within = list(range(0, 256))
    assert collective_time_s(Collective.ALL_GATHER, s, slow.group_links(within)) == \
        pytest.approx(collective_time_s(Collective.ALL_GATHER, s, spec.group_links(within)))
    pair = [0, 8 * 100]
    assert collective_time_s(Collective.SEND_RECV, s, slow.group_links(pair)) == \
        pytest.approx(collective_time_s(Collective.SEND_RECV, s, spec.group_links(pair)))


def test_interval_from_the_calibration_residuals():
    interval = PredictionInterval(10.0, 15.0, ("x",))
    assert interval.low_s == pytest.approx(10.0 / (1 + RESIDUAL_HIGH))
    assert interval.high_s == pytest.approx(15.0 / (1 + RESIDUAL_LOW))
    assert interval.extrapolated_share == pytest.approx(0.5)
    assert interval.overlaps(PredictionInterval(12.0, 12.0)) and not interval.overlaps(PredictionInterval(30.0, 30.0))


def test_each_network_names_what_it_measured():
    """The widest measured group comes from the network preset: a fabric with no published
    node-count measurement (RoCE) is extrapolated from two nodes on, with 1.8x per doubling."""
    roce = extrapolations(cluster(network="roce", nodes=8), 8)
    assert roce.measured_nodes == 0 and roce.network_factor == pytest.approx(NETWORK_FALL_PER_DOUBLING ** 3)
    assert "none measured" in roce.reasons[0]
    efa = cluster(network="efa", nodes=128)
    assert extrapolations(efa, 128).network_factor == pytest.approx(NETWORK_FALL_PER_DOUBLING)
    assert not extrapolations(efa, 64).any


def test_all_to_all_across_nodes_is_extrapolated_from_two_nodes_on():
    """No all-to-all is published: across 4 nodes of InfiniBand (48 measured for the other
    collectives) it is extrapolated, 1.8^log2(4) pessimistically, while an all-gather over the same
    4 nodes keeps its price."""
    spec = cluster(nodes=4)
    extrapolation = extrapolations(spec, widest_nodes=4, all_to_all_nodes=4)
    assert extrapolation.network_factor == pytest.approx(NETWORK_FALL_PER_DOUBLING ** 2)
    assert "all-to-all over 4 nodes" in extrapolation.reasons[0]
    assert not extrapolations(spec, 4, all_to_all_nodes=1).any
    slow = pessimistic_cluster(spec, extrapolation)
    everyone = list(range(32))
    s = 1e9  # 31 MB a peer: Simple
    nominal, pessimistic = (collective_time_s(Collective.ALL_TO_ALL, s, c.group_links(everyone)) for c in (spec, slow))
    n, g, nic = 32, 8, spec.inter.bandwidth_Bps
    assert nominal == pytest.approx(31 * spec.inter.latency_s + (n - g) / n * s / nic)
    assert pessimistic == pytest.approx(31 * spec.inter.latency_s + (n - g) / n * s / (nic / 1.8 ** 2))
    assert collective_time_s(Collective.ALL_GATHER, s, slow.group_links(everyone)) == \
        pytest.approx(collective_time_s(Collective.ALL_GATHER, s, spec.group_links(everyone)))


def test_presets_say_whether_their_node_count_fall_is_measured():
    """InfiniBand and RoCE have one large-message point each, no node-count curve: their
    description says so and names what they are fitted to; EFA's fall is measured (D10)."""
    from cost_models.topology import NETWORKS

    for name in ("infiniband", "roce", "efa_v4"):
        network = NETWORKS[name]
        assert not network.fall_measured and network.ring_fall == network.tree_fall == 0.0
        assert "NOT measured" in network.describe() and network.curve in network.describe()
    assert NETWORKS["efa"].fall_measured and "NOT" not in NETWORKS["efa"].describe()


def test_ring_attention_is_extrapolated_until_a_calibration_run_uses_it():
    """No calibration run uses context parallelism: a ring-attention plan's exchange (hidden behind
    attention in its nominal price) is priced exposed at its pessimistic value; Ulysses' all-to-alls
    are on the critical path in both, and CPU ranks have nothing calibrated to extrapolate from."""
    from types import SimpleNamespace

    from cost_models.uncertainty import RING_ATTENTION, techniques_of

    assert techniques_of(SimpleNamespace(cp=4, cp_strategy="ring")) == {RING_ATTENTION}
    assert techniques_of(SimpleNamespace(cp=4, cp_strategy="ulysses")) == frozenset()
    assert techniques_of(SimpleNamespace(tp=8, pp=4)) == frozenset()
    spec = cluster(gpu="H100-SXM", nodes=8)
    ring = extrapolations(spec, 1, techniques=frozenset({RING_ATTENTION}))
    assert ring.exposed == (RING_ATTENTION,) and ring.network_factor == 1.0
    assert any("ring attention" in reason for reason in ring.reasons)
    assert pessimistic_cluster(spec, ring).exposed_overlap == (RING_ATTENTION,)
    cpu = ClusterSpec.from_config(ClusterConfig(name="c", gpu="cpu", nodes=1, gpus_per_node=4))
    assert not extrapolations(cpu, 1, techniques=frozenset({RING_ATTENTION})).any


def test_the_pessimistic_price_of_ring_attention_is_its_whole_exchange(examples_dir):
    """Hand count on a 2-layer Llama at 32k tokens, cp=4 ring on one H100 node: nominally the K/V
    exchange hides behind attention (cp_comm is what does not fit plus the interference share);
    pessimistically cp_comm is every step's exchange: passes x (cp - 1) sends of a rank's K/V
    block per layer (fp32, K and V at the queries' heads, as the generated ring passes it)."""
    from autopar.model_file import load_model_file
    from autopar.profile import profile_model
    from cost_models.issued import cp_passes
    from autopar.domain.layout import ParallelLayout
    from cost_models.step import PlanPricer, TrainSpec
    from cost_models.uncertainty import RING_ATTENTION, Extrapolation

    kwargs = dict(layers=2, hidden=1024, heads=8, kv_heads=8, ffn=3584, vocab=32000, seq_len=32768)
    profile = profile_model(load_model_file(examples_dir / "llama_hf.py"), kwargs, 1, "bf16")
    spec = cluster(gpu="H100-SXM", nodes=1)
    layout = ParallelLayout(cp=4, cp_strategy="ring", zero_stage=2, dp=2, num_micro_batches=1)
    train = TrainSpec(global_batch_size=2)
    nominal = PlanPricer(profile, spec, train)
    exposed = PlanPricer(profile, pessimistic_cluster(spec, Extrapolation(reasons=("x",), exposed=(RING_ATTENTION,))),
                         train)
    blocks = [layer for layer in profile.layers if layer.is_block]
    group = nominal.groups.placement(layout, "cp")
    per_block = []
    for layer in blocks:
        q, _ = nominal.structure.attention_bytes[nominal.compute.kind(layer.name)]
        passes = cp_passes("ring", "none") * 3
        block = 2 * (q / 4) * 4 / 2  # K and V at the queries' heads, in fp32 (the profile's are bf16)
        per_block.append(passes * nominal.groups.collective_s(Collective.SEND_RECV, block, group))
    hidden = nominal.estimate(layout).time_breakdown["cp_comm"]
    whole = exposed.estimate(layout).time_breakdown["cp_comm"]
    assert whole == pytest.approx(sum(per_block), rel=1e-6)
    assert hidden < 0.5 * whole


def test_student_t_quantiles_match_the_printed_table():
    """Student's t at 0.90 and 0.95 from a printed table: 1 dof 3.078, 2 dof 1.886, 10 dof 1.372,
    27 dof 1.314, 27 dof at 0.95 1.703; a large dof tends to the normal's 1.2816."""
    from cost_models.uncertainty import student_t_quantile

    for q, dof, printed in ((0.9, 1, 3.078), (0.9, 2, 1.886), (0.9, 10, 1.372), (0.9, 27, 1.314), (0.95, 27, 1.703),
                            (0.9, 100000, 1.2816)):
        assert student_t_quantile(q, dof) == pytest.approx(printed, abs=6e-4)
    with pytest.raises(ValueError):
        student_t_quantile(0.3, 4)


def test_a_scale_trend_against_a_hand_fit():
    """Sizes 2, 4, 8, 16 (x = 1..4), residuals 0, 0.1, 0.1, 0.3: Sxx = 5, Sxy = 0.45, slope 0.09,
    intercept 0.125 - 0.09 * 2.5 = -0.1; fitted -0.01, 0.08, 0.17, 0.26, residuals about the line
    0.01, 0.02, -0.07, 0.04, SSE 0.007, spread sqrt(0.007 / 2); t(0.9, 2 dof) = 1.8856. At 16 the
    band is 0.26 ± t s sqrt(1 + 1/4 + 2.25/5); at 64 (x = 6) 0.44 ± t s sqrt(1 + 1/4 + 12.25/5). The
    interval widens at 64 by the band's move from 16: its high side by the upper bound's rise, its
    low side not at all (the lower bound rose too); at 16 or below, by nothing."""
    from cost_models.uncertainty import ScaleTrend

    trend = ScaleTrend.fit("gpus", [2, 4, 8, 16], [0.0, 0.1, 0.1, 0.3])
    spread, t = math.sqrt(0.007 / 2), 1.8856
    assert (trend.slope, trend.intercept, trend.spread, trend.calibrated_max) == (
        pytest.approx(0.09), pytest.approx(-0.1), pytest.approx(spread), 16)
    half_16, half_64 = (t * spread * math.sqrt(1.25 + d2 / 5) for d2 in (2.25, 12.25))
    assert trend.band(16) == (pytest.approx(0.26 - half_16, abs=1e-4), pytest.approx(0.26 + half_16, abs=1e-4))
    assert trend.band(64) == (pytest.approx(0.44 - half_64, abs=1e-4), pytest.approx(0.44 + half_64, abs=1e-4))
    assert trend.widening(64) == (0.0, pytest.approx(0.18 + half_64 - half_16, abs=1e-4))
    assert trend.widening(16) == trend.widening(3) == (0.0, 0.0)
    with pytest.raises(ValueError):
        ScaleTrend.fit("gpus", [8, 8, 8], [0.1, 0.2, 0.3])


def test_runs_larger_than_every_calibration_run_get_a_wider_interval():
    """A falling trend in data-parallel ranks (residual -0.1 per doubling, calibrated to 8 ranks)
    widens the low side beyond 8 ranks and says so; within the range the interval is the stored
    one; the wider of two trends' bounds is kept on each side. On the shipped calibration a
    16,384-GPU H100 cluster is beyond every calibration run: its plans carry the reason, CPU
    ranks never do."""
    from cost_models.uncertainty import ScaleTrend, scale_widening

    falling = ScaleTrend.fit("data_parallel_ranks", [1, 2, 4, 8], [0.1, 0.0, -0.1, -0.2])
    rising = ScaleTrend.fit("gpus", [1, 2, 4, 8], [-0.1, 0.0, 0.1, 0.2])
    trends = {"data_parallel_ranks": falling, "gpus": rising}
    assert scale_widening({"gpus": 8, "data_parallel_ranks": 8}, trends) == (RESIDUAL_LOW, RESIDUAL_HIGH, [])
    low, high, reasons = scale_widening({"gpus": 8, "data_parallel_ranks": 64}, trends)
    assert low == pytest.approx(RESIDUAL_LOW - 0.3) and high == RESIDUAL_HIGH
    assert reasons == [reasons[0]] and reasons[0].startswith("64 ranks in a data-parallel group")
    low, high, reasons = scale_widening({"gpus": 32, "data_parallel_ranks": 64}, trends)
    assert (low, high) == (pytest.approx(RESIDUAL_LOW - 0.3), pytest.approx(RESIDUAL_HIGH + 0.2)) and len(reasons) == 2
    big = extrapolations(cluster("H100-SXM", 2048), 1, data_parallel_ranks=8)
    assert big.residual_high > RESIDUAL_HIGH and "16,384 GPUs" in big.reasons[-1] and not big.reprices
    interval = PredictionInterval(10.0, 10.0, big.reasons, big.residual_low, big.residual_high)
    assert interval.low_s < PredictionInterval(10.0, 10.0).low_s
    cpu = ClusterSpec.from_config(ClusterConfig(name="c", gpu="cpu", nodes=4096, gpus_per_node=4))
    assert not extrapolations(cpu, 1, data_parallel_ranks=16384).any

"""Cost-model formulas against hand-worked numbers from their sources."""
from __future__ import annotations

import pytest

from cost_models.collectives import (Algorithm, Collective, best_algorithm, bus_bandwidth, collective_time_s,
                                     flat_time_s, parameter_server_load_bytes, ring_per_worker_bytes)
from cost_models.hardware import get_gpu, known_gpus
from cost_models.memory import megatron_layer_activation_bytes, model_states
from cost_models.pipeline import bubble_fraction, in_flight_micro_batches, pipeline_step_time_s
from cost_models.topology import ClusterConfig, ClusterSpec, Link

GB = 1e9


@pytest.mark.parametrize("stage,expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_model_states(stage, expected_gb):
    """ZeRO paper §3 worked example: Ψ = 7.5B, N_d = 64, mixed-precision Adam (K = 12)."""
    states = model_states(7.5e9, "bf16", "adam", stage, 64)
    assert states.total_bytes / GB == pytest.approx(expected_gb, abs=0.05)


def test_ring_all_reduce_formula():
    link = Link(bandwidth_Bps=100 * GB, latency_s=5e-6, name="test")
    n, size = 8, 1 * GB
    expected = 2 * (n - 1) * 5e-6 + 2 * (n - 1) / n * size / (100 * GB)
    assert flat_time_s(Collective.ALL_REDUCE, Algorithm.RING, size, n, link) == pytest.approx(expected)
    # nccl-tests: busbw of a ring all-reduce approaches the link bandwidth for large messages.
    seconds = flat_time_s(Collective.ALL_REDUCE, Algorithm.RING, 64 * GB, n, link)
    assert bus_bandwidth(Collective.ALL_REDUCE, n, 64 * GB, seconds) == pytest.approx(100 * GB, rel=1e-3)


def test_parameter_server_grows_with_workers_while_ring_stays_flat():
    """The seeds' classic comparison: PS traffic at the server is O(N)·M, ring per-worker
    traffic is 2(N-1)/N·M whatever N."""
    size = 1 * GB
    link = Link(bandwidth_Bps=25 * GB, latency_s=10e-6, name="nic")
    ps = [flat_time_s(Collective.ALL_REDUCE, Algorithm.PARAMETER_SERVER, size, n, link) for n in (4, 8, 16, 32)]
    ring = [flat_time_s(Collective.ALL_REDUCE, Algorithm.RING, size, n, link) for n in (4, 8, 16, 32)]
    assert ps == sorted(ps) and ps[-1] / ps[0] == pytest.approx(31 / 3, rel=0.01)
    assert max(ring) / min(ring) < 1.4
    assert parameter_server_load_bytes(size, 32) == 62 * size
    assert ring_per_worker_bytes(size, 32) == pytest.approx(2 * 31 / 32 * size)


def test_best_algorithm_prefers_latency_optimal_for_small_and_hierarchical_across_nodes():
    cluster = ClusterSpec.from_config(ClusterConfig(name="x", gpu="H100-SXM", nodes=8, gpus_per_node=8,
                                                    inter_node_bandwidth_GBps=50))
    everyone = cluster.placement(list(range(64)))
    small = best_algorithm(Collective.ALL_REDUCE, 4096, everyone)
    assert small.algorithm in (Algorithm.TREE, Algorithm.HALVING_DOUBLING)
    large = best_algorithm(Collective.ALL_REDUCE, 4 * GB, everyone)
    assert large.algorithm is Algorithm.HIERARCHICAL
    assert large.seconds < collective_time_s(Collective.ALL_REDUCE, 4 * GB, everyone, Algorithm.RING)


def test_group_placement_decides_links():
    cluster = ClusterSpec.from_config(ClusterConfig(name="x", gpu="A100-80GB", nodes=2, gpus_per_node=8))
    inside = cluster.strided_placement(8, 1)
    across = cluster.strided_placement(2, 8)
    assert not inside.crosses_nodes and inside.link.bandwidth_Bps == 300 * GB
    assert across.crosses_nodes and across.link.bandwidth_Bps == 25 * GB


def test_pipeline_bubbles():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 8)
    assert bubble_fraction(4, 8, chunks=2) == pytest.approx(3 / 16)
    d = 2.0
    assert pipeline_step_time_s([d] * 4, 8) == pytest.approx(8 * d * (1 + 3 / 8))
    assert pipeline_step_time_s([d] * 4, 8, 2) == pytest.approx(8 * d * (1 + 3 / 16))
    assert in_flight_micro_batches("1f1b", 4, 8, 0) == 4 and in_flight_micro_batches("1f1b", 4, 8, 3) == 1
    assert in_flight_micro_batches("gpipe", 4, 8, 3) == 8
    assert in_flight_micro_batches("interleaved_1f1b", 4, 8, 0, 2) == pytest.approx(4 * (1 + 3 / 32))


def test_megatron_activation_formula_values():
    s, b, h, a = 2048, 1, 4096, 32
    assert megatron_layer_activation_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)
    assert megatron_layer_activation_bytes(s, b, h, a, t=8) == s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8))
    assert megatron_layer_activation_bytes(s, b, h, a, t=8, sequence_parallel=True) == \
        s * b * h * (34 + 5 * a * s / h) / 8


def test_catalogue_has_every_required_gpu_and_clear_unknown_error():
    for name in ("V100-32GB", "A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H200", "B200", "L40S",
                 "MI300X", "cpu"):
        assert name in known_gpus()
    assert get_gpu("h100-sxm").flops("bf16") == 989e12
    with pytest.raises(ValueError, match="Known types: .*A100-80GB"):
        get_gpu("Z9000")

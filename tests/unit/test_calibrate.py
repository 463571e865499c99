"""Calibration: the all-reduce fit recovers known alpha/beta; a real 2-rank measurement runs
and feeds a hardware profile the cluster loads."""
from __future__ import annotations

import pytest

from cost_models.calibrate import calibrate, fit_all_reduce
from cost_models.topology import ClusterConfig, ClusterSpec


def test_fit_recovers_ring_parameters():
    ranks, alpha, bandwidth = 4, 30e-6, 5e9
    samples = [(s, 2 * (ranks - 1) * alpha + 2 * (ranks - 1) / ranks * s / bandwidth) for s in (4e3, 1e6, 1e7, 1e8)]
    fit = fit_all_reduce(samples, ranks)
    assert fit.latency_s == pytest.approx(alpha, rel=1e-3)
    assert fit.bandwidth_Bps == pytest.approx(bandwidth, rel=1e-6)


def test_real_calibration_is_loaded_by_the_cluster(tmp_path):
    out = tmp_path / "hw.yaml"
    profile = calibrate(out, ranks=2, ranks_per_node=2)
    measured = profile["gpus"]["cpu"]["peak_flops"]["fp32"]
    assert measured > 1e8  # any CPU multiplies faster than 0.1 GFLOP/s
    cluster = ClusterSpec.from_config(ClusterConfig(name="calibrated", gpu="cpu", hardware_profile=str(out)))
    assert cluster.node_gpus[0].flops("fp32") == measured
    assert cluster.intra.bandwidth_Bps == profile["links"]["intra"]["bandwidth_Bps"]
    assert cluster.calibration == str(out)

"""Refitting the cost model to measured runs: the fit recovers known factors, and the pricer
applies the fitted factors to exactly the parts they were fitted for."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import yaml

from autopar.model_file import load_model_file
from autopar.profile import profile_model
from autopar.solver.tp_split import ILPSplitter
from cost_models.feedback import fit_time_scale, nonnegative_least_squares, write_profile
from autopar.domain.layout import ParallelLayout
from cost_models.step import PlanPricer, TrainSpec
from cost_models.topology import ClusterConfig, ClusterSpec


def test_nnls_matches_a_grid_search():
    rng = np.random.default_rng(0)
    for _ in range(20):
        a, b = rng.random((6, 2)), rng.random(6) - 0.3
        x = nonnegative_least_squares(a, b)
        grid = [np.array(p) for p in itertools.product(np.linspace(0, 2, 81), repeat=2)]
        best = min(float(np.sum((a @ g - b) ** 2)) for g in grid)
        assert np.all(x >= 0) and float(np.sum((a @ x - b) ** 2)) <= best + 1e-12


def _validation(parts: dict[str, float], factors: dict[str, float]) -> dict:
    compute = sum(parts.get(p, 0.0) for p in ("compute", "recompute", "optimizer")) * factors["compute"]
    comm = sum(parts.get(p, 0.0) * factors[p] for p in ("tp_comm", "dp_comm", "pp_comm"))
    return {"time_breakdown": parts, "ranks": [{"measured": {"step_time_s": compute + comm, "compute_s": compute,
                                                             "comm_s": comm}}]}


def test_fit_recovers_known_factors():
    rng = random.Random(1)
    factors = {"compute": 1.7, "tp_comm": 12.0, "dp_comm": 3.5, "pp_comm": 0.8}
    runs = [_validation({"compute": rng.uniform(0.01, 0.2), "optimizer": 0.001,
                         "tp_comm": rng.choice([0.0, rng.uniform(0.001, 0.01)]),
                         "dp_comm": rng.choice([0.0, rng.uniform(0.001, 0.01)]),
                         "pp_comm": rng.uniform(0.0005, 0.002)}, factors) for _ in range(12)]
    fitted = fit_time_scale(runs)
    for part, factor in factors.items():
        assert fitted[part] == pytest.approx(factor, rel=1e-6)


def test_few_runs_share_one_communication_factor():
    runs = [_validation({"compute": 0.1, "tp_comm": 0.01}, {"compute": 2.0, "tp_comm": 5.0, "dp_comm": 5.0,
                                                             "pp_comm": 5.0})]
    fitted = fit_time_scale(runs)
    assert fitted["compute"] == pytest.approx(2.0) and fitted["tp_comm"] == pytest.approx(5.0)


def test_pricer_scales_the_fitted_parts(examples_dir, tmp_path):
    profile = profile_model(load_model_file(examples_dir / "gpt.py"), {"layers": 2, "hidden": 64, "heads": 4,
                                                                      "seq_len": 32, "vocab": 128}, 1, "fp32")
    layout = ParallelLayout(dp=2, tp=2, micro_batch_size=4, num_micro_batches=1)
    train = TrainSpec(global_batch_size=8, precision="fp32")

    def breakdown(hardware_profile=None):
        cluster = ClusterSpec.from_config(ClusterConfig(name="cpu", gpu="cpu", gpus_per_node=4,
                                                        hardware_profile=hardware_profile))
        return PlanPricer(profile, cluster, train, ILPSplitter(profile)).estimate(layout).time_breakdown

    plain = breakdown()
    path = tmp_path / "hw.yaml"
    write_profile({"compute": 2.0, "recompute": 2.0, "optimizer": 2.0, "tp_comm": 3.0, "dp_comm": 1.0}, path)
    assert yaml.safe_load(path.read_text())["time_scale"]["tp_comm"] == 3.0
    scaled = breakdown(str(path))
    assert scaled["compute"] == pytest.approx(2 * plain["compute"])
    assert scaled["tp_comm"] == pytest.approx(3 * plain["tp_comm"])

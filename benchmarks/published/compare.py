"""Predicted vs published: each run of runs.yaml priced with its pinned plan, the signed error,
per-table rank correlation, and the same after a leave-one-out fit of correction factors.

Errors are on step time: predicted / measured - 1, so a negative error is a prediction faster
than the published run. A published throughput is turned into a step time with the formula
its authors used (Megatron-LM counts FLOPs by eq. 3 of Narayanan et al. 2021, which includes
the recomputed forward; Megatron-Core by 72·B·s·l·h²(1 + s/6h + V/12lh)).

benchmarks/published/refit.py holds the honest leave-one-out: every constant the catalogue fits
to the calibration rows (the per-GPU compute time scale) refitted without the row it prices.
`leave_one_out` below is a diagnostic on top of that: per GPU type a factor on the compute-bound
parts of the step (compute,
recomputation, bubble, optimizer) and one factor on the exposed communication, fitted by
least squares on relative errors to every calibration row but one, then used to predict that
one. A model right for the reasons the rows show keeps its error after the fit; one that only
memorises rows does not.
"""
from __future__ import annotations

import functools
import hashlib
import json
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PROFILE_CACHE = REPO / "benchmarks" / "results" / "profiles"


@functools.lru_cache(maxsize=1)
def tracing_code_digest() -> str:
    """A digest of the code a profile comes from (autopar/profile.py and autopar/trace/): a cached
    profile traced by other code is traced again rather than priced stale."""
    digest = hashlib.sha256()
    for path in sorted([REPO / "autopar" / "profile.py", *(REPO / "autopar" / "trace").glob("*.py")]):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
COMPUTE_BOUND = ("compute", "recompute", "bubble", "optimizer")
COMMUNICATION = ("tp_comm", "cp_comm", "pp_comm", "dp_comm")


@dataclass
class Comparison:
    """One published run priced by the cost model."""

    run: dict[str, Any]
    gpus: int
    gpu: str
    measured_step_s: float
    predicted_step_s: float
    breakdown: dict[str, float]
    predicted_memory_GiB: float
    fits: bool
    work: float  # what the rate is counted in (FLOPs by the authors' formula, else tokens)
    loo_step_s: float = float("nan")
    extra: dict[str, Any] = field(default_factory=dict)
    data_parallel_ranks: int = 1  # the gradient group's ranks (dp x cp)

    @property
    def error(self) -> float:
        return self.predicted_step_s / self.measured_step_s - 1

    @property
    def loo_error(self) -> float:
        return self.loo_step_s / self.measured_step_s - 1


def load_runs(path: Path = HERE / "runs.yaml") -> list[dict[str, Any]]:
    return yaml.safe_load(path.read_text())["runs"]


def megatron_flops(run: dict[str, Any], formula: str) -> float:
    """FLOPs of one iteration as the authors count them (module docstring)."""
    model = run["model"]
    B, s, layers, h, V = run["global_batch_size"], model["seq_len"], model["layers"], model["hidden"], model["vocab"]
    if formula == "megatron_recompute":  # Narayanan et al. 2021, eq. 3
        return 96 * B * s * layers * h**2 * (1 + s / (6 * h) + V / (16 * layers * h))
    if formula == "megatron_model":  # Korthikanti et al. 2022, App. A (model FLOPs)
        return 72 * B * s * layers * h**2 * (1 + s / (6 * h) + V / (12 * layers * h))
    raise ValueError(f"unknown flops formula {formula}")


def measured_step_s(run: dict[str, Any], gpus: int) -> tuple[float, float]:
    """(step seconds, work the rate is counted in) from what was published."""
    measured = run["measured"]
    tokens = run["global_batch_size"] * run["model"]["seq_len"]
    if "tflops_per_gpu" in measured:
        flops = megatron_flops(run, measured["flops_formula"])
        return flops / (measured["tflops_per_gpu"] * 1e12 * gpus), flops
    if "step_time_s" in measured:
        return float(measured["step_time_s"]), megatron_flops(run, "megatron_model")
    if "tokens_per_s_per_gpu" in measured:
        return tokens / (measured["tokens_per_s_per_gpu"] * gpus), tokens
    raise ValueError(f"run {run['id']} has no measurement autopar can compare")


def overrides(run: dict[str, Any]) -> list[str]:
    model = {k: v for k, v in run["model"].items() if k != "file"}
    return ([f"model.{k}={v}" for k, v in model.items()]
            + [f"cluster={run['cluster']['preset']}", f"cluster.nodes={run['cluster']['nodes']}",
               f"train.precision={run['precision']}", f"train.global_batch_size={run['global_batch_size']}",
               f"train.tp_runtime={run.get('tp_runtime', 'plain')}",
               f"train.zero3_runtime={run.get('zero3_runtime', 'fsdp2')}",
               f"train.selective_runtime={run.get('selective_runtime', 'autopar')}",
               f"train.grad_reduce_dtype={run.get('grad_reduce_dtype', 'fp32')}"]
            + [f"plan.{k}={v}" for k, v in run["plan"].items()])


def cached_profile(run: dict[str, Any], cfg: Any):
    """Trace once per model file, shape and precision (kept under benchmarks/results/, not committed)."""
    from autopar.driver import run_profile

    model_file = REPO / "examples" / run["model"]["file"]
    model_digest = hashlib.sha256(model_file.read_bytes()).hexdigest()
    key = hashlib.sha256(json.dumps([run["model"], run["precision"], tracing_code_digest(), model_digest],
                                    sort_keys=True).encode()).hexdigest()[:16]
    path = PROFILE_CACHE / f"{run['model']['file'].removesuffix('.py')}-{key}.json"
    if path.exists():
        return _load_profile(str(path))
    profile = run_profile(model_file, cfg)
    PROFILE_CACHE.mkdir(parents=True, exist_ok=True)
    profile.save(path)
    return profile


@functools.lru_cache(maxsize=2)
def _load_profile(path: str):
    """A cached profile read once for the several prices of one run (loading dominates a price)."""
    from autopar.model_profile import ModelProfile

    return ModelProfile.load(Path(path))


def with_compute_scales(cluster: Any, scales: dict[str, float]) -> Any:
    """The cluster with each fitted GPU family's compute time scale replaced by `scales[family]`
    (families not named keep the catalogue's)."""
    from cost_models.hardware import scale_family, with_compute_scale

    gpus = tuple(with_compute_scale(gpu, scales[scale_family(gpu.name)])
                 if scale_family(gpu.name) in scales else gpu for gpu in cluster.node_gpus)
    return replace(cluster, node_gpus=gpus)


def price(run: dict[str, Any], compute_scales: dict[str, float] | None = None,
          network_fraction: float = 1.0) -> Comparison:
    """The run priced with its pinned plan; `compute_scales` (GPU family -> scale) replaces the
    catalogue's fitted compute time scales (1.0: nothing fitted); `network_fraction` prices the
    links between nodes at that share of their rate (a what-if, `bench_published`)."""
    from autopar.config import compose_config
    from autopar.specs import build_cluster, pinned_layout, train_spec
    from autopar.solver.tp_split import ILPSplitter
    from cost_models.step import PlanPricer

    cfg = compose_config(overrides(run))
    cluster = build_cluster(cfg)
    if compute_scales:
        cluster = with_compute_scales(cluster, compute_scales)
    if network_fraction != 1.0:
        slower = replace(cluster.inter, bandwidth_Bps=cluster.inter.bandwidth_Bps * network_fraction)
        cluster = replace(cluster, inter=slower)
    profile = cached_profile(run, cfg)
    layout = pinned_layout(cfg, cluster)
    recompute = (layout.recompute,)
    train = train_spec(cfg)
    pricer = PlanPricer(profile, cluster, train, ILPSplitter.for_training(profile, train),
                        recompute_options=tuple(dict.fromkeys(("none", *recompute))))
    estimate = pricer.estimate(layout)
    step, work = measured_step_s(run, cluster.world_size)
    return Comparison(run=run, gpus=cluster.world_size, gpu=cluster.node_gpus[0].name, measured_step_s=step,
                      predicted_step_s=estimate.step_time_s, breakdown=dict(estimate.time_breakdown),
                      predicted_memory_GiB=estimate.peak_memory_bytes / 2**30, fits=estimate.fits, work=work,
                      data_parallel_ranks=layout.dp * layout.cp)


def compute_bound_s(row: Comparison) -> float:
    """Seconds of the step the compute time scale multiplies (COMPUTE_BOUND parts)."""
    return sum(row.breakdown.get(p, 0.0) for p in COMPUTE_BOUND)


def _design(rows: list[Comparison], gpus: list[str]) -> np.ndarray:
    """Columns: compute-bound seconds per GPU type, then exposed communication."""
    matrix = np.zeros((len(rows), len(gpus) + 1))
    for i, row in enumerate(rows):
        matrix[i, gpus.index(row.gpu)] = sum(row.breakdown.get(p, 0.0) for p in COMPUTE_BOUND)
        matrix[i, -1] = sum(row.breakdown.get(p, 0.0) for p in COMMUNICATION)
    return matrix


def fit_factors(rows: list[Comparison], gpus: list[str]) -> np.ndarray:
    """Least squares on relative errors (each row weighted by 1 / its measurement)."""
    from cost_models.feedback import nonnegative_least_squares

    measured = np.array([row.measured_step_s for row in rows])
    return nonnegative_least_squares(_design(rows, gpus) / measured[:, None], np.ones(len(rows)))


def leave_one_out(rows: list[Comparison]) -> dict[str, float]:
    """Fill `loo_step_s` of every row (fitted on the others); return the factors fitted on all."""
    gpus = sorted({row.gpu for row in rows})
    for i, row in enumerate(rows):
        others = rows[:i] + rows[i + 1:]
        factors = fit_factors(others, gpus)
        if not np.any(factors[gpus.index(row.gpu)]):  # no other row of its GPU type: unfitted
            factors[gpus.index(row.gpu)] = 1.0
        row.loo_step_s = float(_design([row], gpus)[0] @ factors)
    factors = fit_factors(rows, gpus)
    return {**{f"compute x ({gpu})": float(f) for gpu, f in zip(gpus, factors)}, "communication x": float(factors[-1])}


def fit_compute_scale(rows: list[Comparison]) -> dict[str, float]:
    """Per GPU type, the factor on compute-bound seconds that minimises the squared relative
    errors of its calibration rows with communication priced as is: the catalogue's
    COMPUTE_TIME_SCALE (cost_models/hardware.py) is this fit, rounded, taken with the scale
    itself at 1 (the closed form of a one-parameter least squares, sum(c·r) / sum(c·c), for
    c = compute-bound seconds and r = measured minus the rest, both over the measurement)."""
    scales = {}
    for gpu in sorted({row.gpu for row in rows}):
        members = [row for row in rows if row.gpu == gpu]
        compute = np.array([sum(r.breakdown.get(p, 0.0) for p in COMPUTE_BOUND) for r in members])
        measured = np.array([r.measured_step_s for r in members])
        rest = np.array([r.predicted_step_s for r in members]) - compute
        c, target = compute / measured, (measured - rest) / measured
        scales[gpu] = float(c @ target / (c @ c))
    return scales


def spearman_by_table(rows: list[Comparison]) -> dict[str, float]:
    """Rank correlation of predicted and measured rate (work / step) within each table."""
    from cost_models.feedback import spearman

    tables: dict[str, list[Comparison]] = {}
    for row in rows:
        tables.setdefault(row.run["table"], []).append(row)
    return {table: spearman([r.work / r.predicted_step_s / r.gpus for r in members],
                            [r.work / r.measured_step_s / r.gpus for r in members])
            for table, members in tables.items() if len(members) > 2}


def median_abs(values: list[float]) -> float:
    return statistics.median(abs(v) for v in values) if values else float("nan")

"""Close the loop: refit the cost model to measured runs (`autopar calibrate --from validate.json ...`).

Each validation gives, for the slowest rank, the measured compute and communication seconds of a
step (profiler split) next to the cost model's predicted parts (compute, recompute and optimizer;
tp/cp/pp/dp communication). The fit finds non-negative factors with

    measured_compute_i ≈ c · predicted_compute_i
    measured_comm_i    ≈ Σ_k f_k · predicted_comm_{i,k}      k ∈ {tp_comm, cp_comm, pp_comm, dp_comm}

by least squares on relative errors (each run weighted by 1 / its measurement, so short and long
steps count alike). A part with too few runs to pin it down shares one factor with the others
(`min_runs_per_factor`). The factors go into the hardware profile's ``time_scale`` section, which
the pricer multiplies into those parts of every later plan; other numbers stay as they were.
"""
from __future__ import annotations

import itertools
import statistics
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import yaml

COMPUTE_PARTS = ("compute", "recompute", "optimizer")
COMM_PARTS = ("tp_comm", "cp_comm", "pp_comm", "dp_comm")


def nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min ||a x - b|| with x >= 0, exactly, by trying every support set (a has few columns)."""
    columns = a.shape[1]
    best, best_residual = np.zeros(columns), float(np.sum(b**2))
    for size in range(1, columns + 1):
        for support in itertools.combinations(range(columns), size):
            solution, *_ = np.linalg.lstsq(a[:, support], b, rcond=None)
            if np.any(solution < 0):
                continue
            x = np.zeros(columns)
            x[list(support)] = solution
            residual = float(np.sum((a @ x - b) ** 2))
            if residual < best_residual - 1e-15:
                best, best_residual = x, residual
    return best


def slowest_rank(validation: dict[str, Any]) -> dict[str, Any]:
    return max(validation["ranks"], key=lambda rank: rank["measured"]["step_time_s"])


def fit_time_scale(validations: list[dict[str, Any]], min_runs_per_factor: int = 2) -> dict[str, float]:
    """Factors for compute and each communication part (see the module docstring)."""
    if not validations:
        raise ValueError("calibration needs at least one validate.json")
    compute_pred = np.array([sum(v["time_breakdown"].get(p, 0.0) for p in COMPUTE_PARTS) for v in validations])
    compute_meas = np.array([slowest_rank(v)["measured"]["compute_s"] for v in validations])
    weights = 1 / np.maximum(compute_meas, 1e-12)
    compute = float(nonnegative_least_squares((compute_pred * weights)[:, None], compute_meas * weights)[0])
    scale = {part: compute for part in COMPUTE_PARTS}
    comm_meas = np.array([slowest_rank(v)["measured"]["comm_s"] for v in validations])
    parts = [p for p in COMM_PARTS if any(v["time_breakdown"].get(p, 0.0) > 0 for v in validations)]
    if not parts:
        return scale
    matrix = np.array([[v["time_breakdown"].get(p, 0.0) for p in parts] for v in validations])
    runs = [int(np.count_nonzero(matrix[:, j])) for j in range(len(parts))]
    weights = 1 / np.maximum(comm_meas, 1e-12)
    if len(validations) >= min_runs_per_factor * len(parts) and min(runs) >= min_runs_per_factor:
        factors = nonnegative_least_squares(matrix * weights[:, None], comm_meas * weights)
        scale.update({p: float(f) for p, f in zip(parts, factors)})
    else:
        shared = nonnegative_least_squares((matrix.sum(axis=1) * weights)[:, None], comm_meas * weights)[0]
        scale.update({p: float(shared) for p in parts})
    return scale


def write_profile(scale: dict[str, float], out: str | Path, base: str | Path | None = None,
                  sources: Sequence[str] = ()) -> dict[str, Any]:
    """The base hardware profile (if any) with ``time_scale`` replaced by the fitted factors."""
    profile = yaml.safe_load(Path(base).read_text()) if base else {}
    profile = dict(profile or {})
    profile["time_scale"] = {part: round(factor, 6) for part, factor in scale.items()}
    profile["time_scale_sources"] = list(sources)
    from cost_models.calibrate import write_yaml

    write_yaml(out, profile)
    return profile


def spearman(xs: list[float], ys: list[float]) -> float:
    """Rank correlation (average ranks for ties)."""
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                result[order[k]] = (i + j) / 2
            i = j + 1
        return result

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    norm = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / norm if norm else float("nan")

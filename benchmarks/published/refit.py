"""Fit the constants the catalogue takes from the calibration set, with each row left out, and
write them, the out-of-sample residuals and the prediction interval to cost_models/calibration.json.

    python -m benchmarks.published.refit            # price the calibration rows, write the file
    python -m benchmarks.published.refit --check    # exit 1 if the file is not what the rows give

What is fitted to the calibration rows (runs.yaml, `calibration: true`): the per-GPU-family compute
time scale (cost_models/hardware.py COMPUTE_TIME_SCALE, today A100's). Everything else the cost
model prices with is a datasheet figure or fitted to other measurements (collective curves,
kernel timings), none of them to these rows.

Each row is priced three ways:
- in sample: the catalogue as shipped (its scale fitted on every row, this one included);
- neutral: its family's scale at 1 (nothing fitted), the other point of the line below;
- held out: its family's scale fitted on the other rows (`fold_scales`), then the row priced
  again with that scale. Its error is the out-of-sample residual.

A row's step time is taken as a line in its family's scale s: neutral + (s - 1) * slope, the
slope being the secant between the neutral price and the catalogue's (exact at both, and the
folds' scales fall between or near them); the fit is the closed form of least squares on
relative errors (`fit_scale`). The scale is rounded to SCALE_DECIMALS as the catalogue's is.

The prediction interval (cost_models/uncertainty.py) is the 10th and 90th percentiles of the
held-out residuals (`interval_from_residuals`), and the pessimistic slowdown of a GPU type with
no calibration row the largest median |held-out residual| of a table, rounded up to a percent
(`uncalibrated_gpu_slowdown`). Beyond the largest calibration run, in GPUs or in data-parallel
ranks, the interval widens along the held-out residuals' trend in that size (`scale_trends`,
cost_models.uncertainty.ScaleTrend), fitted on the rows' sizes written beside them (`sizes`).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from benchmarks.published.compare import Comparison, compute_bound_s, load_runs, price

NEUTRAL = 1.0
SCALE_DECIMALS = 2
RESIDUAL_DECIMALS = 6
CHECK_TOLERANCE = 1e-3  # residuals and scales that differ by more make the stored file stale


@dataclass(frozen=True)
class ScalePoint:
    """One calibration row's step time as a line in its family's compute time scale."""

    neutral_s: float  # priced with the scale at 1
    slope_s: float  # seconds the step gains per unit of scale
    measured_s: float


def fit_scale(points: list[ScalePoint]) -> float:
    """The scale minimising sum(((neutral + (s - 1) * slope) / measured - 1)^2): with a = neutral,
    b = slope, m = measured, s - 1 = sum(b (m - a) / m^2) / sum(b^2 / m^2). No points (or no
    compute in them): NEUTRAL."""
    numerator = sum(p.slope_s * (p.measured_s - p.neutral_s) / p.measured_s**2 for p in points)
    denominator = sum(p.slope_s**2 / p.measured_s**2 for p in points)
    return NEUTRAL + numerator / denominator if denominator else NEUTRAL


def fold_scales(families: list[str | None], points: list[ScalePoint | None]) -> list[float | None]:
    """Per row, its family's scale fitted on the other rows of that family (rounded as the
    catalogue's); None for a row of no fitted family."""
    scales: list[float | None] = []
    for i, family in enumerate(families):
        if family is None:
            scales.append(None)
            continue
        others = [p for j, (f, p) in enumerate(zip(families, points)) if j != i and f == family and p]
        scales.append(round(fit_scale(others), SCALE_DECIMALS))
    return scales


def uncalibrated_gpu_slowdown(tables: list[str], residuals: list[float]) -> float:
    """The largest median |residual| of a table, rounded up to a percent: how far off a GPU type's
    compute can be where its rows were (the pessimistic price of one with none)."""
    medians = [statistics.median(abs(r) for t, r in zip(tables, residuals) if t == table) for table in set(tables)]
    return math.ceil(round(max(medians) * 100, 9)) / 100


def scale_point(shipped: Comparison, neutral: Comparison, shipped_scale: float) -> ScalePoint:
    """The line through the row's neutral and catalogue prices (at scale 1 only one point: the
    slope is its compute-bound seconds, what a scale multiplies)."""
    if shipped_scale != NEUTRAL:
        slope = (shipped.predicted_step_s - neutral.predicted_step_s) / (shipped_scale - NEUTRAL)
    else:
        slope = compute_bound_s(neutral)
    return ScalePoint(neutral.predicted_step_s, slope, shipped.measured_step_s)


@dataclass
class PricedRow:
    """A calibration row priced in sample, neutral and held out (module docstring)."""

    shipped: Comparison
    neutral: Comparison
    family: str | None
    fold_scale: float | None = None
    held_out_s: float = float("nan")

    @property
    def id(self) -> str:
        return self.shipped.run["id"]

    @property
    def table(self) -> str:
        return self.shipped.run["table"]

    @property
    def error(self) -> float:
        return self.shipped.error

    @property
    def held_out_error(self) -> float:
        return self.held_out_s / self.shipped.measured_step_s - 1


@dataclass
class Refit:
    """The fitted constants, every row's residuals in and out of sample, and the interval."""

    rows: list[PricedRow]
    points: list[ScalePoint | None]  # each row's line in its family's scale (None: no fitted family)
    compute_time_scale: dict[str, float]

    def held_out_residuals(self) -> list[float]:
        return [round(row.held_out_error, RESIDUAL_DECIMALS) for row in self.rows]

    def interval(self) -> tuple[float, float]:
        from cost_models.uncertainty import interval_from_residuals

        return interval_from_residuals(self.held_out_residuals())

    def sizes(self) -> dict[str, dict[str, int]]:
        return {row.id: {"gpus": row.shipped.gpus, "data_parallel_ranks": row.shipped.data_parallel_ranks}
                for row in self.rows}

    def scale_trends(self) -> dict[str, dict[str, Any]]:
        return scale_trends(self.sizes(), dict(zip((row.id for row in self.rows), self.held_out_residuals())))

    def to_json(self) -> dict[str, Any]:
        from cost_models.uncertainty import INTERVAL_QUANTILES

        low, high = self.interval()
        tables = [row.table for row in self.rows]
        return {
            "generated_by": "python -m benchmarks.published.refit (do not edit by hand)",
            "compute_time_scale": dict(self.compute_time_scale),
            "interval_quantiles": list(INTERVAL_QUANTILES),
            "interval": {"low": low, "high": high},
            "uncalibrated_gpu_slowdown": uncalibrated_gpu_slowdown(tables, self.held_out_residuals()),
            "techniques": calibrated_techniques([row.shipped.run for row in self.rows]),
            "scale_trends": self.scale_trends(),
            "sizes": self.sizes(),
            "tables": {row.id: row.table for row in self.rows},
            "held_out_residuals": {row.id: r for row, r in zip(self.rows, self.held_out_residuals())},
            "in_sample_residuals": {row.id: round(row.error, RESIDUAL_DECIMALS) for row in self.rows},
            "fold_compute_time_scale": {row.id: row.fold_scale for row in self.rows if row.fold_scale is not None},
            "scale_lines": {row.id: {"family": row.family, "neutral_s": round(p.neutral_s, RESIDUAL_DECIMALS),
                                     "slope_s": round(p.slope_s, RESIDUAL_DECIMALS),
                                     "measured_s": round(p.measured_s, RESIDUAL_DECIMALS)}
                            for row, p in zip(self.rows, self.points) if p},
        }


def scale_trends(sizes: dict[str, dict[str, int]], residuals: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Per size counted, the held-out residuals' line in its log2 (ScaleTrend), rounded as stored;
    none for a size the rows cannot fit a line to (fewer than three, or all one size)."""
    from cost_models.uncertainty import ScaleTrend

    ids = list(residuals)
    trends = {}
    for name in ("gpus", "data_parallel_ranks"):
        if len(ids) < 3 or len({sizes[i][name] for i in ids}) < 2:
            continue
        trend = ScaleTrend.fit(name, [sizes[i][name] for i in ids], [residuals[i] for i in ids])
        trends[name] = {key: round(value, RESIDUAL_DECIMALS) if isinstance(value, float) else value
                        for key, value in trend.to_json().items()}
    return trends


def calibrated_techniques(runs: list[dict[str, Any]]) -> list[str]:
    """The overlapped techniques (cost_models.uncertainty.techniques_of) some calibration run used:
    a plan's use of any other is priced pessimistically exposed."""
    from cost_models.uncertainty import techniques_of

    return sorted(set().union(*(techniques_of(SimpleNamespace(**run.get("plan", {}))) for run in runs)))


def refit(runs: list[dict[str, Any]], progress: bool = False) -> Refit:
    """Price every calibration run in sample, neutral and held out; fit the scales on all rows."""
    from cost_models.hardware import COMPUTE_TIME_SCALE, scale_family

    rows = []
    for run in (r for r in runs if r["calibration"]):
        shipped = price(run)
        family = scale_family(shipped.gpu)
        neutral = price(run, {family: NEUTRAL}) if family else shipped
        rows.append(PricedRow(shipped, neutral, family))
        if progress:
            print(f"priced {run['id']}", file=sys.stderr, flush=True)
    points = [scale_point(row.shipped, row.neutral, COMPUTE_TIME_SCALE[row.family]) if row.family else None
              for row in rows]
    families = [row.family for row in rows]
    for row, scale in zip(rows, fold_scales(families, points)):
        row.fold_scale = scale
        if scale is None or scale == COMPUTE_TIME_SCALE[row.family]:
            row.held_out_s = row.shipped.predicted_step_s
        else:
            row.held_out_s = price(row.shipped.run, {row.family: scale}).predicted_step_s
    fitted = {family: round(fit_scale([p for f, p in zip(families, points) if f == family and p]), SCALE_DECIMALS)
              for family in sorted({f for f in families if f})}
    return Refit(rows, points, fitted)


def stale(refit_result: Refit, stored: dict[str, Any]) -> list[str]:
    """What in the stored calibration differs from a fresh refit (empty: up to date)."""
    fresh = refit_result.to_json()
    problems = []
    for family, scale in fresh["compute_time_scale"].items():
        if abs(stored["compute_time_scale"].get(family, float("nan")) - scale) > CHECK_TOLERANCE:
            problems.append(f"{family} compute time scale: stored {stored['compute_time_scale'].get(family)}, "
                            f"refit {scale}")
    for name, trend in fresh["scale_trends"].items():
        kept = stored.get("scale_trends", {}).get(name, {})
        if any(abs(kept.get(key, float("nan")) - value) > CHECK_TOLERANCE for key, value in trend.items()):
            problems.append(f"the out-of-sample error's trend in {name}: stored {kept}, refit {trend}")
    for key in ("held_out_residuals", "in_sample_residuals"):
        for run_id, value in fresh[key].items():
            kept = stored.get(key, {}).get(run_id)
            if kept is None or abs(kept - value) > CHECK_TOLERANCE:
                problems.append(f"{run_id} {key.replace('_', ' ')}: stored {kept}, refit {value:+.4f}")
    return problems


def main(argv: list[str] | None = None) -> int:
    from cost_models.calibration import CALIBRATION_FILE, load_calibration

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the stored file instead of writing it")
    args = parser.parse_args(argv)
    result = refit(load_runs(), progress=True)
    if args.check:
        problems = stale(result, load_calibration())
        for problem in problems:
            print(problem)
        print("calibration.json is " + ("stale: rerun python -m benchmarks.published.refit" if problems
                                          else "what the calibration rows give"))
        return 1 if problems else 0
    CALIBRATION_FILE.write_text(json.dumps(result.to_json(), indent=1) + "\n")
    low, high = result.interval()
    print(f"wrote {CALIBRATION_FILE.name}: compute time scale {result.compute_time_scale}, "
          f"interval {low:+.1%} / {high:+.1%}")
    from cost_models.hardware import COMPUTE_TIME_SCALE

    if result.compute_time_scale != COMPUTE_TIME_SCALE:  # the residuals were priced with the old scale
        print(f"the fitted scale moved (was {COMPUTE_TIME_SCALE}): run the refit again to price with it")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The cost model against published training runs (benchmarks/published/runs.yaml): predicted vs
measured step time per run (signed error: negative = predicted faster), the median |error| of
the calibration rows in sample and out of sample, rank correlation within each table, the
prediction interval and how much of the out-of-sample residuals it holds, and how many runs outside
the calibration set fall inside the interval for their size (the smoke run: one row of each table,
held to its stored in-sample residual).

    python -m benchmarks.run published

Columns: `error` is the catalogue as shipped (its constants fitted on every calibration row,
this one included); `held_out_error` the row priced with every constant fitted to the
calibration set refitted on the other rows (benchmarks/published/refit.py); `factors_loo` a
model with more freedom: a compute factor per GPU type and a communication factor fitted
without the row (benchmarks/published/compare.py, `leave_one_out`) over the prices with the
compute time scale at 1, so the A100's factor takes the scale's place and nothing is fitted on
the row. The summary also gives the older figure, the same factors over the catalogue's prices
(its scale fitted on every row). The benchmark fails if cost_models/calibration.json is not
what these rows give.
"""
from __future__ import annotations

import json
from dataclasses import replace

from benchmarks.published.compare import (fit_compute_scale, leave_one_out, load_runs, median_abs, price,
                                          spearman_by_table)
from benchmarks import smoke
from benchmarks.published.refit import CHECK_TOLERANCE, Refit, refit, stale


def run() -> list[dict]:
    from cost_models.calibration import load_calibration

    runs = load_runs()
    if smoke():
        return _smoke(runs, load_calibration())
    result = refit(runs)
    held = {row.id: row for row in result.rows}
    calibration = [row.shipped for row in result.rows]
    neutral = [replace(row.neutral) for row in result.rows]  # copies: leave_one_out fills loo_step_s
    factors = leave_one_out(neutral)
    for row, priced in zip(calibration, neutral):
        row.loo_step_s = priced.loo_step_s
    in_sample_scale = [replace(c) for c in calibration]
    leave_one_out(in_sample_scale)
    compared = {c.run["id"]: c for c in calibration}
    compared.update({run["id"]: price(run) for run in runs if not run["calibration"]})
    rows = [_run_row(compared[run["id"]], held.get(run["id"])) for run in runs]
    rows += _summary(result, calibration)
    rows += _ptdp_against_zero3(compared)
    rows += _a4_network_what_if(runs)
    rows += _held_out_coverage([compared[run["id"]] for run in runs if not run["calibration"]])
    rows.append({"id": "median |error| of the factors refitted over the catalogue's prices (the older figure)",
                 "factors_loo": f"{median_abs([c.loo_error for c in in_sample_scale]):.1%}"})
    rows.append({"id": "fitted factors (all calibration rows, compute time scale at 1)",
                 "error": ", ".join(f"{name} {value:.3f}" for name, value in factors.items())})
    rows.append({"id": "compute time scale fitted per GPU (communication as priced)",
                 "error": ", ".join(f"{gpu} {value:.3f}" for gpu, value in fit_compute_scale(calibration).items())})
    problems = stale(result, load_calibration())
    assert not problems, ("cost_models/calibration.json is not what the calibration rows give ("
                          + "; ".join(problems[:5]) + "): rerun `python -m benchmarks.published.refit`.")
    return rows


def _smoke(runs: list[dict], stored: dict) -> list[dict]:
    """The first calibration row of each table priced with the catalogue as shipped, its error
    held to the in-sample residual cost_models/calibration.json stores for it: a change to the
    cost model that moves the calibration rows fails here until the refit is run again."""
    rows, problems = [], []
    for table in sorted({run["table"] for run in runs if run["calibration"]}):
        run = next(r for r in runs if r["calibration"] and r["table"] == table)
        comparison = price(run)
        kept = stored["in_sample_residuals"].get(run["id"])
        if kept is None or abs(kept - comparison.error) > CHECK_TOLERANCE:
            problems.append(f"{run['id']}: stored {kept}, priced {comparison.error:+.4f}")
        rows.append({**_run_row(comparison, None), "held_out_error": "(smoke run: not refitted)"})
    assert not problems, ("cost_models/calibration.json is not what the calibration rows give ("
                          + "; ".join(problems) + "): rerun `python -m benchmarks.published.refit`.")
    return rows


def _ptdp_against_zero3(compared: dict) -> list[dict]:
    """A4 at each model size and GPU count the paper ran both ways: how much faster PTD-P is than
    flat ZeRO-3 per GPU, measured and predicted, and whether the prediction keeps the order."""
    rows = []
    for ptdp in (c for c in compared.values() if c.run["table"] == "A4" and "-ptdp-" in c.run["id"]):
        zero3 = compared.get(ptdp.run["id"].replace("-ptdp-", "-zero3-"))
        if zero3 is None:
            continue
        measured = ptdp.run["measured"]["tflops_per_gpu"] / zero3.run["measured"]["tflops_per_gpu"]
        # per-GPU rate: work over step time (the same batch and GPU count in each pair)
        predicted = (ptdp.work / ptdp.predicted_step_s) / (zero3.work / zero3.predicted_step_s)
        rows.append({"id": f"A4 {ptdp.run['id'].split('-')[1]} on {ptdp.gpus} GPUs: PTD-P / ZeRO-3 per-GPU rate",
                     "error": f"measured {measured:.2f}, predicted {predicted:.2f}"
                              f" ({'same order' if (measured > 1) == (predicted > 1) else 'order reversed'})"})
    return rows


# Shares of the datasheet's rate between nodes the A4 rows are priced at again (`_a4_network_what_if`).
NETWORK_FRACTIONS = (1 / 2, 1 / 3)


def _a4_network_what_if(runs: list[dict]) -> list[dict]:
    """A4 priced again with the links between nodes at a share of their datasheet rate: a what-if,
    not the model. No published measurement gives the rate of one ring over 48-280 DGX A100 nodes
    (the 192 GB/s per node of PUBLISHED.md E4 states no node count); the paper's own figure for its
    1T run, a 12.9 TB/s effective bisection bandwidth of the data-parallel all-reduce on 384
    nodes (A3), is 67 GB/s for each node of one half, a third of eight HDR links' 200 GB/s."""
    a4 = [run for run in runs if run["table"] == "A4"]
    rows = []
    for fraction in NETWORK_FRACTIONS:
        errors: dict[str, list[str]] = {}
        for run in a4:
            _, size, scheme, _ = run["id"].split("-")  # A4-<size>-<scheme>-<gpus>
            key = f"{'ZeRO-3' if scheme == 'zero3' else 'PTD-P'} {size}"
            errors.setdefault(key, []).append(f"{price(run, network_fraction=fraction).error:+.1%}")
        rows.append({"id": f"A4 with the links between nodes at {fraction:.2f} of their rate (what-if, not the model)",
                     "error": "; ".join(f"{key} {'/'.join(values)}" for key, values in errors.items())})
    return rows


def _held_out_coverage(others: list) -> list[dict]:
    """The published runs outside the calibration set against the interval for their sizes
    (widened beyond the calibrated GPU count and data-parallel group, cost_models.uncertainty):
    how many fall inside, and which do not. Only the residual bounds are compared; a plan's
    pessimistic price (collectives beyond the measured nodes) would widen the high side further."""
    from cost_models.uncertainty import scale_widening

    inside, widened, outside = 0, 0, []
    for c in others:
        low, high, reasons = scale_widening({"gpus": c.gpus, "data_parallel_ranks": c.data_parallel_ranks})
        widened += bool(reasons)
        if low <= c.error <= high:
            inside += 1
        else:
            outside.append(f"{c.run['id']} {c.error:+.1%} ({low:+.0%}/{high:+.0%})")
    return [{"id": f"runs outside the calibration set inside their interval ({widened} widened for size)",
             "held_out_error": f"{inside} of {len(others)}"},
            {"id": "outside it (error, interval)", "held_out_error": "; ".join(outside) or "none"}]


def _run_row(c, row) -> dict:
    memory = c.run["measured"].get("memory_GiB")
    return {"id": c.run["id"], "gpus": c.gpus, "measured_s": round(c.measured_step_s, 3),
            "predicted_s": round(c.predicted_step_s, 3), "error": f"{c.error:+.1%}",
            "held_out_error": f"{row.held_out_error:+.1%}" if row else "(not in the set)",
            "factors_loo": f"{c.loo_error:+.1%}" if row else "",
            "fold_scale": f"{row.fold_scale:.2f}" if row and row.fold_scale is not None else "",
            "memory_GiB": f"{c.predicted_memory_GiB:.1f} vs {memory}" if memory else
            f"{c.predicted_memory_GiB:.1f}" + ("" if c.fits else " (over)")}


def _summary(result: Refit, calibration: list) -> list[dict]:
    """Medians overall and per table, the interval and its coverage of the held-out residuals."""
    from cost_models.uncertainty import INTERVAL_QUANTILES, coverage, held_out_coverage

    by_table = spearman_by_table(calibration)
    rows = [{"id": "median |error|, calibration rows",
             "error": f"{median_abs([r.error for r in result.rows]):.1%}",
             "held_out_error": f"{median_abs([r.held_out_error for r in result.rows]):.1%}",
             "factors_loo": f"{median_abs([c.loo_error for c in calibration]):.1%}"}]
    for table in sorted({r.table for r in result.rows}):
        members = [r for r in result.rows if r.table == table]
        rows.append({"id": f"table {table}: median |error|, Spearman",
                     "error": f"{median_abs([r.error for r in members]):.1%}, "
                              f"{by_table.get(table, float('nan')):+.2f}",
                     "held_out_error": f"{median_abs([r.held_out_error for r in members]):.1%}",
                     "factors_loo": f"{median_abs([r.shipped.loo_error for r in members]):.1%}"})
    residuals = result.held_out_residuals()
    low, high = result.interval()
    quantiles = "/".join(f"{q:.0%}" for q in INTERVAL_QUANTILES)
    rows.append({"id": f"interval: {quantiles} percentiles of the held-out residuals",
                 "held_out_error": f"{low:+.1%} / {high:+.1%}"})
    rows.append({"id": "coverage of the held-out residuals: by the interval; by one computed without the row",
                 "held_out_error": f"{coverage(residuals, low, high):.0%}; {held_out_coverage(residuals):.0%}"})
    stored = result.to_json()
    rows.append({"id": "pessimistic compute slowdown of a GPU type with no calibration row (worst table median)",
                 "held_out_error": f"{stored['uncalibrated_gpu_slowdown']:.0%}"})
    scales = [r.fold_scale for r in result.rows if r.fold_scale is not None]
    rows.append({"id": "compute time scale: all rows; folds (min-max)",
                 "held_out_error": ", ".join(f"{f} {s:.2f}" for f, s in result.compute_time_scale.items())
                                   + (f"; {min(scales):.2f}-{max(scales):.2f}" if scales else "")})
    return rows


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))

"""The cost model against published training runs (benchmarks/published/runs.yaml): predicted vs
measured step time per run (signed error: negative = predicted faster), the median |error| of
the calibration rows, rank correlation within each table, and the same after a leave-one-out
fit (benchmarks/published/compare.py says what is fitted).

    python -m benchmarks.run published
"""
from __future__ import annotations

import json

from benchmarks.published.compare import fit_compute_scale, leave_one_out, load_runs, median_abs, price, spearman_by_table


def run() -> list[dict]:
    compared = [price(run) for run in load_runs()]
    calibration = [c for c in compared if c.run["calibration"]]
    factors = leave_one_out(calibration)
    rows = []
    for c in compared:
        memory = c.run["measured"].get("memory_GiB")
        rows.append({"id": c.run["id"], "gpus": c.gpus, "measured_s": round(c.measured_step_s, 3),
                     "predicted_s": round(c.predicted_step_s, 3), "error": f"{c.error:+.1%}",
                     "loo_error": f"{c.loo_error:+.1%}" if c.run["calibration"] else "(not in the set)",
                     "memory_GiB": f"{c.predicted_memory_GiB:.1f} vs {memory}" if memory else
                     f"{c.predicted_memory_GiB:.1f}" + ("" if c.fits else " (over)")})
    by_table = spearman_by_table(calibration)
    rows.append({"id": "median |error|, calibration rows",
                 "error": f"{median_abs([c.error for c in calibration]):.1%}",
                 "loo_error": f"{median_abs([c.loo_error for c in calibration]):.1%}"})
    for table in sorted({c.run["table"] for c in calibration}):
        members = [c for c in calibration if c.run["table"] == table]
        rows.append({"id": f"table {table}: median |error|, Spearman",
                     "error": f"{median_abs([c.error for c in members]):.1%}, "
                              f"{by_table.get(table, float('nan')):+.2f}",
                     "loo_error": f"{median_abs([c.loo_error for c in members]):.1%}"})
    rows.append({"id": "fitted factors (all calibration rows)",
                 "error": ", ".join(f"{name} {value:.3f}" for name, value in factors.items())})
    rows.append({"id": "compute time scale fitted per GPU (communication as priced)",
                 "error": ", ".join(f"{gpu} {value:.3f}" for gpu, value in fit_compute_scale(calibration).items())})
    return rows


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))

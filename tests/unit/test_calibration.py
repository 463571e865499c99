"""The constants fitted to the calibration set and the prediction interval (cost_models/calibration.json,
written by benchmarks/published/refit.py): the leave-one-out fit and the interval against hand
counts, and the stored file against what its own rows give."""
from __future__ import annotations

import pytest

from benchmarks.published.compare import Comparison
from benchmarks.published.refit import (NEUTRAL, PricedRow, Refit, ScalePoint, fit_scale, fold_scales, scale_point,
                                        stale, uncalibrated_gpu_slowdown)
from cost_models.calibration import load_calibration
from cost_models.hardware import COMPUTE_TIME_SCALE, get_gpu, with_compute_scale
from cost_models.uncertainty import (RESIDUAL_HIGH, RESIDUAL_LOW, UNCALIBRATED_GPU_SLOWDOWN, coverage,
                                     held_out_coverage, interval_from_residuals, percentile)

pytestmark = pytest.mark.unit


def test_percentiles_interpolate_between_order_statistics():
    """Six residuals: the 10th percentile sits at position 0.5 (halfway from -0.3 to -0.1), the
    90th at 4.5 (halfway from 0.2 to 0.5); order of the input does not matter."""
    residuals = [0.5, -0.1, 0.0, 0.2, -0.3, 0.1]
    assert interval_from_residuals(residuals) == pytest.approx((-0.2, 0.35))
    assert percentile([0.4], 0.9) == 0.4
    assert percentile(residuals, 0.0) == -0.3 and percentile(residuals, 1.0) == 0.5


def test_coverage_in_sample_and_held_out():
    """[0, 1, 2, 3, 4] against [0.5, 3.5]: 3 of 5 inside. Held out: without 0 the interval is
    [1.3, 3.7] (0 outside), without 4 it is [0.3, 2.7] (4 outside), 1, 2 and 3 stay inside
    theirs ([0.6, 3.7], [0.3, 3.7], [0.3, 3.4]): 3 of 5."""
    residuals = [0.0, 1.0, 2.0, 3.0, 4.0]
    assert coverage(residuals, 0.5, 3.5) == pytest.approx(0.6)
    assert held_out_coverage(residuals) == pytest.approx(0.6)
    assert coverage([-0.1, 0.0, 0.1], -0.1, 0.1) == 1.0  # the bounds are inside


def test_fit_scale_is_the_least_squares_of_relative_errors():
    """One row 1 s at scale 1, +1 s per unit of scale, measured 2 s: scale 2. Two rows, measured
    2 s and 1.5 s: s - 1 = (1/4 + 0.5/2.25) / (1/4 + 1/2.25) = 0.68. Rows made exactly by
    scale 1.3 give 1.3 back; none give NEUTRAL."""
    assert fit_scale([ScalePoint(1.0, 1.0, 2.0)]) == pytest.approx(2.0)
    assert fit_scale([ScalePoint(1.0, 1.0, 2.0), ScalePoint(1.0, 1.0, 1.5)]) == pytest.approx(1.68)
    exact = [ScalePoint(a, b, a + 0.3 * b) for a, b in ((1.0, 2.0), (5.0, 0.5), (3.0, 3.0))]
    assert fit_scale(exact) == pytest.approx(1.3)
    assert fit_scale([]) == NEUTRAL


def test_each_fold_fits_without_its_row():
    """Rows 0-2 of family A: row 0's scale from rows 1 and 2, (0.5/2.25) / (1/2.25 + 1/4) = 0.32
    -> 1.32; row 1's from 0 and 2, 0.25 / 0.5 -> 1.5; row 2's from 0 and 1 -> 1.68. Row 3 is of
    no fitted family; row 4 is alone in family B, so nothing is fitted for it (1.0)."""
    points = [ScalePoint(1.0, 1.0, 2.0), ScalePoint(1.0, 1.0, 1.5), ScalePoint(2.0, 1.0, 2.0), None,
              ScalePoint(1.0, 1.0, 9.0)]
    assert fold_scales(["A", "A", "A", None, "B"], points) == [1.32, 1.5, 1.68, None, NEUTRAL]


def _comparison(run_id: str, predicted_s: float, measured_s: float) -> Comparison:
    return Comparison(run={"id": run_id, "table": "T"}, gpus=8, gpu="A100-80GB", measured_step_s=measured_s,
                      predicted_step_s=predicted_s, breakdown={"compute": predicted_s}, predicted_memory_GiB=1.0,
                      fits=True, work=1.0)


def test_a_stored_file_that_differs_from_the_refit_is_stale():
    """Two rows: r1 in sample 1.1 / 1.0 - 1 = +10%, held out at 1.2 s: +20%; r2 -10% both ways.
    The refit's own file is up to date; a residual off by 2 points, or a scale off by 0.01, names
    the row or the family."""
    rows = [PricedRow(_comparison("r1", 1.1, 1.0), _comparison("r1", 1.0, 1.0), "A100", 1.17, 1.2),
            PricedRow(_comparison("r2", 0.9, 1.0), _comparison("r2", 0.9, 1.0), None, None, 0.9)]
    result = Refit(rows, [ScalePoint(1.0, 0.1 / 0.17, 1.0), None], {"A100": 1.17})
    stored = result.to_json()
    assert stored["held_out_residuals"] == {"r1": pytest.approx(0.2), "r2": pytest.approx(-0.1)}
    assert stored["in_sample_residuals"]["r1"] == pytest.approx(0.1)
    assert stale(result, stored) == []
    stored["held_out_residuals"]["r2"] = -0.12
    stored["compute_time_scale"]["A100"] = 1.18
    problems = stale(result, stored)
    assert len(problems) == 2 and "A100" in problems[0] and problems[1].startswith("r2 held out")


def test_scale_point_is_the_secant_between_neutral_and_catalogue_prices():
    """Priced 2.0 s at scale 1 and 2.234 s at 1.17: 1.376... s per unit of scale; at a catalogue
    scale of 1 the slope is the compute-bound seconds (compute + bubble + optimizer here)."""
    def comparison(step_s: float) -> Comparison:
        return Comparison(run={}, gpus=8, gpu="A100-80GB", measured_step_s=2.5, predicted_step_s=step_s,
                          breakdown={"compute": 1.2, "bubble": 0.2, "optimizer": 0.1, "dp_comm": 0.5},
                          predicted_memory_GiB=1.0, fits=True, work=1.0)

    point = scale_point(comparison(2.234), comparison(2.0), 1.17)
    assert point == ScalePoint(2.0, pytest.approx(0.234 / 0.17), 2.5)
    assert scale_point(comparison(2.0), comparison(2.0), 1.0).slope_s == pytest.approx(1.5)


def test_with_compute_scale_swaps_the_fitted_scale():
    """Scale 1 gives the A100's lone-kernel efficiencies (matmul 0.87, attention 0.52); the
    catalogue's scale gives the catalogue's GPU; a GPU of no fitted family is left as is."""
    a100 = get_gpu("A100-80GB")
    neutral = with_compute_scale(a100, 1.0)
    assert neutral.efficiency["gemm"] == 0.87 and neutral.efficiency["attention"] == 0.52
    assert neutral.efficiency["view"] == 1.0
    assert with_compute_scale(a100, COMPUTE_TIME_SCALE["A100"]) == a100
    assert with_compute_scale(get_gpu("H100-SXM"), 2.0) == get_gpu("H100-SXM")


def test_stored_interval_is_the_percentiles_of_the_stored_residuals():
    """The interval uncertainty.py uses is recomputed from the held-out residuals in the file."""
    stored = load_calibration()
    residuals = list(stored["held_out_residuals"].values())
    assert len(residuals) >= 20
    low, high = interval_from_residuals(residuals, tuple(stored["interval_quantiles"]))
    assert (RESIDUAL_LOW, RESIDUAL_HIGH) == (pytest.approx(low, abs=1e-12), pytest.approx(high, abs=1e-12))
    assert RESIDUAL_LOW < 0 < RESIDUAL_HIGH


def test_uncalibrated_slowdown_is_the_worst_table_median_rounded_up():
    """Table A: |-0.1|, 0.2, 0.3 -> median 0.2; table B: 0.2504, -0.2506 -> median 0.2505, the
    largest, rounded up to 0.26; a median of exactly 0.25 stays 0.25."""
    tables = ["A", "A", "A", "B", "B"]
    assert uncalibrated_gpu_slowdown(tables, [-0.1, 0.2, 0.3, 0.2504, -0.2506]) == 0.26
    assert uncalibrated_gpu_slowdown(["A", "A"], [0.24, -0.26]) == 0.25


def test_stored_slowdown_follows_from_the_stored_residuals():
    stored = load_calibration()
    ids = list(stored["held_out_residuals"])
    slowdown = uncalibrated_gpu_slowdown([stored["tables"][i] for i in ids],
                                         [stored["held_out_residuals"][i] for i in ids])
    assert slowdown == stored["uncalibrated_gpu_slowdown"] == UNCALIBRATED_GPU_SLOWDOWN


def test_stored_folds_follow_from_the_stored_rows():
    """Each row's held-out scale is the fit on the other rows' stored lines, the catalogue's scale
    the fit on all of them; a held-out residual is its line at the fold's scale (the row was
    priced again there: within 1% of step time of the line), and a row of no fitted family (the
    H100s) has nothing to refit, so its held-out residual is its in-sample one."""
    stored = load_calibration()
    lines = stored["scale_lines"]
    ids = list(stored["held_out_residuals"])
    families = [lines[i]["family"] if i in lines else None for i in ids]
    points = [ScalePoint(lines[i]["neutral_s"], lines[i]["slope_s"], lines[i]["measured_s"]) if i in lines else None
              for i in ids]
    folds = fold_scales(families, points)
    assert {i: s for i, s in zip(ids, folds) if s is not None} == stored["fold_compute_time_scale"]
    for family, scale in stored["compute_time_scale"].items():
        members = [p for f, p in zip(families, points) if f == family]
        assert round(fit_scale(members), 2) == scale == COMPUTE_TIME_SCALE[family]
    for run_id, family, point, fold in zip(ids, families, points, folds):
        if family is None:
            assert stored["held_out_residuals"][run_id] == stored["in_sample_residuals"][run_id]
            continue
        on_line = (point.neutral_s + (fold - NEUTRAL) * point.slope_s) / point.measured_s - 1
        assert stored["held_out_residuals"][run_id] == pytest.approx(on_line, abs=0.01)


def test_stored_techniques_are_those_the_calibration_runs_use():
    """calibration.json's techniques (the overlaps a calibration run measured) follow from the
    calibration rows' plans; a plan using any other is priced exposed at its pessimistic value."""
    from benchmarks.published.compare import load_runs
    from benchmarks.published.refit import calibrated_techniques

    assert calibrated_techniques([run for run in load_runs() if run["calibration"]]) == \
        load_calibration()["techniques"]


def test_stored_scale_trends_follow_from_the_stored_residuals_and_sizes():
    """Each trend uncertainty.py widens with is the fit of the stored held-out residuals on the
    stored rows' sizes; the largest calibrated sizes are those of the rows."""
    from benchmarks.published.refit import scale_trends
    from cost_models.uncertainty import SCALE_TRENDS

    stored = load_calibration()
    fresh = scale_trends(stored["sizes"], stored["held_out_residuals"])
    assert fresh == stored["scale_trends"]
    for name, trend in SCALE_TRENDS.items():
        assert trend.calibrated_max == max(size[name] for size in stored["sizes"].values())
        assert trend.count == len(stored["held_out_residuals"])

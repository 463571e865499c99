"""`autopar validate`: run a compiled plan for a few steps and hold every prediction against what
each rank measured (step time, its compute / communication split, peak memory).

The ranks write their measurements (see autopar/runtime/measure.py); this module
pairs them with the report's predictions per rank (a rank's pipeline stage decides its predicted
memory) and writes validate.json, which `autopar calibrate --from` fits the cost model to.
"""
from __future__ import annotations

import json
import re
import shutil
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autopar.errors import UserError

COMM_PARTS = ("tp_comm", "cp_comm", "ep_comm", "pp_comm", "dp_comm")
COMPUTE_PARTS = ("compute", "recompute", "optimizer")


@dataclass
class RankComparison:
    """One rank: predicted and measured numbers side by side."""

    rank: int
    pp_rank: int
    predicted: dict[str, float]
    measured: dict[str, float]
    error_pct: dict[str, float] = field(default_factory=dict)


@dataclass
class Validation:
    plan: str
    world_size: int
    device: str
    steps: int
    ranks: list[RankComparison]
    time_breakdown: dict[str, float]  # predicted seconds by part (what calibration splits by)
    summary: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def error_pct(predicted: float, measured: float) -> float:
    """Signed error of the prediction relative to the measurement."""
    return 100.0 * (predicted - measured) / measured if measured else float("nan")


def pp_rank_of(plan: Any, rank: int) -> int:
    from autopar.domain.mesh import Mesh

    return Mesh.of(plan).coordinate(rank, "pp")


def predicted_for(plan: Any, estimate: dict[str, Any], pp_rank: int) -> dict[str, float]:
    breakdown = plan.predicted.time_breakdown
    detail = estimate["stage_details"][pp_rank]
    return {"step_time_s": plan.predicted.step_time_s,
            "comm_s": sum(breakdown.get(part, 0.0) for part in COMM_PARTS),
            "compute_s": sum(breakdown.get(part, 0.0) for part in COMPUTE_PARTS),
            "peak_memory_bytes": float(detail["memory_bytes"])}


def compare(plan: Any, estimate: dict[str, Any], measurements: list[dict[str, Any]], device: str,
            steps: int) -> Validation:
    ranks = []
    for measured_rank in sorted(measurements, key=lambda m: m["rank"]):
        pp_rank = pp_rank_of(plan, measured_rank["rank"])
        predicted = predicted_for(plan, estimate, pp_rank)
        measured = {"step_time_s": measured_rank["median_step_time_s"], "comm_s": measured_rank["profiled_comm_s"],
                    "compute_s": measured_rank["profiled_compute_s"],
                    "peak_memory_bytes": float(measured_rank["peak_memory_bytes"])}
        errors = {key: error_pct(predicted[key], measured[key]) for key in ("step_time_s", "peak_memory_bytes")}
        ranks.append(RankComparison(measured_rank["rank"], pp_rank, predicted, measured, errors))
    step_errors = [abs(r.error_pct["step_time_s"]) for r in ranks]
    memory_errors = [abs(r.error_pct["peak_memory_bytes"]) for r in ranks]
    measured_step = max(r.measured["step_time_s"] for r in ranks)
    summary = {"predicted_step_time_s": plan.predicted.step_time_s, "measured_step_time_s": measured_step,
               "step_time_error_pct": error_pct(plan.predicted.step_time_s, measured_step),
               "median_abs_rank_step_error_pct": statistics.median(step_errors),
               "median_abs_rank_memory_error_pct": statistics.median(memory_errors)}
    return Validation(plan=plan.summary(), world_size=plan.world_size, device=device, steps=steps, ranks=ranks,
                      time_breakdown=dict(plan.predicted.time_breakdown), summary=summary)


def validate(out_dir: str | Path, steps: int = 5, timeout_s: float | None = None) -> Validation:
    """Run ``out_dir``'s module for ``steps`` timed steps (+2 measured ones) and compare."""
    from autopar.saved import read_plan
    from autopar.report.rebuild import read_report, rebuild_report
    from autopar.runtime.local import run_local
    from autopar.runtime.generated import find_script
    from autopar.runtime.run_settings import check_plan_matches_module

    out_dir = Path(out_dir)
    plan_file = out_dir / "plan.json"
    plan = read_plan(plan_file)  # its numbers in range
    report_file = out_dir / "report.json"
    # Without a saved report the folder's own model copy (what the ranks will import) prices it.
    report = (read_report(report_file) if report_file.is_file()
              else rebuild_report(plan, out_dir / Path(plan.provenance.model_path).name, None))
    check_plan_matches_module(plan, plan_file, find_script(out_dir))  # the module's plan, before anything runs
    folder = out_dir / "measure"
    _clear_measurements(folder)
    result = run_local(out_dir, plan.world_size, steps, extra_args=["--measure-dir", str(folder.resolve())],
                       timeout_s=timeout_s, runner=("-m", "autopar.runtime.measure"))
    if not result.ok:
        where = f"rank {result.failed_rank}" if result.failed_rank is not None else "a rank"
        raise UserError(f"The validation run failed on {where} (exit {result.returncode}):\n{result.error}",
                        "fix the error above (`autopar run DIR --echo` shows every rank's output).")
    measurements = [json.loads(path.read_text()) for path in sorted(folder.glob("rank_*.json"))]
    if len(measurements) != plan.world_size:
        raise UserError(f"Only {len(measurements)} of {plan.world_size} ranks wrote measurements.",
                        "run again; if it persists, report it.")
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (gloo)"
    validation = compare(plan, report.estimate, measurements, device, steps)
    (out_dir / "validate.json").write_text(validation.to_json())
    return validation


def _clear_measurements(folder: Path) -> None:
    """Remove an earlier validation's per-rank files, and refuse a ``measure`` folder holding
    anything else: it is not autopar's to delete."""
    if not folder.exists():
        return
    foreign = ([p.name for p in folder.iterdir() if not (p.is_file() and re.fullmatch(r"rank_\d+\.json", p.name))]
               if folder.is_dir() else [folder.name])
    if foreign:
        raise UserError(f"{folder} holds files autopar did not write ({', '.join(foreign[:5])}); "
                        "validation writes its per-rank measurements there.",
                        "move them away, then validate again.")
    shutil.rmtree(folder)

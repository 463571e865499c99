"""Sweeps: one plan per point of a Hydra multirun (`autopar plan MODEL.py -m cluster.nodes=1,2,4 ...`).

The sweep goes through Hydra's sweeper and launcher (`autopar.hydra_app.multirun`): the basic
sweeper expands comma lists, range(), choice() and glob(); hydra/sweeper=optuna searches a space
for the best `sweep.objective` (cost per million tokens, tokens/s per dollar, ... under
`sweep.max_step_time_s`); hydra/launcher=joblib|submitit_local|submitit_slurm runs the points in
parallel or on a cluster. Each point is a Hydra job: its folder (hydra.sweep.dir/<job number>)
holds `.hydra/` (config and overrides), plan.json and sweep_row.json; once the sweep returns,
the rows are gathered into sweep.csv, sweep.md and a scaling plot of throughput and MFU against
GPUs (sweep.png) in hydra.sweep.dir.
"""
from __future__ import annotations

import csv
import io
import json
import math
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopar.config import SWEEP_OBJECTIVES
from autopar.errors import ConfigError, UserError

GPU_COUNT_KEYS = ("cluster.nodes", "cluster.gpus_per_node", "cluster.node_groups")
COLUMNS = ("point", "overrides", "series", "status", "gpus", "cluster", "dp", "tp", "pp", "cp", "zero_stage",
           "micro_batch_size", "num_micro_batches", "schedule", "step_time_s", "tokens_per_s", "samples_per_s",
           "mfu", "peak_memory_gib", "cost_per_million_tokens", "objective")
ROW_FILE = "sweep_row.json"


def validation_overrides(overrides: list[str]) -> list[list[str]]:
    """Override lists that together try every value of every swept key once (an interval only at
    its ends), so a typo or a value of the wrong type anywhere is caught before any point runs,
    without composing the whole product."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import IntervalSweep
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as err:
        raise ConfigError(f"Invalid sweep: {' '.join(str(err).split())}",
                          "write sweeps as key=a,b,c (or range(1,9), choice(...), interval(...) "
                          "with Optuna).") from None
    fixed = [str(o.input_line) for o in parsed if not o.is_sweep_override()]
    lists = [fixed]
    for o in parsed:
        if not o.is_sweep_override():
            continue
        key = o.get_key_element()
        sweep = o.value()
        if isinstance(sweep, IntervalSweep) and sweep.start is not None and sweep.end is not None:
            values = [_number(sweep.start), _number(sweep.end)]
        else:
            values = list(o.sweep_string_iterator())
        lists += [fixed + [f"{key}={value}"] for value in values]
    return lists


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def check_sweep(overrides: list[str]) -> None:
    """Every swept value composes, and an optimising sweeper's direction matches the objective."""
    from omegaconf import OmegaConf

    from autopar.config import compose_config

    cfg: Any = None
    for item in validation_overrides(overrides):  # at least one list: the fixed overrides
        cfg = compose_config(item, hydra=True)
    objective = cfg.sweep.objective
    if objective not in SWEEP_OBJECTIVES:
        raise ConfigError(f"sweep.objective={objective} is not an objective autopar knows.",
                          f"use one of {', '.join(SWEEP_OBJECTIVES)}.")
    direction = OmegaConf.select(cfg, "hydra.sweeper.direction", default=None)
    if isinstance(direction, str) and direction.lower() != SWEEP_OBJECTIVES[objective]:
        raise ConfigError(f"hydra.sweeper.direction={direction} would search for the worst {objective}.",
                          f"set hydra.sweeper.direction={SWEEP_OBJECTIVES[objective]}, or pick another "
                          "sweep.objective.")


def objective_value(row: dict[str, Any], objective: str, max_step_time_s: float) -> float:
    """The number a point returns to the sweeper: its objective, or the objective's worst value
    when it has no plan or misses the step-time deadline."""
    minimise = SWEEP_OBJECTIVES[objective] == "minimize"
    worst = math.inf if minimise else 0.0
    if row.get("status") != "ok" or (max_step_time_s and row["step_time_s"] > max_step_time_s):
        return worst
    if objective == "tokens_per_dollar":  # what one dollar of GPU time trains
        cost = row.get("cost_per_million_tokens")
        return 1e6 / cost if cost else worst
    value = row.get(objective)
    return float(value) if value is not None else worst


@dataclass(frozen=True)
class PlanPoint:
    """Hydra's task for one sweep point: plan it, keep plan.json and the row in the job's folder,
    return the objective. Plain data, so a launcher can pickle it to another process or machine;
    it never raises (a point without a plan is a row that says why)."""

    model_path: str
    quiet: bool = False

    def __call__(self, cfg: Any) -> float:
        from hydra.core.hydra_config import HydraConfig

        job = HydraConfig.get()
        folder = Path(job.runtime.output_dir)
        overrides = list(job.overrides.task)
        self.say(f"[{job.job.num}] {' '.join(overrides)}: planning ...")
        row = self.plan_row(cfg, folder)
        row.update(point=job.job.num, overrides=overrides)
        row["objective"] = objective_value(row, cfg.sweep.objective, cfg.sweep.max_step_time_s)
        (folder / ROW_FILE).write_text(json.dumps(row, indent=1))
        self.say(f"[{job.job.num}] {row['status']}"
                 + (f": {row['step_time_s']:.4g} s/step, {row['tokens_per_s']:,.0f} tokens/s" if row["status"] == "ok"
                    else ""))
        return row["objective"]

    def say(self, line: str) -> None:
        # A plain print: the launcher may run this point in another process, away from the CLI's console.
        if not self.quiet:
            print(line, flush=True)

    def plan_row(self, cfg: Any, folder: Path) -> dict[str, Any]:
        from autopar.specs import build_cluster
        from autopar.driver import run_plan

        try:
            cluster = build_cluster(cfg)
            result = run_plan(self.model_path, cfg, profile=_profile(self.model_path, cfg))
        except UserError as err:
            return failed_row(None, err.problem)
        except Exception as err:  # noqa: BLE001 - a bug: its traceback goes in the row, the sweep goes on
            return failed_row(None, f"internal error {type(err).__name__}: {err}", traceback.format_exc())
        except KeyboardInterrupt:
            raise
        except BaseException as err:  # noqa: BLE001 - the model file's code tried to end the process
            from autopar.user_code import describe_exit

            return failed_row(None, f"the model file's code {describe_exit(err)}; it must not end the process")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "plan.json").write_text(result.plan.to_json())
        return row_of(result.plan, cluster.price_per_gpu_hour, cluster.name)


# A sweep over clusters traces the model once per process (the basic launcher runs every point
# in this one; joblib workers each keep their own).
_PROFILES: dict[str, Any] = {}


def _profile(model_path: str, cfg: Any) -> Any:
    from omegaconf import OmegaConf

    from autopar.specs import model_kwargs
    from autopar.driver import run_profile

    key = repr((model_path, model_kwargs(cfg), cfg.train.micro_batch_size, cfg.train.precision,
                OmegaConf.select(cfg, "plan.blocks", default=None),
                OmegaConf.select(cfg, "plan.trace_every_block", default=False)))
    if key not in _PROFILES:
        _PROFILES[key] = run_profile(model_path, cfg)
    return _PROFILES[key]


def row_of(plan: Any, price_per_gpu_hour: float, cluster_name: str) -> dict[str, Any]:
    predicted = plan.predicted
    cost = (price_per_gpu_hour * plan.world_size / 3600 / predicted.tokens_per_s * 1e6
            if price_per_gpu_hour and predicted.tokens_per_s else None)
    return {"status": "ok", "gpus": plan.world_size, "cluster": cluster_name, "dp": plan.dp, "tp": plan.tp,
            "pp": plan.pp, "cp": plan.cp, "zero_stage": plan.zero_stage, "micro_batch_size": plan.micro_batch_size,
            "num_micro_batches": plan.num_micro_batches, "schedule": plan.schedule,
            "step_time_s": predicted.step_time_s, "tokens_per_s": predicted.tokens_per_s,
            "samples_per_s": predicted.samples_per_s, "mfu": predicted.mfu,
            "peak_memory_gib": predicted.peak_memory_bytes / 2**30, "cost_per_million_tokens": cost}


def failed_row(gpus: int | None, problem: str, details: str | None = None) -> dict[str, Any]:
    row = dict.fromkeys(COLUMNS)
    row.update({"status": f"no plan: {problem}", "gpus": gpus})
    if details:
        row["traceback"] = details
    return row


def run_sweep(model_path: str | Path, overrides: list[str], sweep_dir: str | Path,
              quiet: bool = False) -> list[dict[str, Any]]:
    """Check every swept value, run the sweep through Hydra (``overrides`` carry the sweeper,
    launcher and hydra.* settings; hydra.sweep.dir is set to ``sweep_dir``), then gather the
    points' rows into sweep.csv/md/png. Rows older than this sweep (a reused folder) are ignored."""
    from autopar import hydra_app

    check_sweep(overrides)
    sweep_dir = Path(sweep_dir)
    started = time.time()
    code = hydra_app.multirun(PlanPoint(str(Path(model_path).resolve()), quiet),
                              [item for item in overrides if not item.startswith("hydra.sweep.dir=")]
                              + [hydra_app.setting("hydra.sweep.dir", sweep_dir)])
    if code:
        raise UserError(f"The sweep stopped (Hydra exit {code}); see the message above.",
                        "fix the sweep's settings (launcher, sweeper) and run it again.")
    rows = gather_rows(sweep_dir, since=started - 1.0)
    write_sweep(rows, sweep_dir)
    return rows


def gather_rows(sweep_dir: Path, since: float) -> list[dict[str, Any]]:
    """The rows this sweep's jobs wrote, by job number, with the settings that vary between them."""
    rows = []
    for path in sweep_dir.rglob(ROW_FILE):
        if path.stat().st_mtime >= since:
            rows.append(json.loads(path.read_text()))
    rows.sort(key=lambda row: row["point"])
    varying = _varying_keys([row["overrides"] for row in rows])
    for row in rows:
        swept = [item for item in row["overrides"] if item.split("=", 1)[0].lstrip("+~") in varying]
        row["overrides"] = " ".join(swept)
        rest = [item for item in swept if item.split("=", 1)[0].lstrip("+~") not in GPU_COUNT_KEYS]
        row["series"] = " ".join(rest) or "plan"
    return rows


def _varying_keys(point_overrides: list[list[str]]) -> set[str]:
    values: dict[str, set[str]] = {}
    for items in point_overrides:
        for item in items:
            key, _, value = item.partition("=")
            values.setdefault(key.lstrip("+~"), set()).add(value)
    return {key for key, seen in values.items()
            if len(seen) > 1 or sum(key == i.partition("=")[0].lstrip("+~") for o in point_overrides for i in o)
            < len(point_overrides)}


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def to_csv(rows: list[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({key: _cell(row.get(key)) for key in COLUMNS})
    return buffer.getvalue()


def to_markdown(rows: list[dict[str, Any]]) -> str:
    headers = ["#", "sweep point", "GPUs", "plan", "step", "tokens/s", "MFU", "memory", "$/M tokens"]
    lines = ["# Sweep", "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        if row["status"] != "ok":
            lines.append(f"| {row['point']} | {row['overrides']} | {row['gpus'] or ''} | {row['status']} "
                         "| | | | | |")
            continue
        plan = (f"dp{row['dp']} tp{row['tp']} pp{row['pp']} cp{row['cp']} ZeRO-{row['zero_stage']} "
                f"mb {row['micro_batch_size']}×{row['num_micro_batches']}")
        rate = f"{row['tokens_per_s']:,.0f}" if row["tokens_per_s"] is not None else ""
        cost = f"{row['cost_per_million_tokens']:.3f}" if row["cost_per_million_tokens"] is not None else ""
        lines.append(f"| {row['point']} | {row['overrides']} | {row['gpus']} | {plan} | "
                     f"{row['step_time_s'] * 1e3:,.1f} ms | {rate} | {row['mfu']:.1%} | "
                     f"{row['peak_memory_gib']:.1f} GiB | {cost} |")
    lines += ["", "![scaling](sweep.png)", ""]
    return "\n".join(lines)


def write_sweep(rows: list[dict[str, Any]], out_dir: str | Path) -> dict[str, Path]:
    from autopar.report.figures import scaling_figure

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"csv": out_dir / "sweep.csv", "md": out_dir / "sweep.md", "png": out_dir / "sweep.png"}
    files["csv"].write_text(to_csv(rows))
    files["md"].write_text(to_markdown(rows))
    scaling_figure([row for row in rows if row["status"] == "ok"], files["png"])
    return files

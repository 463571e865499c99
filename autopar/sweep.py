"""Sweeps: one plan per point of a Hydra multirun (`autopar plan MODEL.py -m cluster.nodes=1,2,4 ...`).

The override list is expanded with Hydra's own sweep grammar (comma lists, range(), choice(),
glob()), as `@hydra.main` multirun would; every point is planned in this process (the model is
traced once per distinct model/train setting) and one row per point goes to sweep.csv and
sweep.md, with a scaling plot of throughput and MFU against GPUs (sweep.png). Each point's
plan.json is kept in a numbered folder, as Hydra's multirun output does.
"""
from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from autopar.errors import ConfigError, UserError

GPU_COUNT_KEYS = ("cluster.nodes", "cluster.gpus_per_node", "cluster.node_groups")
COLUMNS = ("point", "overrides", "series", "status", "gpus", "cluster", "dp", "tp", "pp", "cp", "zero_stage",
           "micro_batch_size", "num_micro_batches", "schedule", "step_time_s", "tokens_per_s", "samples_per_s",
           "mfu", "peak_memory_gib", "cost_per_million_tokens")


@dataclass(frozen=True)
class SweepPoint:
    index: int
    overrides: list[str]  # every override of this point (fixed ones included)
    swept: list[str]  # the ones that vary between points


def expand(overrides: list[str]) -> list[SweepPoint]:
    """Cartesian product of the sweep overrides, in Hydra's BasicSweeper order."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        batches = BasicSweeper.split_arguments(parsed, None)
    except HydraException as err:
        raise ConfigError(f"Invalid sweep: {' '.join(str(err).split())}",
                          "write sweeps as key=a,b,c (or range(1,9), choice(...)).") from None
    swept_keys = {o.get_key_element() for o in parsed if o.is_sweep_override()}
    points = batches[0] if batches else [[]]
    return [SweepPoint(i, list(point), [item for item in point if item.split("=", 1)[0] in swept_keys])
            for i, point in enumerate(points)]


def series_name(point: SweepPoint) -> str:
    """What distinguishes a line in the scaling plot: the swept settings other than GPU count."""
    rest = [item for item in point.swept if item.split("=", 1)[0].lstrip("+~") not in GPU_COUNT_KEYS]
    return " ".join(rest) or "plan"


def row_of(point: SweepPoint, plan: Any, price_per_gpu_hour: float, cluster_name: str) -> dict[str, Any]:
    predicted = plan.predicted
    cost = (price_per_gpu_hour * plan.world_size / 3600 / predicted.tokens_per_s * 1e6
            if price_per_gpu_hour and predicted.tokens_per_s else None)
    return {"point": point.index, "overrides": " ".join(point.swept), "series": series_name(point), "status": "ok",
            "gpus": plan.world_size, "cluster": cluster_name, "dp": plan.dp, "tp": plan.tp, "pp": plan.pp,
            "cp": plan.cp, "zero_stage": plan.zero_stage, "micro_batch_size": plan.micro_batch_size,
            "num_micro_batches": plan.num_micro_batches, "schedule": plan.schedule,
            "step_time_s": predicted.step_time_s, "tokens_per_s": predicted.tokens_per_s,
            "samples_per_s": predicted.samples_per_s, "mfu": predicted.mfu,
            "peak_memory_gib": predicted.peak_memory_bytes / 2**30, "cost_per_million_tokens": cost}


def failed_row(point: SweepPoint, gpus: int | None, error: UserError) -> dict[str, Any]:
    row = dict.fromkeys(COLUMNS)
    row.update({"point": point.index, "overrides": " ".join(point.swept), "series": series_name(point),
                "status": f"no plan: {error.problem}", "gpus": gpus})
    return row


def run_sweep(model_path: str | Path, overrides: list[str], out_dir: str | Path,
              on_point: Callable[[SweepPoint, int], None] | None = None) -> list[dict[str, Any]]:
    """Plan every point; a point without a plan (infeasible, bad pins) becomes a row saying why."""
    from autopar.config import compose_config
    from autopar.driver import build_cluster, model_kwargs, run_plan, run_profile

    out_dir = Path(out_dir)
    points = expand(overrides)
    configs = [compose_config(point.overrides) for point in points]  # every point valid before any work
    rows = []
    profiles: dict[str, Any] = {}  # a sweep over clusters traces the model once
    for point, cfg in zip(points, configs):
        if on_point is not None:
            on_point(point, len(points))
        cluster = build_cluster(cfg)
        key = repr((model_kwargs(cfg), cfg.train.micro_batch_size, cfg.train.precision,
                    OmegaConf.select(cfg, "plan.blocks", default=None)))
        try:
            if key not in profiles:
                profiles[key] = run_profile(model_path, cfg)
            result = run_plan(model_path, cfg, profile=profiles[key])
        except UserError as err:
            rows.append(failed_row(point, cluster.world_size, err))
            continue
        folder = out_dir / str(point.index)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "plan.json").write_text(result.plan.to_json())
        (folder / "overrides.txt").write_text("\n".join(point.overrides) + "\n")
        rows.append(row_of(point, result.plan, cluster.price_per_gpu_hour, cluster.name))
    write_sweep(rows, out_dir)
    return rows


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

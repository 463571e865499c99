"""Write a plan report to disk: report.json, report.md, report.html (one self-contained file),
timeline.json (Chrome trace) and the PNG figures.

Both documents come from one list of sections (headings, paragraphs, tables, images), so the
markdown and the HTML always say the same thing.
"""
from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from autopar.report.document import PlanReport
from autopar.report.figures import data_uri, loss_figure, memory_figure, time_figure
from autopar.report.timeline import chrome_trace, pp_rank_members, plan_timeline, render_png
from autopar.report.training import LOSS_FIGURE, LossCurves, loss_curves, read_run_log, summary
from autopar.report.units import format_bytes
from autopar.report.words import describe_plan, rank_cells

GRID_NODES_SHOWN = 8  # the rank grid lists the first nodes; the pattern repeats on the others
STAGE_COLOURS = ("#dbe9f6", "#fde2c8", "#d9f0d3", "#f6d5e5", "#e5dcf2", "#fff3bf", "#d0f0ef", "#eeeeee")


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]
    colours: list[list[str | None]] | None = None  # background per cell (HTML only)


@dataclass
class Image:
    file: str
    alt: str


@dataclass
class Section:
    title: str
    blocks: list[str | Table | Image] = field(default_factory=list)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 10 else f"{seconds:,.2f} s"


def _held(in_flight: float | list[float]) -> str:
    """Micro-batches held at the rank's peak: one count, or one per model chunk ("15/8/8/8")."""
    counts = in_flight if isinstance(in_flight, list) else [in_flight]
    return "/".join(f"{count:.3g}" for count in counts) if len(set(counts)) > 1 else f"{counts[0]:.3g}"


def sections(report: PlanReport) -> list[Section]:
    plan, estimate, predicted = report.plan, report.estimate, report.plan.predicted
    words: list[str | Table | Image] = list(describe_plan(report))
    result = [Section("The plan in words", words)]
    rate = (f"{predicted.tokens_per_s:,.0f} tokens/s" if predicted.tokens_per_s is not None
            else f"{predicted.samples_per_s:,.1f} samples/s")
    cost = report.cost_per_million_tokens
    solver = plan.solver
    result.append(Section("Predicted performance", [Table(["quantity", "value"], [
        ["step time", _ms(predicted.step_time_s)],
        *([["a measured step is expected in", f"{_ms(predicted.step_time_low_s)} - {_ms(predicted.step_time_high_s)}"
            + (f" (extrapolated: {'; '.join(predicted.extrapolated)})" if predicted.extrapolated else "")]]
          if predicted.step_time_high_s else []),
        ["throughput", rate],
        ["MFU (model FLOPs / peak)", f"{predicted.mfu:.1%}"],
        ["TFLOP/s per GPU", f"{estimate.get('tflops_per_gpu', 0.0):,.1f}"],
        ["peak memory (fullest rank)", format_bytes(predicted.peak_memory_bytes)],
        ["cost per million tokens", f"{cost:,.4f} (at {report.cluster.price_per_gpu_hour}/GPU-hour)" if cost
         else "set cluster.price_per_gpu_hour"],
        ["solver", f"{solver.status}, {solver.candidates:,} candidates ({solver.priced:,} priced past their floor), "
                   + (f"{report.solver_seconds:.1f} s" if report.solver_seconds is not None
                      else "search time not recorded (priced again from plan.json)")
                   + (f", gap {solver.gap:.1%}" if solver.gap else "")]])]))
    if solver.status not in ("OPTIMAL", "PINNED"):
        result[-1].blocks.insert(0, f"**Not proven optimal**: the solver stopped with status {solver.status}; "
                                    f"this is the best plan found, at most {solver.gap:.1%} from the bound"
                                    + (" (stopped by the wall-clock safety cap solver.time_limit_s: the result "
                                       "depends on the machine's load)." if solver.stopped_by == "time_limit"
                                       else " (stopped by its deterministic work limit, solver.work_limit)."))
    breakdown = predicted.time_breakdown
    total = sum(breakdown.values()) or 1.0
    result.append(Section("Where the step time goes (critical pipeline rank)", [
        Table(["part", "time", "share"], [[part, _ms(seconds), f"{seconds / total:.1%}"]
                                          for part, seconds in breakdown.items()]),
        "Communication rows are the exposed part (what overlap does not hide); bubble is the pipeline's "
        "idle time.", Image("time.png", "step time breakdown")]))
    if report.proof or report.rejected:
        result.append(proof_section(report))
    result.append(mesh_section(report))
    result.append(stages_section(report))
    simulated = plan_timeline(plan, estimate).step_time_s
    result.append(Section("Timeline of one step", [
        Image("timeline.png", "simulated timeline"),
        f"Simulated step {_ms(simulated)} against the cost model's {_ms(predicted.step_time_s)}"
        f"{_relative(simulated, predicted.step_time_s)}: the simulation plays every op in order with each rank's "
        "sends queued on its link; the planner's closed form paces the steady state by the slowest rank.",
        f"Simulated with the plan's per-stage times through the {plan.schedule} schedule; open timeline.json in "
        "Perfetto or chrome://tracing for the interactive view (one process per pipeline rank, standing for its "
        "DP × TP × CP ranks)."]))
    if report.alternatives:
        result.append(Section("Alternatives and why they lost", [Table(
            ["plan", "step time", "peak memory", "why it lost"],
            [[a.summary, _ms(a.step_time_s), format_bytes(a.peak_memory_bytes), a.reason]
             for a in report.alternatives])]))
    if report.binding:
        result.append(Section("What binds this plan", [Table(
            ["constraint", "relaxing it"], [[b.constraint, b.relaxing] for b in report.binding])]))
    result.append(assumptions_section(report))
    if report.notes:
        result.append(Section("Notes", list(report.notes)))
    return result


def proof_section(report: PlanReport) -> Section:
    """What compile ran of the generated module before writing it, and the plans it rejected."""
    blocks: list[str | Table | Image] = []
    if report.proof:
        blocks.append(f"Proven at compile: {report.proof}.")
    if report.rejected:
        blocks.append("Rejected at compile (never written; the planner moved to its next plan):")
        blocks.append(Table(["plan", "why it was rejected"], [[r.summary, r.reason] for r in report.rejected]))
    return Section("Proof at compile", blocks)


def mesh_section(report: PlanReport) -> Section:
    plan, cluster = report.plan, report.cluster
    per_node = cluster.gpus_per_node
    shown_nodes = min(cluster.nodes, GRID_NODES_SHOWN)
    cells = rank_cells(plan, per_node, limit=shown_nodes * per_node)
    axes = [axis for axis in reversed(plan.mesh_order) if plan.degree(axis) > 1] or ["dp"]
    rows: list[list[str]] = []
    colours: list[list[str | None]] = []
    for node in range(shown_nodes):
        row: list[str] = [f"node {node} ({cluster.gpu_types[node]})"]
        colour: list[str | None] = [None]
        for cell in cells[node * per_node:(node + 1) * per_node]:
            row.append(f"r{cell.rank} " + " ".join(f"{axis}{cell.coords[axis]}" for axis in axes))
            colour.append(STAGE_COLOURS[cell.coords["pp"] % len(STAGE_COLOURS)])
        rows.append(row)
        colours.append(colour)
    blocks: list[str | Table | Image] = [
        f"Mesh axes innermost (fastest links) first: {' → '.join(plan.mesh_order)}; DeviceMesh shape "
        f"{dict(zip(plan.mesh_dim_names(), plan.mesh_shape()))}. Each cell: rank and its coordinate on each "
        "axis; colour = pipeline rank.",
        Table(["node"] + [f"GPU {i}" for i in range(per_node)], rows, colours)]
    if cluster.nodes > shown_nodes:
        blocks.append(f"Nodes {shown_nodes}-{cluster.nodes - 1} repeat the pattern "
                      f"(rank r sits on node r // {per_node}).")
    return Section("Device mesh", blocks)


def stages_section(report: PlanReport) -> Section:
    details = report.estimate["stage_details"]
    members = pp_rank_members(report.plan)
    rows = []
    for detail in details:
        layers = detail["layers"]
        shown = ", ".join(layers) if len(layers) <= 4 else f"{layers[0]} … {layers[-1]}"
        breakdown = detail["memory_breakdown"]
        rows.append([str(detail["pp_rank"]), ", ".join(detail["gpu"]), f"{len(layers)}: {shown}",
                     _ms(detail["time_per_micro_batch_s"]), _held(detail["in_flight_micro_batches"]),
                     *(format_bytes(breakdown[part]) for part in ("params", "grads", "optimizer", "activations",
                                                                  "buffers")),
                     format_bytes(breakdown["optimizer_step"]) if "optimizer_step" in breakdown else "",
                     f"{format_bytes(detail['memory_bytes'])} / {format_bytes(detail['capacity_bytes'])}",
                     str(len(members.get(detail["pp_rank"], [])))])
    return Section("Pipeline stages and memory per rank", [
        Table(["PP rank", "GPU", "layers", "time / micro-batch", "in flight", "params", "grads", "optimizer",
               "activations", "buffers", "at the optimizer step", "total / usable", "ranks"], rows),
        Image("memory.png", "memory per rank")])


def assumptions_section(report: PlanReport) -> Section:
    cluster = report.cluster
    hardware = [[h["gpu"], ", ".join(f"{k} {v:,.0f}" for k, v in sorted(h["peak_tflops"].items())),
                 format_bytes(h["memory_bytes"]), f"{h['memory_bandwidth_GBps']:,.0f} GB/s",
                 ", ".join(f"{k} {v:.2f}" for k, v in h["efficiency"].items() if k != "view"),
                 f"{h['launch_overhead_us']:.0f} µs", h["source"]] for h in cluster.hardware]
    links = [[level.replace("_", " "), link["name"], f"{link['bandwidth_GBps']:,.1f} GB/s",
              f"{link['latency_us']:.1f} µs"]
             for level, link in cluster.links.items()]
    groups = [[g.axis, str(g.size), g.span, g.link, g.traffic, g.algorithm] for g in report.groups]
    blocks: list[str | Table | Image] = [
        f"Hardware numbers: {cluster.calibration}. Achievable fractions of peak per op class (efficiency) and "
        "per-op launch overhead as listed; links at their achievable (not datasheet) rate.",
        Table(["GPU", "peak TFLOP/s", "memory", "memory bandwidth", "efficiency", "launch", "source"], hardware),
        Table(["link level", "link", "bandwidth per GPU", "latency"], links)]
    if groups:
        blocks.append(Table(["group", "size", "placement", "link", "traffic", "algorithm priced"], groups))
    return Section("Cost model assumptions", blocks)


# -- markdown ---------------------------------------------------------------------------------------

def to_markdown(report: PlanReport, parts: list[Section]) -> str:
    lines = [f"# Plan report: {report.model_name} on {report.cluster.name} ({report.plan.world_size} GPUs)", ""]
    for section in parts:
        lines += [f"## {section.title}", ""]
        for block in section.blocks:
            if isinstance(block, Table):
                lines.append("| " + " | ".join(block.headers) + " |")
                lines.append("|" + "---|" * len(block.headers))
                lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in block.rows]
            elif isinstance(block, Image):
                lines.append(f"![{block.alt}]({block.file})")
            else:
                lines.append(block)
            lines.append("")
    return "\n".join(lines)


# -- HTML -----------------------------------------------------------------------------------------

STYLE = """body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1200px;\
margin:2em auto;
padding:0 1em;color:#222;line-height:1.45}h1{font-size:1.5em}h2{font-size:1.15em;border-bottom:1px solid #ddd;
padding-bottom:.2em;margin-top:1.6em}table{border-collapse:collapse;margin:.6em 0;font-size:.85em}
td,th{border:1px solid #ccc;padding:.25em .5em;text-align:left;vertical-align:top}th{background:#f4f4f4}
img{max-width:100%;border:1px solid #eee}p{margin:.4em 0}.mono{font-family:ui-monospace,Menlo,monospace}"""


def _inline(text: str) -> str:
    """Escape, then turn **bold** into <strong> (the only markup the sections use)."""
    escaped = html.escape(text)
    parts = escaped.split("**")
    return "".join(f"<strong>{part}</strong>" if i % 2 else part for i, part in enumerate(parts))


def to_html(report: PlanReport, parts: list[Section], folder: Path) -> str:
    body = [f"<h1>Plan report: {html.escape(report.model_name)} on {html.escape(report.cluster.name)} "
            f"({report.plan.world_size} GPUs)</h1>"]
    for section in parts:
        body.append(f"<h2>{html.escape(section.title)}</h2>")
        for block in section.blocks:
            if isinstance(block, Table):
                head = "".join(f"<th>{html.escape(h)}</th>" for h in block.headers)
                rows = []
                for r, row in enumerate(block.rows):
                    cells = []
                    for c, cell in enumerate(row):
                        colour = block.colours[r][c] if block.colours else None
                        style = f' style="background:{colour}"' if colour else ""
                        cells.append(f"<td{style}>{html.escape(cell)}</td>")
                    rows.append("<tr>" + "".join(cells) + "</tr>")
                body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>")
            elif isinstance(block, Image):
                body.append(f'<p><img alt="{html.escape(block.alt)}" src="{data_uri(folder / block.file)}"></p>')
            else:
                body.append(f"<p>{_inline(block)}</p>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>autopar plan: {html.escape(report.model_name)}</title><style>{STYLE}</style></head>"
            f"<body>{''.join(body)}</body></html>\n")


def _relative(value: float, reference: float) -> str:
    """' (+12.3%)': ``value`` against ``reference``; nothing where the reference is no time."""
    if not math.isfinite(reference) or reference <= 0 or not math.isfinite(value):
        return ""
    return f" ({value / reference - 1:+.1%})"


def training_section(curves: LossCurves, predicted_step_time_s: float | None) -> Section:
    """The recorded runs' loss curves (drawn into `LOSS_FIGURE`)."""
    return Section("Training run", [summary(curves, predicted_step_time_s), Image(LOSS_FIGURE, "loss curves")])


# The loss figure is written only when a run.jsonl with losses is given (see write_report).
REPORT_FILES = ("report.json", "timeline.json", "timeline.png", "memory.png", "time.png", "report.md", "report.html",
                LOSS_FIGURE)


def write_report(report: PlanReport, folder: str | Path, run_log: str | Path | None = None) -> dict[str, Path]:
    """Write every report file into `folder` (created if needed); returns name -> path. With
    ``run_log`` (a run.jsonl) holding losses, the report shows them too (`LOSS_FIGURE`)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    plan = report.plan
    timeline = plan_timeline(plan, report.estimate)
    curves = loss_curves(read_run_log(run_log)) if run_log is not None else LossCurves()
    files = {name: folder / name for name in REPORT_FILES if name != LOSS_FIGURE or curves}
    files["report.json"].write_text(report.to_json())
    trace = chrome_trace(timeline, pp_rank_members(plan), {"model": report.model_name, "cluster": report.cluster.name,
                                                           "plan": plan.summary(),
                                                           "predicted_step_time_s": plan.predicted.step_time_s})
    files["timeline.json"].write_text(json.dumps(trace))
    render_png(timeline, files["timeline.png"], f"{report.model_name}: one simulated training step, {plan.schedule}, "
                                                f"{plan.num_micro_batches} micro-batches")
    memory_figure(report.estimate["stage_details"], files["memory.png"])
    time_figure(plan.predicted.time_breakdown, files["time.png"])
    parts = sections(report)
    if curves:
        loss_figure(curves, files[LOSS_FIGURE])
        parts.insert(2, training_section(curves, plan.predicted.step_time_s))  # after the predictions
    files["report.md"].write_text(to_markdown(report, parts))
    files["report.html"].write_text(to_html(report, parts, folder))
    return files

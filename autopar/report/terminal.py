"""Rich renderings for the terminal: tables a user reads right after a command."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from autopar.model_profile import LayerProfile, ModelProfile
from autopar.report.units import format_bytes, format_count
from autopar.report.words import REAL_VALUES_WORDS
from autopar.solver.tp_coverage import coverage_notes


def collapse_repeats(layers: list[LayerProfile]) -> list[tuple[LayerProfile, LayerProfile, int]]:
    """Runs of consecutive identical layers as (first, last, count)."""
    runs: list[tuple[LayerProfile, LayerProfile, int]] = []
    for layer in layers:
        key = layer.repeat_of or layer.name
        if runs and (runs[-1][0].repeat_of or runs[-1][0].name) == key:
            first, _, count = runs[-1]
            runs[-1] = (first, layer, count + 1)
        else:
            runs.append((layer, layer, 1))
    return runs


def profile_table(profile: ModelProfile) -> Table:
    """Per layer (identical consecutive layers collapsed): params, FLOPs, saved activations."""
    table = Table(title=f"{profile.model_name}: one training step, micro-batch {profile.micro_batch_size}, "
                        f"{profile.precision}", title_justify="left")
    table.add_column("layer", overflow="fold")
    for column in ("×", "params", "fwd FLOP", "bwd FLOP", "saved activations", "output"):
        table.add_column(column, justify="right", no_wrap=True)
    for first, last, count in collapse_repeats(profile.layers):
        name = first.name if count == 1 else f"{first.name} … {last.name}"
        table.add_row(name, str(count), format_count(first.param_count), format_count(first.flops_forward),
                      format_count(first.flops_backward), format_bytes(first.activation_bytes),
                      format_bytes(first.output_bytes))
    table.add_section()
    table.add_row("total", str(len(profile.layers)), format_count(profile.param_count),
                  format_count(profile.flops_forward), format_count(profile.flops_backward),
                  format_bytes(profile.activation_bytes), "")
    return table


def print_profile(profile: ModelProfile, console: Console) -> None:
    """The profile table, then totals and the coverage report's warnings."""
    console.print(profile_table(profile))
    console.print(f"parameters {format_count(profile.param_count)} ({format_bytes(profile.param_bytes)}), "
                  f"traced in {profile.seconds:.1f} s: {profile.traced_words()}")
    if profile.copied_blocks:
        console.print("(plan.trace_every_block=true traces every block)")
    unknown = profile.uncosted_ops()
    if unknown:
        listed = ", ".join(f"{entry.op} ×{entry.count}" for entry in unknown)
        console.print(f"[yellow]warning:[/] no FLOP formula and no cost class for: {listed}; "
                      "their time is unknown to the cost model.")


def print_estimate(profile: ModelProfile, layout, estimate, console: Console) -> None:
    """Predicted step time, throughput, MFU and memory of one layout, with breakdowns."""
    console.print(f"[bold]{profile.model_name}[/]: dp={layout.dp} tp={layout.tp} pp={layout.pp} cp={layout.cp} "
                  f"ZeRO-{layout.zero_stage} micro-batch {layout.micro_batch_size} × {layout.num_micro_batches} "
                  f"{layout.schedule}{f' (v={layout.chunks})' if layout.chunks > 1 else ''}")
    rate = (f"{estimate.tokens_per_s:,.0f} tokens/s" if estimate.tokens_per_s is not None
            else f"{estimate.samples_per_s:,.1f} samples/s")
    console.print(f"step {estimate.step_time_s * 1e3:,.1f} ms, {rate}, {estimate.tflops_per_gpu:.1f} TFLOP/s per GPU, "
                  f"MFU {estimate.mfu:.1%} (HFU {estimate.hfu:.1%}), peak memory "
                  f"{format_bytes(estimate.peak_memory_bytes)}{'' if estimate.fits else ' [red](does not fit)[/]'}")
    console.print(breakdown_table("time per step",
                                  {k: f"{v * 1e3:,.1f} ms" for k, v in estimate.time_breakdown.items()}))
    console.print(breakdown_table("memory of the fullest rank",
                                  {k: format_bytes(v) for k, v in estimate.memory_breakdown.items()}))


def breakdown_table(title: str, rows: dict[str, str]) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("part")
    table.add_column("value", justify="right")
    for key, value in rows.items():
        table.add_row(key, value)
    return table


def print_plan(result, console: Console) -> None:
    """The winner, why, and the runners-up with the reason each lost."""
    plan = result.plan
    predicted = plan.predicted
    rate = (f"{predicted.tokens_per_s:,.0f} tokens/s" if predicted.tokens_per_s is not None
            else f"{predicted.samples_per_s:,.1f} samples/s")
    console.print(f"[bold green]plan[/]: {plan.summary()}  (mesh {' → '.join(plan.mesh_order)}, innermost first)")
    console.print(f"predicted step {predicted.step_time_s * 1e3:,.1f} ms, {rate}, MFU {predicted.mfu:.1%}, "
                  f"peak memory {format_bytes(predicted.peak_memory_bytes)}")
    if predicted.step_time_high_s:
        console.print(f"a measured step is expected in {predicted.step_time_low_s * 1e3:,.0f}-"
                      f"{predicted.step_time_high_s * 1e3:,.0f} ms (the cost model's spread over published runs"
                      + (f"; extrapolated: {'; '.join(predicted.extrapolated)}" if predicted.extrapolated else "")
                      + ")")
    if plan.pp > 1:
        console.print("stages: " + ", ".join(f"{len(stage)} layers" for stage in plan.stages))
    for line in coverage_notes(plan):
        console.print(line)
    if plan.data_dependent:
        console.print("value-dependent code, planned with the example batch's values; not traced exactly:")
        for line in plan.estimated:
            console.print(f"  {line}", markup=False)
    if plan.real_values:
        console.print(f"{REAL_VALUES_WORDS} ({plan.real_values}).", markup=False)
    solver = plan.solver
    console.print(f"solver {solver.status} in {solver.seconds:.1f} s ({solver.work:,.1f} work units) over "
                  f"{solver.candidates:,} candidates"
                  f"{f', gap {solver.gap:.1%}' if solver.gap else ''}")
    if solver.status not in ("OPTIMAL", "PINNED"):
        if solver.stopped_by == "time_limit":
            console.print(f"[bold yellow]not proven optimal[/]: the search stopped at its wall-clock safety cap "
                          f"with the best plan found, at most {solver.gap:.1%} slower than the bound; this result "
                          "depends on the machine's load: raise solver.time_limit_s (or lower solver.work_limit).")
        else:
            console.print(f"[bold yellow]not proven optimal[/]: the search stopped at its work limit with the best "
                          f"plan found, at most {solver.gap:.1%} slower than the bound; raise solver.work_limit to "
                          "search on.")
    for target, modules in sorted(getattr(result, "replicated_ops", {}).items()):
        console.print(f"replicated under TP: {target} in {', '.join(modules[:4])}"
                      f"{' ...' if len(modules) > 4 else ''} (no tensor-parallel split covers it)")
    for line in getattr(result, "illegal_splits", []):
        console.print(line)
    for binding in result.binding:
        console.print(f"binding: {binding.constraint} [dim]→ {binding.relaxing}[/]")
    if result.alternatives:
        table = Table(title="runners-up", title_justify="left")
        table.add_column("plan")
        table.add_column("step", justify="right")
        table.add_column("why it lost")
        for alternative in result.alternatives:
            table.add_row(alternative.plan.summary(), f"{alternative.plan.predicted.step_time_s * 1e3:,.1f} ms",
                          alternative.reason)
        console.print(table)


def print_sweep(rows: list[dict], console: Console) -> None:
    """One line per sweep point: GPUs, the plan's degrees, step time, throughput, MFU, cost."""
    table = Table(title="sweep", title_justify="left")
    for column in ("#", "point", "GPUs", "plan", "step", "tokens/s", "MFU", "memory", "$/M tokens"):
        table.add_column(column, justify="right" if column not in ("point", "plan") else "left")
    for row in rows:
        if row["status"] != "ok":
            table.add_row(str(row["point"]), row["overrides"], str(row["gpus"] or ""), f"[red]{row['status']}[/]",
                          "", "", "", "", "")
            continue
        cost = row["cost_per_million_tokens"]
        table.add_row(str(row["point"]), row["overrides"], str(row["gpus"]),
                      f"dp{row['dp']} tp{row['tp']} pp{row['pp']} cp{row['cp']} ZeRO-{row['zero_stage']}",
                      f"{row['step_time_s'] * 1e3:,.1f} ms",
                      f"{row['tokens_per_s']:,.0f}" if row["tokens_per_s"] is not None else "",
                      f"{row['mfu']:.1%}", f"{row['peak_memory_gib']:.1f} GiB", f"{cost:.3f}" if cost else "")
    console.print(table)


def print_validation(validation, console: Console) -> None:
    """Per rank: predicted vs measured step time, communication and memory, with the error."""
    table = Table(title=f"{validation.plan} on {validation.device}", title_justify="left")
    for column in ("rank", "PP", "step pred", "step meas", "err", "comm pred", "comm meas", "memory pred",
                   "memory meas", "err"):
        table.add_column(column, justify="right")
    for rank in validation.ranks:
        p, m = rank.predicted, rank.measured
        table.add_row(str(rank.rank), str(rank.pp_rank), f"{p['step_time_s'] * 1e3:,.1f} ms",
                      f"{m['step_time_s'] * 1e3:,.1f} ms", f"{rank.error_pct['step_time_s']:+.0f}%",
                      f"{p['comm_s'] * 1e3:,.1f} ms", f"{m['comm_s'] * 1e3:,.1f} ms",
                      format_bytes(p["peak_memory_bytes"]), format_bytes(m["peak_memory_bytes"]),
                      f"{rank.error_pct['peak_memory_bytes']:+.0f}%")
    console.print(table)
    summary = validation.summary
    console.print(f"step time: predicted {summary['predicted_step_time_s'] * 1e3:,.1f} ms, measured (slowest rank) "
                  f"{summary['measured_step_time_s'] * 1e3:,.1f} ms ({summary['step_time_error_pct']:+.0f}%)")

"""Rich renderings for the terminal: tables a user reads right after a command."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from autopar.profile import LayerProfile, ModelProfile
from autopar.report.units import format_bytes, format_count


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
    blocks = profile.blocks
    repeated = sum(1 for layer in blocks if layer.repeat_of)
    console.print(f"parameters {format_count(profile.param_count)} ({format_bytes(profile.param_bytes)}), "
                  f"{profile.num_nodes} graph nodes, block container '{profile.block_container}' with "
                  f"{len(blocks)} blocks ({repeated} repeats of an earlier one), traced in {profile.seconds:.1f} s")
    unknown = profile.uncosted_ops()
    if unknown:
        listed = ", ".join(f"{entry.op} ×{entry.count}" for entry in unknown)
        console.print(f"[yellow]warning:[/] no FLOP formula and no cost class for: {listed}; "
                      "their time is unknown to the cost model.")

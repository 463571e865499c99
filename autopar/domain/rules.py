"""The rules a plan's own structure obeys, each written once: the batch arithmetic, expert
parallelism carved from the data-parallel ranks, uneven shares, the mesh's axes, the pipeline's
stages and per-layer recomputation.

Every stage that holds a plan asks these, in its own terms: the pricer (`layout.validate_layout`
raises the first as a ValueError), a plan file read back (`autopar.plans.Plan.problems`), code
generation (`CodegenError`) and the planner's pins (`UserError`, naming the pin as
``plan.<field>``). A rule returns a `Problem`, what is wrong with the values and what would fix
it, or None; what a technique needs is the technique registry's (`autopar.domain.techniques`).
Plans and layouts are read by field name (dp, cp, ep, micro_batch_size, stages, ...), so a
`ParallelLayout`, a `Plan` and the planner's partial plans are all asked the same way.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.domain.vocabulary import AXES, RECOMPUTE_OPTIONS


@dataclass(frozen=True)
class Problem:
    """What makes a plan unable to run, with the values, and what would make it run."""

    problem: str
    fix: str

    def __str__(self) -> str:
        return self.problem


def batch_split(dp: int, micro_batch_size: int, num_micro_batches: int, global_batch_size: int) -> Problem | None:
    """Each step trains on the global batch: every data-parallel rank runs its micro-batches."""
    if dp * micro_batch_size * num_micro_batches == global_batch_size:
        return None
    return Problem(f"dp × micro_batch_size × num_micro_batches = {dp}×{micro_batch_size}×{num_micro_batches} = "
                   f"{dp * micro_batch_size * num_micro_batches} is not the global batch {global_batch_size} "
                   "(global_batch_size)",
                   "choose a micro-batch size and count whose product with dp is the global batch, or re-plan")


def ep_carving(ep: int, dp: int, cp: int) -> Problem | None:
    """Expert parallelism groups consecutive data- (and context-) parallel ranks: ep divides them."""
    if (dp * cp) % ep == 0:
        return None
    return Problem(f"ep={ep} must divide dp x cp = {dp * cp}: expert parallelism is carved from the data- and "
                   "context-parallel ranks",
                   "choose ep among the divisors of dp x cp, or ep=1")


def uneven_shares(shares: Sequence[int], dp: int, micro_batch_size: int, pp: int) -> Problem | None:
    """Uneven shares give each data-parallel rank its own samples per micro-batch (mixed GPU
    types); a pipeline would need another schedule per replica, so they need pp=1."""
    if not shares:
        return None
    if len(shares) != dp or sum(shares) != dp * micro_batch_size or min(shares) < 1:
        return Problem(f"dp_shares {list(shares)} must give each of the {dp} data-parallel ranks at least one sample "
                       f"and sum to dp x micro_batch_size = {dp * micro_batch_size}",
                       "give one share per data-parallel rank, or none for even shares")
    if pp > 1:
        return Problem("uneven data-parallel shares need pp=1 (each pipeline replica would run another schedule)",
                       "use even shares (dp_shares empty) with a pipeline, or pp=1")
    return None


def mesh_axes(mesh_order: Iterable[str]) -> Problem | None:
    """The mesh orders each of its axes exactly once."""
    order = [str(axis) for axis in mesh_order]
    if sorted(order) == sorted(AXES):
        return None
    return Problem(f"mesh_order {order} must order exactly the axes {', '.join(AXES)}",
                   f"list {', '.join(AXES)} once each, innermost (fastest links) first")


def stage_partition(stages: Sequence[Sequence[str]], layer_names: Sequence[str],
                    field: str = "stages") -> Problem | None:
    """Pipeline stages cut the model's layers in order: each layer in exactly one non-empty stage."""
    flat = [name for stage in stages for name in stage]
    if flat == list(layer_names) and all(stages):
        return None
    missing = [name for name in layer_names if name not in flat]
    unknown = [name for name in flat if name not in layer_names]
    detail = (f" (missing: {', '.join(missing[:3])})" if missing
              else f" (not a layer: {', '.join(unknown[:3])})" if unknown else "")
    listed = f"{layer_names[0]} ... {layer_names[-1]}" if layer_names else "none"
    return Problem(f"{field} must list every layer exactly once, in model order, in non-empty stages{detail}",
                   f"cut the layers ({listed}, as `autopar profile` lists them) into consecutive stages")


def stage_count(stages: Sequence[Sequence[str]], pp: int, chunks: int) -> Problem | None:
    """Pipeline rank r runs stages r, r + pp, ...: pp x chunks of them."""
    if len(stages) == pp * chunks:
        return None
    return Problem(f"{len(stages)} stages given for pp={pp} × chunks={chunks}",
                   "give pp x chunks stages (chunks above 1 only with interleaved_1f1b)")


def recompute_choices(recompute: Any, layer_names: Sequence[str] | None, field: str = "recompute",
                      options: Sequence[str] = RECOMPUTE_OPTIONS) -> Problem | None:
    """Recomputation is one choice for every layer, or a choice per named layer."""
    values = recompute.values() if isinstance(recompute, Mapping) else [recompute]
    unknown = sorted({str(value) for value in values} - set(options))
    if unknown:
        return Problem(f"{field} '{unknown[0]}' is not one of {', '.join(options)}",
                       f"use {', '.join(options)}")
    if isinstance(recompute, Mapping) and layer_names is not None:
        stray = sorted(set(recompute) - set(layer_names))
        if stray:
            listed = f" ({layer_names[0]} ... {layer_names[-1]})" if layer_names else ""
            return Problem(f"{field} names unknown layers: {', '.join(stray[:3])}",
                           f"use layer names from `autopar profile`{listed}")
    return None


def structure_problems(plan: Any, layer_names: Sequence[str] | None, global_batch_size: int,
                       recompute_options: Sequence[str] = RECOMPUTE_OPTIONS,
                       stages_listed: bool = False) -> list[Problem]:
    """Every rule above that `plan` breaks, in the order a reader would fix them (mesh, expert
    groups, shares, batch, stages, recomputation). `layer_names` None: the layers are unknown, so
    the stages are not checked against them. `stages_listed`: the plan must list its stages even
    at pp=1 (a plan file does; a layout without them is split evenly)."""
    found = [mesh_axes(plan.mesh_order), ep_carving(plan.ep, plan.dp, plan.cp),
             uneven_shares(tuple(plan.dp_shares or ()), plan.dp, plan.micro_batch_size, plan.pp),
             batch_split(plan.dp, plan.micro_batch_size, plan.num_micro_batches, global_batch_size)]
    if plan.stages:
        found.append(stage_count(plan.stages, plan.pp, plan.chunks))
    if (plan.stages or stages_listed) and layer_names is not None:
        found.append(stage_partition(plan.stages, layer_names))
    found.append(recompute_choices(plan.recompute, layer_names, options=recompute_options))
    return [problem for problem in found if problem]

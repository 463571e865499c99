"""How much of a model a tensor-parallel plan actually splits.

Legality analysis (`autopar.solver.tp_legality`) keeps splits the model's code cannot run out of
the search, and the search replicates what is cheaper whole; on some ways of writing a model
that leaves almost every linear layer replicated, so ``tp`` ranks compute the same step ``tp``
times. The coverage says so: the share of the blocks' linear parameters the plan shards, and
of their forward FLOPs, with each replicated linear module and why. A pinned ``plan.tp`` under
which less than half of the linear parameters can split is refused (`check_pinned_coverage`):
the model's code keeps them whole (the legality rules), whatever the cluster. A plan that could
split more but found replicating faster on the cluster's links is not refused; its share says so.

The blocks are the profile's block layers (every layer where a model has none); a *linear
module* is one a GEMM of which reads a weight (`cost_models.tp_layout.ModuleTree`), GPT-2's
Conv1D and ``nn.MultiheadAttention`` included, so what legality refuses still counts; so is a
module named ``experts`` (the expert-parallel contract: stacked feed-forward weights), which
tensor parallelism splits under expert TP only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autopar.errors import UserError
from autopar.model_profile import inside, inside_any
from cost_models.tp_layout import ModuleTree

if TYPE_CHECKING:
    from autopar.model_profile import ModelProfile
    from autopar.solver.tp_legality import IllegalSplit

# A key/value projection computed by group holds its weight split by rows like a column-parallel
# one (autopar.solver.tp_kv_groups); its work divides by the key/value heads, not by tp.
SPLIT = ("colwise", "rowwise", "kv_group")
MIN_PINNED_SHARE = 0.5  # a pinned tp under which less of the linear parameters can split is refused
FASTER_WHOLE = "the search found it faster whole on this cluster: its split communicates more than it saves"
NO_EXPERT_TP = "experts are split by tensor parallelism only under expert TP (plan.expert_tp)"


@dataclass(frozen=True)
class TPCoverage:
    """What a plan's tensor parallelism splits of the blocks (see the module docstring).

    Attributes:
        tp: the degree.
        linear_params: parameters of the blocks' linear modules (every block counted).
        split_params: of those, the ones the plan shards (a row-parallel bias stays whole).
        refused_params: of those, the ones of modules the legality rules keep whole.
        flops: forward FLOPs of the blocks, per micro-batch.
        split_flops: of those, the ones that run sharded (divided by tp).
        replicated: a linear module left whole (named in the first block of its kind) -> why.
    """

    tp: int
    linear_params: int = 0
    split_params: int = 0
    refused_params: int = 0
    flops: float = 0.0
    split_flops: float = 0.0
    replicated: dict[str, str] = field(default_factory=dict)

    @property
    def param_share(self) -> float | None:
        return self.split_params / self.linear_params if self.linear_params else None

    @property
    def splittable_share(self) -> float | None:
        """The share of the linear parameters the legality rules let split."""
        return 1 - self.refused_params / self.linear_params if self.linear_params else None

    @property
    def refused(self) -> dict[str, str]:
        """Replicated modules the legality rules keep whole, and why."""
        return {module: why for module, why in self.replicated.items() if why not in (FASTER_WHOLE, NO_EXPERT_TP)}

    @property
    def flop_share(self) -> float | None:
        return self.split_flops / self.flops if self.flops else None

    def summary(self) -> str:
        return coverage_line(self.tp, self.param_share, self.flop_share)


def coverage_line(tp: int, param_share: float | None, flop_share: float | None) -> str:
    """One line: ``tensor parallel (tp=2) splits 75% of the blocks' linear parameters, 69% of
    their forward FLOPs``."""
    if param_share is None:
        return f"tensor parallel (tp={tp}): the blocks hold no linear layer to split"
    flops = f", {flop_share:.0%} of their forward FLOPs" if flop_share is not None else ""
    return f"tensor parallel (tp={tp}) splits {param_share:.0%} of the blocks' linear parameters{flops}"


def coverage_notes(plan: Any) -> list[str]:
    """The report's lines on the plan's TP coverage and its fused projections (none without TP or in
    an older plan file)."""
    predicted = plan.predicted
    if plan.tp <= 1 or predicted.tp_param_share is None:
        return []
    notes = [coverage_line(plan.tp, predicted.tp_param_share, predicted.tp_flop_share) + "."]
    fused = getattr(plan, "tp_fused", {})
    if fused:
        kinds = sorted({module.rsplit(".", 1)[-1] + " " + str(parts) for module, parts in fused.items()})
        notes.append(f"{len(fused)} fused projections split as their parts, each rank holding its share of every "
                     f"part ({', '.join(kinds)}).")
    return notes


def tp_coverage(profile: "ModelProfile", styles: dict[str, str], tp: int,
                illegal: dict[str, "IllegalSplit"] | None = None, sharded_ops: dict[str, set[str]] | None = None,
                tree: ModuleTree | None = None, expert_tp: bool = False) -> TPCoverage:
    """The coverage of ``styles`` (module FQN -> style, as plan.tp_styles) at degree ``tp``.

    Args:
        illegal: module (of a layer kind) -> why legality refused its split, for the reasons.
        sharded_ops: layer kind -> names of its forward ops the ILP runs sharded; without it a
            block's FLOPs count as split where they are GEMMs of split modules.
        tree: the profile's module tree (built when not given).
        expert_tp: the plan splits each expert's width over the TP group.
    """
    if tp <= 1:
        return TPCoverage(tp)
    tree = tree or ModuleTree.of_profile(profile)
    illegal = illegal or {}
    layers = [layer for layer in profile.layers if layer.is_block] or list(profile.layers)
    counts: dict[str, int] = {}
    for layer in layers:
        kind = layer.repeat_of or layer.name
        counts[kind] = counts.get(kind, 0) + 1
    linear_params = split_params = refused_params = 0
    flops = split_flops = 0.0
    replicated: dict[str, str] = {}
    ops_of: dict[str, list] = {}
    for op in profile.ops:
        if op.layer in counts:
            ops_of.setdefault(op.layer, []).append(op)
    for kind, count in counts.items():
        modules = sorted(name for name, what in tree.kinds.items() if inside(name, kind)
                         and (what == "linear" or name.rpartition(".")[2] == "experts"))
        modules = [m for m in modules if not any(inside(m, other) and m != other for other in modules)]
        for module in modules:
            experts = module.rpartition(".")[2] == "experts"
            style = ("colwise" if expert_tp else "replicate") if experts else styles.get(module, "replicate")
            params = _params_under(profile, module)
            linear_params += count * sum(params.values())
            if style in SPLIT:
                split_params += count * sum(size for name, size in params.items()
                                            if not (style == "rowwise" and name == f"{module}.bias"))
            elif params:
                # Experts are split by expert TP, not by a parallel style (the class rule's say on
                # them is no refusal).
                refused = module in illegal and not experts
                replicated[module] = illegal[module].reason if refused else NO_EXPERT_TP if experts \
                    else FASTER_WHOLE
                refused_params += count * sum(params.values()) if refused else 0
        sharded = (sharded_ops or {}).get(kind)
        split_experts = [m for m in modules if expert_tp and m.rpartition(".")[2] == "experts"]
        for op in ops_of.get(kind, []):
            if op.phase != "forward" or op.op_class == "view":
                continue
            flops += count * op.flops
            if inside_any(op.module or "", split_experts):
                split_flops += count * op.flops  # each expert's width over the TP group
            elif sharded is not None:
                split_flops += count * op.flops if op.name in sharded else 0
            elif op.op_class == "gemm" and styles.get(op.module or "", "replicate") in SPLIT:
                split_flops += count * op.flops
    return TPCoverage(tp, linear_params, split_params, refused_params, flops, split_flops, replicated)


def _params_under(profile: "ModelProfile", module: str) -> dict[str, int]:
    return {name: math.prod(shape) for name, shape in profile.param_shapes.items()
            if name.startswith(module + ".")}


class TPCoverageError(UserError):
    """A pinned tensor-parallel degree that splits too little; carries the coverage it found."""

    def __init__(self, coverage: TPCoverage, problem: str, fix: str):
        super().__init__(problem, fix)
        self.coverage = coverage


def check_pinned_coverage(coverage: TPCoverage) -> None:
    """Refuse a pinned tensor-parallel degree under which the model's code lets less than half of
    the blocks' linear parameters split: the plan would spend ``tp`` ranks on a mostly
    replicated step, whatever the cluster."""
    share = coverage.splittable_share
    if share is None or share >= MIN_PINNED_SHARE:
        return
    by_reason: dict[str, list[str]] = {}
    for module, why in coverage.refused.items():
        by_reason.setdefault(why, []).append(module)
    groups = [f"{', '.join(modules)} ({why})" for why, modules in by_reason.items()]
    listed = "; ".join(groups[:5]) + (f"; and {len(groups) - 5} more" if len(groups) > 5 else "")
    percent = math.floor(share * 100)  # 49.8% is under half: never shown as 50%
    raise TPCoverageError(
        coverage,
        f"plan.tp={coverage.tp} is pinned, but tensor parallelism could split at most {percent}% of the blocks' "
        f"linear parameters (the model's code keeps {coverage.refused_params:,} of {coverage.linear_params:,} whole); "
        f"those run replicated on every tensor-parallel rank, {coverage.tp} GPUs computing what one would. "
        f"Left replicated (named in the first block of each kind): {listed}.",
        "pin a smaller plan.tp (or leave plan.tp unset for the planner to choose), or spend those GPUs on data "
        "parallelism (plan.dp); or write these modules as plain linear layers whose outputs the model's code "
        "reads by its own sizes.")

"""The plan in sentences and the rank grid: which rank holds which coordinate and which layers.

Coordinates and groups come from `autopar.domain.mesh.Mesh` (rank order innermost axis first,
`Plan.mesh_order`); a group along an axis is the ranks differing only there.
"""
from __future__ import annotations

from dataclasses import dataclass

from autopar.plans import Plan
from autopar.report.document import AXIS_NAMES, PlanReport
from autopar.report.units import format_count
from cost_models.host import dtensor_modules, host_s
from autopar.domain.mesh import Mesh
from autopar.domain.vocabulary import Recompute

REAL_VALUES_WORDS = ("Traced with real tensors: fake tensors cannot run this model, so it was built for real and its "
                     "step traced on one micro-batch of the example batch (its values baked in); compile's proof "
                     "runs it only for real, on local ranks against one process")
ZERO_WORDS = {0: "Every DP rank keeps full parameters, gradients and optimizer states (DDP)",
              1: "Optimizer states sharded over the DP ranks (ZeRO-1)",
              2: "Optimizer states and gradients sharded over the DP ranks (ZeRO-2)",
              3: "Parameters, gradients and optimizer states sharded over the DP ranks (ZeRO-3 / FSDP)"}


@dataclass(frozen=True)
class RankCell:
    """One rank in the grid: node, local index, mesh coordinate and the layers it holds."""

    rank: int
    node: int
    local: int
    coords: dict[str, int]
    layers: str


def coordinate(plan: Plan, rank: int) -> dict[str, int]:
    return Mesh.of(plan).coordinates(rank)


def layer_span(layers: list[str]) -> str:
    """'blocks.0 … blocks.9 (10 layers)' or the names when few."""
    if len(layers) <= 3:
        return ", ".join(layers)
    return f"{layers[0]} … {layers[-1]} ({len(layers)} layers)"


def pp_rank_layers(plan: Plan) -> list[list[str]]:
    """Layers each pipeline rank holds (all its virtual stages)."""
    held: list[list[str]] = [[] for _ in range(plan.pp)]
    stages = plan.stages or [plan.layer_names]
    for j, stage in enumerate(stages):
        held[j % plan.pp].extend(stage)
    return held


def rank_cells(plan: Plan, gpus_per_node: int, limit: int | None = None) -> list[RankCell]:
    held = [layer_span(layers) for layers in pp_rank_layers(plan)]
    count = plan.world_size if limit is None else min(limit, plan.world_size)
    cells = []
    for rank in range(count):
        coords = coordinate(plan, rank)
        cells.append(RankCell(rank, rank // gpus_per_node, rank % gpus_per_node, coords, held[coords["pp"]]))
    return cells


def group_nodes(plan: Plan, axis: str, gpus_per_node: int) -> list[int]:
    """Nodes the group through rank 0 along `axis` touches."""
    return Mesh.of(plan).nodes_of(axis, gpus_per_node)


def _tensor_parallel_words(plan: Plan) -> str:
    """What TP does: a plan whose modules all stay replicated splits no matrix (every TP rank
    computes the whole layer), which the sentence must not claim."""
    if any(style != "replicate" for style in plan.tp_styles.values()):
        return "tensor-parallel: each layer's matrices split across the group"
    if plan.sequence_parallel:
        return ("tensor-parallel: no matrix split (every module replicated); norms and residuals run on "
                "each rank's slice of the sequence, gathered into each block")
    return "tensor-parallel: no matrix split (every module replicated, each rank computes the whole layer)"


def node_range(nodes: list[int]) -> str:
    if len(nodes) == 1:
        return f"node {nodes[0]}"
    if nodes == list(range(nodes[0], nodes[-1] + 1)):
        return f"nodes {nodes[0]}-{nodes[-1]}"
    return "nodes " + ", ".join(map(str, nodes[:6])) + (", ..." if len(nodes) > 6 else "")


def describe_axes(plan: Plan, gpus_per_node: int) -> list[str]:
    """One sentence per parallel axis, innermost first, saying where its groups sit."""
    sentences = []
    for axis in plan.mesh_order:
        degree = plan.degree(axis)
        if degree == 1:
            continue
        nodes = group_nodes(plan, axis, gpus_per_node)
        where = ("inside each node" if len(nodes) == 1 and plan.world_size > gpus_per_node
                 else "inside the node" if len(nodes) == 1 else f"across {node_range(nodes)}"
                 + (" (and likewise for the other groups)" if plan.world_size // gpus_per_node > len(nodes) else ""))
        members = ", ".join(map(str, Mesh.of(plan).group_ranks(axis)[:4])) + (", ..." if degree > 4 else "")
        what = {"tp": _tensor_parallel_words(plan),
                "cp": f"context-parallel: the sequence split across the group ({plan.cp_strategy})",
                "pp": "pipeline-parallel: consecutive layers on consecutive ranks of the group",
                "dp": "data-parallel: each group member trains on its own share of the batch"}[axis]
        sentences.append(f"{AXIS_NAMES[axis]} {degree} {where}: {what} (rank 0's group: ranks {members}).")
    return sentences


def host_dispatch_words(plan: Plan) -> str:
    """What tensor parallelism costs the host: each split module dispatches through DTensor in
    Python, a floor under its layer's compute that GPU speed does not lower (cost_models.host);
    "" when no module is split."""
    modules = dtensor_modules(plan.tp_styles) if plan.tp > 1 else 0
    if not modules:
        return ""
    norms = " (and more for the norms sequence parallelism runs on DTensors)" if plan.sequence_parallel else ""
    return (f"Host dispatch: {modules} split modules run on DTensors, about {host_s(modules) * 1e3:,.0f} ms of "
            f"Python dispatch per micro-batch (forward and backward){norms}; their layers are priced no faster "
            "than that.")


def describe_plan(report: PlanReport) -> list[str]:
    """The plan in words, one short paragraph per decision."""
    plan, cluster = report.plan, report.cluster
    gpus = plan.world_size
    kinds = sorted(set(cluster.gpu_types))
    lines = [f"{report.model_name} ({format_count(report.param_count)} parameters) on {cluster.nodes} node(s) × "
             f"{cluster.gpus_per_node} {' + '.join(kinds)} = {gpus} GPUs: {plan.summary()}."]
    if gpus == 1:
        lines.append("One GPU: no parallelism.")
    lines += describe_axes(plan, cluster.gpus_per_node)
    if plan.dp * plan.cp > 1:
        lines.append(ZERO_WORDS[plan.zero_stage] + (", replicated across nodes (hybrid sharding)"
                                                    if plan.hybrid_shard else "") +
                     f"; gradients synchronised with {plan.dp_sync}.")
    if plan.pp > 1:
        sizes = [len(stage) for stage in plan.stages]
        lines.append(f"Pipeline schedule {plan.schedule}" + (f" with {plan.chunks} chunks per rank" if plan.chunks > 1
                                                             else "")
                     + f": {plan.num_micro_batches} micro-batches of {plan.micro_batch_size}; stage sizes "
                     f"{', '.join(map(str, sizes))} layers.")
    else:
        lines.append(f"{plan.num_micro_batches} micro-batch(es) of {plan.micro_batch_size} per DP rank per step"
                     + (" (gradient accumulation)." if plan.num_micro_batches > 1 else "."))
    if plan.sequence_parallel:
        lines.append("Sequence parallelism: norms, dropout and residuals run on 1/tp of the sequence inside TP "
                     "groups.")
    if plan.token_loss:
        lines.append("Token-level loss: the loss is a mean over the tokens it counts (ignored labels left out), so "
                     "each micro-batch's mean is weighed by its count and the counts are all-reduced once per step: "
                     "the gradients and logged loss are those of the mean over the whole batch.")
    if plan.data_dependent:
        lines.append("Value-dependent code (sizes or branches that depend on tensor values) was planned with the "
                     "example batch's values; estimated rather than traced: "
                     + ("; ".join(plan.estimated) if plan.estimated else "nothing") + ".")
    if plan.real_values:
        lines.append(f"{REAL_VALUES_WORDS} ({plan.real_values}).")
    if host := host_dispatch_words(plan):
        lines.append(host)
    recomputed = {option: sum(1 for value in plan.recompute.values() if value == option)
                  for option in (Recompute.SELECTIVE, Recompute.FULL)}
    if any(recomputed.values()):
        lines.append("Activation recomputation: " + ", ".join(f"{count} layers {option}"
                                                               for option, count in recomputed.items() if count) + ".")
    return lines

"""The plan report's content: everything a user needs to decide whether to trust a plan.

`PlanReport` is plain data (saved as report.json beside plan.json) so `autopar report` can render
it again without tracing or solving; `build_report` assembles it from the planner's result, and
`autopar.report.rebuild` re-prices a bare plan.json from its provenance (model file, settings, cluster).
Renderers (markdown, HTML, terminal) only read this structure.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from autopar.plans import MeshAxis, Plan
from autopar.serialize import FieldError, from_jsonable, to_jsonable
from autopar.solver.tp_coverage import coverage_notes
from cost_models.collectives import Collective, best_algorithm
from cost_models.step import Estimate, PlanPricer
from cost_models.topology import ClusterSpec
from autopar.domain.vocabulary import CPStrategy

AXIS_NAMES = {"tp": "TP", "cp": "CP", "pp": "PP", "dp": "DP"}


@dataclass(frozen=True)
class AlternativeRow:
    """A runner-up: its one-line summary, predicted speed and why it lost."""

    summary: str
    step_time_s: float
    tokens_per_s: float | None
    peak_memory_bytes: int
    reason: str


@dataclass(frozen=True)
class RejectedPlan:
    """A plan compile's proof rejected (autopar/runtime/proof.py): its summary and the one-line
    reason (the exception's last line, or how its losses differ from one process)."""

    summary: str
    reason: str
    ran: bool = True  # False: code generation refused it, nothing ran
    differs: bool = False  # it ran and trained something else than one process
    blamed: str = ""  # the way of splitting the check blamed, in words (autopar/runtime/blame.py), if any


@dataclass(frozen=True)
class BindingRow:
    """A limit shaping the plan and what relaxing it would buy."""

    constraint: str
    relaxing: str


@dataclass(frozen=True)
class GroupRow:
    """One parallel axis's process group: where it sits and how it communicates."""

    axis: str
    size: int
    span: str  # "inside one node" or "across N nodes (k per node)"
    link: str
    traffic: str  # what the group exchanges
    algorithm: str


@dataclass(frozen=True)
class ClusterFacts:
    """The cluster as the report describes it."""

    name: str
    nodes: int
    gpus_per_node: int
    gpu_types: list[str]
    memory_bytes_per_gpu: list[int]
    price_per_gpu_hour: float
    calibration: str
    hardware: list[dict[str, Any]]  # one entry per GPU type: peaks, bandwidth, efficiency, source
    links: dict[str, dict[str, Any]]  # intra / inter: bandwidth, latency, name


@dataclass
class PlanReport:
    """Everything the report shows, renderer-independent."""

    plan: Plan
    model_name: str
    param_count: int
    cluster: ClusterFacts
    estimate: dict[str, Any]
    alternatives: list[AlternativeRow] = field(default_factory=list)
    binding: list[BindingRow] = field(default_factory=list)
    groups: list[GroupRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # What compile's proof ran on this plan (empty when no compile proved it: `autopar plan
    # --report`, `autopar report`), and the plans it rejected before this one.
    proof: str = ""
    rejected: list[RejectedPlan] = field(default_factory=list)
    # The search's wall time; None when the report was rebuilt from plan.json, which keeps no
    # wall time so that it stays byte-stable.
    solver_seconds: float | None = 0.0

    def to_json(self) -> str:
        return json.dumps(to_jsonable(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "PlanReport":
        """The report a report.json holds; `FieldError` names a value that does not fit its field
        (the estimate, kept as a dict, is checked against `Estimate` as well)."""
        report = from_jsonable(cls, json.loads(text))
        try:
            from_jsonable(Estimate, report.estimate)
        except FieldError as err:
            raise FieldError(f"estimate.{err.path}" if err.path else "estimate", err.problem) from None
        return report

    @property
    def cost_per_million_tokens(self) -> float | None:
        """Cluster price of training on a million tokens at the predicted rate."""
        rate = self.plan.predicted.tokens_per_s
        if not rate or not self.cluster.price_per_gpu_hour:
            return None
        return self.cluster.price_per_gpu_hour * self.plan.world_size / 3600 / rate * 1e6


def build_report(plan: Plan, estimate: Estimate, pricer: PlanPricer, alternatives: Sequence[Any] = (),
                 binding: Sequence[Any] = (), notes: Sequence[str] = ()) -> PlanReport:
    """Assemble the report of a priced plan (alternatives/binding: the planner's explanations)."""
    profile, cluster = pricer.profile, pricer.cluster
    return PlanReport(
        plan=plan, model_name=profile.model_name, param_count=profile.param_count,
        cluster=cluster_facts(cluster), estimate=estimate.to_dict(),
        alternatives=[AlternativeRow(a.plan.summary(), a.plan.predicted.step_time_s, a.plan.predicted.tokens_per_s,
                                     a.plan.predicted.peak_memory_bytes, a.reason) for a in alternatives],
        binding=[BindingRow(b.constraint, b.relaxing) for b in binding],
        groups=process_groups(plan, estimate, pricer),
        notes=coverage_notes(plan) + list(notes) + uncosted_notes(profile) + sequence_notes(profile),
        solver_seconds=plan.solver.seconds)


def cluster_facts(cluster: ClusterSpec) -> ClusterFacts:
    hardware = []
    for gpu in {g.name: g for g in cluster.node_gpus}.values():
        hardware.append({"gpu": gpu.name, "peak_tflops": {k: v / 1e12 for k, v in gpu.peak_flops.items()},
                         "memory_bytes": gpu.memory_bytes, "memory_bandwidth_GBps": gpu.memory_bandwidth_Bps / 1e9,
                         "intra_node_link": gpu.intra_node_link, "efficiency": dict(gpu.efficiency),
                         "launch_overhead_us": gpu.launch_overhead_s * 1e6, "source": gpu.source})
    links = {level: {"name": link.name, "bandwidth_GBps": link.bandwidth_Bps / 1e9, "latency_us": link.latency_s * 1e6}
             for level, link in (("intra_node", cluster.intra), ("inter_node", cluster.inter))}
    return ClusterFacts(name=cluster.name, nodes=cluster.nodes, gpus_per_node=cluster.gpus_per_node,
                        gpu_types=[g.name for g in cluster.node_gpus],
                        memory_bytes_per_gpu=[g.memory_bytes for g in cluster.node_gpus],
                        price_per_gpu_hour=cluster.price_per_gpu_hour, calibration=cluster.calibration,
                        hardware=hardware, links=links)


def process_groups(plan: Plan, estimate: Estimate, pricer: PlanPricer) -> list[GroupRow]:
    """Per parallel axis (degree > 1): its placement, link and the collective algorithm priced."""
    layout = plan.layout()
    layers = pricer.profile.layers
    block = max(layers, key=lambda layer: layer.param_count)
    activation = block.output_bytes * plan.micro_batch_size / max(1, pricer.profile.micro_batch_size)
    rows = []
    for axis in plan.mesh_order:
        size = plan.degree(axis)
        if size == 1:
            continue
        placement = pricer.groups.placement(layout, axis)
        span = ("inside one node" if not placement.crosses_nodes
                else f"across {placement.nodes} nodes ({placement.per_node} per node)")
        link = placement.link.name if not placement.crosses_nodes else placement.ring_link.name
        if axis == MeshAxis.TP:
            nbytes = activation / plan.cp
            op = Collective.REDUCE_SCATTER if plan.sequence_parallel else Collective.ALL_REDUCE
            algorithm = best_algorithm(op, nbytes, placement).algorithm.value
            traffic = (f"{'reduce-scatter + all-gather' if plan.sequence_parallel else 'all-reduce'} of "
                       f"activations, ~{nbytes / 2**20:.1f} MiB per collective")
        elif axis == MeshAxis.CP:
            ulysses = plan.cp_strategy == CPStrategy.ULYSSES
            algorithm = "all-to-all (pairwise)" if ulysses else "ring send/recv of K/V blocks"
            traffic = ("heads <-> sequence all-to-all before and after attention" if ulysses
                       else "K/V blocks passed around the ring, overlapped with attention")
        elif axis == MeshAxis.PP:
            algorithm = "point-to-point send/recv"
            traffic = f"activations forward, gradients back, ~{activation / plan.tp / plan.cp / 2**20:.1f} MiB each"
        else:
            algorithm = estimate.dp_sync_algorithm
            traffic = {0: "gradient all-reduce", 1: "gradient all-reduce, optimizer states sharded",
                       2: "gradient reduce-scatter, parameter all-gather after the step",
                       3: "parameter all-gather per layer, gradient reduce-scatter"}[plan.zero_stage]
        rows.append(GroupRow(AXIS_NAMES[axis], size, span, link, traffic, algorithm))
    return rows


def replication_notes(replicated: dict[str, list[str]], tp: int) -> list[str]:
    """One note per op that tensor parallelism could not split (from the planner's result)."""
    notes = []
    for target, modules in sorted(replicated.items()):
        shown = ", ".join(modules[:6]) + (f" and {len(modules) - 6} more" if len(modules) > 6 else "")
        notes.append(f"{target} is replicated on every rank of the TP group (tp={tp}) in {shown}: no "
                     "tensor-parallel split covers it (it needs whole activations), so the operator-wise ILP "
                     "fell back to replicating it and pays for gathering its input.")
    return notes


def sequence_notes(profile: Any) -> list[str]:
    """Why context parallelism was never considered, naming the op that decided it."""
    mixers = getattr(profile, "sequence_mixers", [])
    if not mixers:
        return []
    more = f" (and {len(mixers) - 1} more such ops)" if len(mixers) > 1 else ""
    return [f"Context parallelism was not considered: the model would compute something else on a sequence "
            f"shard: {mixers[0]}{more}."]


def uncosted_notes(profile: Any) -> list[str]:
    unknown = profile.uncosted_ops()
    if not unknown:
        return []
    listed = ", ".join(f"{entry.op} ×{entry.count}" for entry in unknown[:8])
    return [f"ops without a FLOP formula or cost class (priced as zero time): {listed}"]


def save_report(report: PlanReport, path: str | Path) -> None:
    Path(path).write_text(report.to_json())


def load_report(path: str | Path) -> PlanReport:
    return PlanReport.from_json(Path(path).read_text())

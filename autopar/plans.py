"""Plan: the single source of truth after solving, read by codegen, report and run.

A plan serialises to JSON (`to_json` / `from_json`, lossless) so it can be replayed without
solving again; `provenance` records what it was made from (model file hash, cluster, versions)
so a stale plan is detected.

Mesh axes are named by `MeshAxis` and listed innermost (fastest links) to outermost in
`mesh_order`; where each rank sits is `autopar.domain.mesh.Mesh`'s arithmetic. The vocabulary
(`MeshAxis`, `Schedule`, `Recompute`, `ZeroStage`, `DPSync`, `CPStrategy`) is the cost model's
(`autopar.domain.layout`), so the search, the pricer, this file and codegen spell a choice one way;
`layout()` gives the frozen `ParallelLayout` the pricer reads.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from autopar.serialize import TRANSIENT, from_jsonable, to_jsonable, upgrade_block_containers
from autopar.domain.bounds import Bound, out_of_range
from autopar.domain.layout import ParallelLayout
from autopar.domain.vocabulary import (DP_BUCKET_BYTES, RUNTIME_CHOICES, CPStrategy, DPSync, MeshAxis, Recompute,
                                       Schedule, TPStyle, ZeroStage, unknown_choices)
from autopar.domain.rules import structure_problems

# The largest cluster the search handles in bounded time: 65,536 GPUs (GPT, 8192 DGX nodes) plan
# in about 20 s end to end on a 2-core machine, the search finishing within a 5 s time limit,
# while placing groups rank by rank makes a million GPUs take minutes (218 s, the time limit not
# honoured). Larger clusters are refused at once.
MAX_WORLD_SIZE = 65536

__all__ = ["Plan", "Predicted", "SolverInfo", "Provenance", "MeshAxis", "Schedule", "Recompute", "ZeroStage",
           "DPSync", "CPStrategy", "TPStyle", "TP_STYLES", "software_versions"]

# What `tp_styles` may say of a module.
TP_STYLES = tuple(s.value for s in TPStyle)


@dataclass(frozen=True)
class Predicted:
    """What the cost model predicts for the plan (per training step)."""

    step_time_s: float = 0.0
    tokens_per_s: float | None = None
    samples_per_s: float = 0.0
    mfu: float = 0.0
    peak_memory_bytes: int = 0
    time_breakdown: dict[str, float] = field(default_factory=dict)
    memory_breakdown: dict[str, int] = field(default_factory=dict)
    # Where a measured step is expected (cost_models.uncertainty), and what the price assumes
    # beyond the published runs it was checked against.
    step_time_low_s: float = 0.0
    step_time_high_s: float = 0.0
    extrapolated: list[str] = field(default_factory=list)
    # Share of the blocks' linear parameters, and of their forward FLOPs, that tensor parallelism
    # shards (autopar.solver.tp_coverage); None without TP, or in a plan written before them.
    tp_param_share: float | None = None
    tp_flop_share: float | None = None


@dataclass(frozen=True)
class SolverInfo:
    """How the plan was found: solver status, objective, time, candidates priced, gap."""

    status: str = "PINNED"
    objective: float = 0.0
    # Wall time of the search: shown by the terminal and the report, but neither part of the
    # plan's identity nor written to plan.json, so the same inputs give the same file byte for byte.
    seconds: float = field(default=0.0, compare=False, metadata={TRANSIENT: True})
    candidates: int = 0
    gap: float = 0.0
    priced: int = 0  # candidates priced past their floor (memory, then times); the rest fell to it
    work: float = 0.0  # deterministic work units spent (solver.work_limit): the same on any machine load
    stopped_by: str = ""  # "", "work_limit" or "time_limit" (the wall-clock safety cap)


@dataclass(frozen=True)
class Provenance:
    """What the plan was made from, to refuse replaying it against something else."""

    model_path: str = ""
    model_sha256: str = ""
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    cluster: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    cluster_config: dict[str, Any] = field(default_factory=dict)  # every cluster.* setting, to price it again
    traced_micro_batch_size: int = 1  # the batch the profile was traced with (prices scale from it)


def software_versions() -> dict[str, str]:
    """Installed autopar, torch and ortools versions: a plan replayed under others may differ."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("autopar", "torch", "ortools"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    return found


# TrainSpec's settings a plan records beside its batch, precision and optimizer (Plan's docstring).
PRICED_WITH = ("clip_grad_norm", *RUNTIME_CHOICES)


def priced_with(train: Any) -> dict[str, Any]:
    """The settings of ``train`` (a TrainSpec) a plan records to be priced again as it was."""
    return {name: getattr(train, name) for name in PRICED_WITH}


# The range of every numeric field of a plan and its parts (Plan.problems checks them when a
# plan.json is read; a test keeps every numeric field listed). A degree above the largest
# cluster autopar plans is no plan of autopar's: torchrun would be asked for that many ranks.
_DEGREE = Bound(low=1, high=MAX_WORLD_SIZE, integer=True)
_COUNT = Bound(low=1, integer=True)
PLAN_BOUNDS: dict[str, Bound] = {
    "dp": _DEGREE, "tp": _DEGREE, "pp": _DEGREE, "cp": _DEGREE, "ep": _DEGREE,
    "zero_stage": Bound(low=0, high=3, integer=True),
    "tp_kv_heads": Bound(low=0, high=MAX_WORLD_SIZE, integer=True),
    "tp_region_attributes": Bound(low=1, integer=True, each=True),  # a repeat count per rank
    "micro_batch_size": _COUNT, "num_micro_batches": _COUNT, "chunks": _COUNT, "global_batch_size": _COUNT,
    "dp_bucket_bytes": _COUNT,
    "dp_shares": Bound(low=1, integer=True, each=True),
    "moe_imbalance": Bound(low=1),
    "expert_load": Bound(low=0, integer=True, each=True),
    "tp_fused": Bound(low=1, integer=True, each=True),
    "tp_grouped_parts": Bound(low=0, integer=True, each=True),
}
PREDICTED_BOUNDS: dict[str, Bound] = {
    "step_time_s": Bound(low=0), "tokens_per_s": Bound(low=0, null="not a token model"),
    "samples_per_s": Bound(low=0), "mfu": Bound(low=0), "peak_memory_bytes": Bound(low=0, integer=True),
    "time_breakdown": Bound(each=True), "memory_breakdown": Bound(each=True),
    "step_time_low_s": Bound(low=0), "step_time_high_s": Bound(low=0),
    "tp_param_share": Bound(low=0, high=1, null="no tensor parallelism"),
    "tp_flop_share": Bound(low=0, high=1, null="no tensor parallelism"),
}
SOLVER_INFO_BOUNDS: dict[str, Bound] = {
    "objective": Bound(), "seconds": Bound(low=0), "candidates": Bound(low=0, integer=True), "gap": Bound(low=0),
    "priced": Bound(low=0, integer=True), "work": Bound(low=0),
}
PROVENANCE_BOUNDS: dict[str, Bound] = {"traced_micro_batch_size": _COUNT}
# Plan attribute -> the table of its numeric fields ("" : the plan's own).
PLAN_PART_BOUNDS: dict[str, dict[str, Bound]] = {"": PLAN_BOUNDS, "predicted": PREDICTED_BOUNDS,
                                                 "solver": SOLVER_INFO_BOUNDS, "provenance": PROVENANCE_BOUNDS}
# The decisions a plan shares with the layout the pricer reads.
LAYOUT_FIELDS = tuple(f.name for f in fields(ParallelLayout))


@dataclass(frozen=True)
class Plan(ParallelLayout):
    """A complete parallelisation of one model on one cluster: the decisions every stage reads
    (`ParallelLayout`'s fields, defined and documented there once: degrees, mesh order, ZeRO,
    micro-batching, schedule, stages, recomputation, SP/CP, gradient synchronisation, shares),
    what the model and the solver fixed with them, and what the plan was made from.

    Attributes (beyond the layout's; two of its fields are narrower here):
        stages: as the layout's, and listed even when pp == 1 (one stage holding every layer).
        recompute: layer name -> none / selective / full (a plan names its layers; unlisted: none).
        dp_sync: the algorithm the plan runs (the pricer's choice where it was auto), or
            reduce_scatter / none where no algorithm was chosen (ZeRO-2/3, one gradient replica).
        tp_styles: module FQN -> colwise / rowwise / replicate / vocab_parallel / hidden_parallel /
            kv_group / head_norm (the operator-wise ILP's choice; modules not listed stay
            replicated; head_norm: a per-head norm on the rank's heads, its weight whole).
        tp_kv_heads: the key/value heads of grouped-query attention that kv_group modules compute
            one per group of tp / tp_kv_heads ranks (autopar.solver.tp_kv_groups); 0: none.
        tp_region_attributes: paired region -> integer attribute -> value the generated code sets
            on it so its attention repeats the rank's key/value head to its query heads (the
            count of query heads per key/value head, found by probing: tp_legality).
        tp_dtensor_regions: paired regions whose code views activations by global sizes
            (``b, s, h = x.shape``): their column-parallel outputs stay DTensors (see
            autopar.solver.tp_global_shapes); the other regions hand on local shards.
        tp_random_regions: paired regions drawing random numbers on the rank's shards (dropout on
            its heads): the generated code runs each with its generators seeded per rank
            (``RankRandomNumbers``), so ranks draw their own numbers and recomputation the same.
        tp_fused: column-parallel fused projections (one linear for q, k and v, or gate and up)
            -> the global sizes of the parts the model's code cuts its output into; each rank
            holds its share of every part (autopar.solver.tp_fused).
        tp_grouped_parts: fused projections computed by key/value group (``kv_group``: Phi-3's
            qkv_proj at tp above its key/value heads) -> the indices of their parts that each
            rank computes for its group (the key/value parts); the others split by tp.
        loss_parallel: the LM head's logits stay vocabulary-sharded into the loss.
        dp_bucket_bytes: gradient bytes per synchronisation bucket (hierarchical / ps).
        token_loss: the loss is a mean over the targets it counts and the plan splits the batch
            (ranks, shards of the sequence or micro-batches): each part's loss is weighed by its
            count, with one all-reduce of the counts per step (autopar/trace/loss_tokens.py).
        data_dependent, estimated: the model's shapes or branches depend on tensor values (planned
            with the example batch's values, autopar/data_dependent.py), and what of them was read
            from that batch or guessed rather than traced.
        real_values: where and why fake tensors could not run the model: it was traced with real
            tensors at one micro-batch (autopar.model_file.build_real), and compile's proof runs it
            only for real (no full-scale step on fake tensors).
        random_draws: the forward's random draws other than dropout's ("<op> in <module>"):
            compile's check cannot compare such a model's sharded run with one process.
        layer_names, block_containers: the profile's layer order and the FQNs of its stacks of
            blocks (containers whose children are layers), in the order their blocks run.
        global_batch_size, precision, optimizer, moe_imbalance: the
            training settings planned for.
        expert_load: experts module FQN -> tokens each expert received, measured from a router
            checkpoint (train.router_checkpoint); empty: moe_imbalance priced the routing.
        clip_grad_norm, tp_runtime, zero3_runtime, selective_runtime, grad_reduce_dtype: the rest
            of the training settings the plan was priced with (TrainSpec's), so that a plan read back
            is priced again as it was: a plan of plan.engine=megatron as Megatron-LM runs it, a
            compiled one as the generated module runs it. A plan written before them reads as the
            generated module's.
    """

    recompute: dict[str, str] = field(default_factory=dict)
    dp_sync: str = DPSync.RING
    tp_styles: dict[str, str] = field(default_factory=dict)
    tp_dtensor_regions: list[str] = field(default_factory=list)
    tp_random_regions: list[str] = field(default_factory=list)
    tp_fused: dict[str, list[int]] = field(default_factory=dict)
    tp_grouped_parts: dict[str, list[int]] = field(default_factory=dict)
    tp_kv_heads: int = 0
    tp_region_attributes: dict[str, dict[str, int]] = field(default_factory=dict)
    loss_parallel: bool = False
    dp_bucket_bytes: int = DP_BUCKET_BYTES
    token_loss: bool = False
    data_dependent: bool = False
    estimated: list[str] = field(default_factory=list)
    real_values: str | None = None
    random_draws: list[str] = field(default_factory=list)
    layer_names: list[str] = field(default_factory=list)
    block_containers: list[str] = field(default_factory=list)
    global_batch_size: int = 1
    precision: str = "bf16"
    optimizer: str = "adam"
    moe_imbalance: float = 1.0
    expert_load: dict[str, list[int]] = field(default_factory=dict)
    clip_grad_norm: bool = True
    tp_runtime: str = "dtensor"
    zero3_runtime: str = "fsdp2"
    selective_runtime: str = "autopar"
    grad_reduce_dtype: str = "fp32"
    predicted: Predicted = field(default_factory=Predicted)
    solver: SolverInfo = field(default_factory=SolverInfo)
    provenance: Provenance = field(default_factory=Provenance)

    def degree(self, axis: str) -> int:
        return getattr(self, MeshAxis(axis).value)

    def mesh_shape(self) -> tuple[int, ...]:
        """Mesh shape outermost first (DeviceMesh order), e.g. (dp, pp, cp, tp)."""
        return self.mesh.shape()

    def mesh_dim_names(self) -> tuple[str, ...]:
        return self.mesh.dim_names()

    def rank_grid(self) -> list:
        """Nested lists of ranks in DeviceMesh order: rank r sits at its mesh coordinate."""
        return self.mesh.rank_grid()

    @classmethod
    def of(cls, layout: ParallelLayout, **rest: Any) -> "Plan":
        """A plan holding `layout`'s decisions; `rest` gives the others (and may override)."""
        return cls(**{**{name: layout.__dict__[name] for name in LAYOUT_FIELDS}, **rest})

    def layout(self) -> ParallelLayout:
        """The decisions alone, as the pricer reads them (hashable: its caches key on them). A
        recorded algorithm the search would not pin (reduce_scatter, none) is priced as auto."""
        from autopar.domain.techniques import pinnable_sync

        decisions = {name: self.__dict__[name] for name in LAYOUT_FIELDS}
        decisions.update(dp_sync=pinnable_sync(self.dp_sync), recompute=self.recompute or Recompute.NONE)
        return ParallelLayout.of_final_values(**decisions)

    def summary(self) -> str:
        """One line: degrees, ZeRO, micro-batching, schedule, SP/CP, recomputation."""
        parts = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}", f"cp={self.cp}"]
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if self.expert_tp:
            parts.append("expert-TP")
        parts += [f"ZeRO-{self.zero_stage}" + (" hybrid" if self.hybrid_shard else ""),
                  f"micro-batch {self.micro_batch_size}×{self.num_micro_batches}"]
        if list(self.mesh_order) != [a.value for a in MeshAxis]:
            parts.append("mesh " + ">".join(self.mesh_order))
        if self.cp > 1:
            parts.append(self.cp_strategy)
        if self.pp > 1:
            parts.append(self.schedule + (f" v={self.chunks}" if self.chunks > 1 else ""))
        if self.sequence_parallel:
            parts.append("SP")
        parts.append("recompute " + "/".join(sorted(set(self.recompute.values())) or [Recompute.NONE.value]))
        return " ".join(parts)

    def problems(self) -> list[str]:
        """What makes the plan unusable (a corrupted or hand-edited plan.json); empty when none.

        Only the plan's own consistency: whether it suits a model or cluster is checked where
        those are known."""
        found = self._number_problems()
        found += self._technique_problems()
        if found:
            return found  # the checks below assume sane numbers
        if self.world_size > MAX_WORLD_SIZE:
            found.append(f"its world size dp×tp×pp×cp = {self.world_size:,} is above the {MAX_WORLD_SIZE:,} GPUs "
                         "autopar plans for")
        found += self._layer_problems()
        return found

    def _number_problems(self) -> list[str]:
        """Every numeric field outside its range (PLAN_PART_BOUNDS), and the cluster it records."""
        from cost_models.topology import cluster_problem

        found = []
        for part, table in PLAN_PART_BOUNDS.items():
            values = getattr(self, part) if part else self
            problem = out_of_range(values, table)
            if problem:
                found.append(problem.sentence(f"{part}." if part else ""))
        cluster = self.provenance.cluster_config
        wrong = cluster_problem(cluster) if isinstance(cluster, dict) and cluster else None
        if wrong:
            found.append(f"the cluster it records (provenance.cluster_config): {wrong}")
        return found

    def _technique_problems(self) -> list[str]:
        """Values the technique registry does not know or the generated code does not run."""
        from autopar.domain.techniques import Family, chosen

        found = []
        for family in Family:
            try:
                chosen(family, getattr(self, family.value))
            except ValueError as error:
                found.append(str(error))
        return found

    def _layer_problems(self) -> list[str]:
        """The structure's rules (autopar.domain.rules, the same the pricer and codegen ask; a plan
        lists its stages even at pp=1), then what only a plan holds: its tensor-parallel styles."""
        found = [] if self.layer_names else ["it lists no layers (layer_names)"]
        found += [problem.problem for problem in structure_problems(self, self.layer_names or None,
                                                                    self.global_batch_size, stages_listed=True)]
        found += unknown_choices(self, RUNTIME_CHOICES)
        styles = sorted({str(v) for v in self.tp_styles.values()} - set(TP_STYLES))
        if styles:
            found.append(f"tp style '{styles[0]}' is not one of {', '.join(TP_STYLES)}")
        if TPStyle.KV_GROUP.value in self.tp_styles.values() and (self.tp_kv_heads < 1 or self.tp % self.tp_kv_heads):
            found.append(f"kv_group styles need tp_kv_heads to divide tp={self.tp} (it is {self.tp_kv_heads})")
        stray = sorted(module for module, indices in self.tp_grouped_parts.items()
                       if any(index >= len(self.tp_fused.get(module, [])) for index in indices))
        if stray:
            found.append(f"tp_grouped_parts names parts of {stray[0]} that tp_fused does not give it")
        return found

    def with_updates(self, **changes: Any) -> "Plan":
        return replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(to_jsonable(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return from_jsonable(cls, json.loads(text))

    @staticmethod
    def upgrade_data(data: dict[str, Any]) -> dict[str, Any]:
        """Fields of an older plan file in today's terms (`from_jsonable` calls it): a plan
        written when a model had one stack (``block_container``) reads as that stack."""
        return upgrade_block_containers(data)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(to_jsonable(self), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> "Plan":
        import yaml

        return from_jsonable(cls, yaml.safe_load(text))

    def save(self, path: str | Path) -> None:
        """JSON, or YAML when the name ends in .yaml/.yml."""
        path = Path(path)
        path.write_text(self.to_yaml() if path.suffix in (".yaml", ".yml") else self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        path = Path(path)
        text = path.read_text()
        return cls.from_yaml(text) if path.suffix in (".yaml", ".yml") else cls.from_json(text)


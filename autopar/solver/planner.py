"""The planner: profile + cluster + settings -> the fastest plan that fits, and why.

Composes the stage-level pieces: the search space (`space`), the cost model's pricer
(`cost_models.step.PlanPricer`, with the operator-wise ILP as its TP splitter), and the
branch-and-bound search over candidates with the partition ILP inside (`search`). When nothing
fits, the same search is re-run on bigger clusters to name the smallest change that would fit.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

from autopar.errors import UserError
from autopar.plans import MAX_WORLD_SIZE, Plan, Predicted, Provenance, SolverInfo, priced_with, software_versions
from autopar.solver.search import PlanSearch, Scored, SearchProgress, SearchResult
from autopar.solver.space import Candidate, ModelShape, divisors, enumerate_candidates
from autopar.solver.tp_coverage import FASTER_WHOLE, TPCoverage, check_pinned_coverage, tp_coverage
from autopar.solver.tp_split import ILPSplitter, illegal_splits, replicated_ops
from autopar.domain import rules
from autopar.domain.techniques import UNSPLITTABLE_WIDTH
from cost_models.hardware import get_gpu, known_gpus
from autopar.domain.techniques import Family, searchable, technique
from cost_models.memory import RECOMPUTE_OPTIONS
from autopar.domain.mesh import Mesh
from cost_models.pipeline import Partition, PartitionProblem, evaluate
from cost_models.step import Estimate, ParallelLayout, PlanPricer, TrainSpec
from cost_models.topology import ClusterSpec
from autopar.domain.vocabulary import DPSync, Recompute
from cost_models.uncertainty import (RESIDUAL_LOW, Extrapolation, PredictionInterval, extrapolations,
                                     pessimistic_cluster, pessimistic_cluster_key, techniques_of)

if TYPE_CHECKING:
    from autopar.config import PlanPins, SolverConfig
    from autopar.model_profile import ModelProfile


UNBOUNDED_BYTES = 2**60  # memory limit for "how much would it need" re-solves


class InfeasibleError(UserError):
    """No plan fits; the message names the smallest change that would."""


@dataclass
class Alternative:
    """A runner-up and why it lost to the winner."""

    plan: Plan
    reason: str


# plan.* settings that are not decisions of the plan: layer maps (listed on their own) and how the
# model is traced.
NOT_DECISIONS = ("stages", "layer_recompute", "trace_every_block", "reuse_profile")


@dataclass(frozen=True)
class Binding:
    """A limit that shapes the chosen plan, and what relaxing it would buy."""

    constraint: str
    relaxing: str


@dataclass
class PlanningResult:
    plan: Plan
    alternatives: list[Alternative]
    search: SearchResult
    estimate: Estimate
    binding: list[Binding] = field(default_factory=list)
    pricer: PlanPricer | None = None  # what priced the plan (the report re-uses its numbers)
    # op target -> modules where the plan's TP found no split for the op and replicates it
    replicated_ops: dict[str, list[str]] = field(default_factory=dict)
    # one line per kind of split the planner refused before pricing, naming what decided it
    illegal_splits: list[str] = field(default_factory=list)
    # plans compile's proof rejected before this one (autopar.report.document.RejectedPlan)
    rejected: list[Any] = field(default_factory=list)
    # what the plan's tensor parallelism splits (None without TP): autopar.solver.tp_coverage
    tp_coverage: TPCoverage | None = None


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while planning (reference counting still frees
    what planning drops; a cycle left behind waits for the next collection after it). The search
    allocates hundreds of thousands of small acyclic objects (candidates, their floors), and the
    collections their allocations triggered walked the whole heap, over a million objects of the
    traced profile: half the time of enumerating candidates and ordering them by floor (145.6B GPT
    on 1536 A100: 1.1 s of 2.2 s)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def split_of(layout: ParallelLayout) -> tuple:
    """What a plan splits and how (degrees, ZeRO stage, SP, CP strategy, pipeline schedule): the
    part of a plan that decides which code runs. A plan rejected at compile's proof excludes
    every candidate of its split (autopar/driver.py): those differing only in micro-batch size,
    recomputation, mesh order or gradient sync run the same parallel code and fail alike."""
    return (layout.dp, layout.tp, layout.pp, layout.cp, int(layout.zero_stage), bool(layout.hybrid_shard),
            bool(layout.sequence_parallel), str(layout.cp_strategy) if layout.cp > 1 else "",
            str(layout.schedule) if layout.pp > 1 else "", layout.chunks if layout.pp > 1 else 1,
            getattr(layout, "ep", 1))


def _s(seconds: float) -> str:
    """A step time in words: seconds, or milliseconds below one second."""
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms"


def layout_of(candidate: Candidate, stages: Sequence[Sequence[str]] = (),
              recompute: Any = Recompute.NONE) -> ParallelLayout:
    """The candidate completed with its stage split and per-layer recomputation."""
    return replace(candidate, stages=tuple(tuple(stage) for stage in stages), recompute=recompute)


# What to change in a model for each kind of sequence blocker (autopar.trace.sequence's reasons).
_CP_REMEDIES = (
    ("shift along the sequence", "shift targets in example_batch instead of passing labels="),
    ("nn.MultiheadAttention", "compute attention with F.scaled_dot_product_attention instead of nn.MultiheadAttention"),
    ("attention", "call F.scaled_dot_product_attention (causal or without a mask) instead of computing softmax(QK^T)"),
    ("numbered from the tokens", "return the positions the model numbers itself as position_ids in example_batch, so "
                                 "every run (and each shard) uses them"),
    ("position", "take `position_ids=None` in forward and use it instead of numbering positions inside the model"),
    ("reduction over the sequence", "compute the statistic over the whole batch or per token, not per sequence"),
)


def cp_remedy(blocker: str) -> str:
    """The change to the model that lifts ``blocker``."""
    return next((remedy for words, remedy in _CP_REMEDIES if words in blocker),
                "rewrite that op to read its own position only")


class Planner:
    """Plans one model (profile) for one cluster."""

    def __init__(self, profile: "ModelProfile", cluster: ClusterSpec, train: TrainSpec, solver: "SolverConfig",
                 pins: "PlanPins", progress: Callable[[SearchProgress], None] | None = None,
                 excluded_splits: frozenset[tuple] = frozenset()):
        """``excluded_splits``: `split_of` values never to plan (rejected by compile's proof)."""
        self.profile = profile
        self.excluded_splits = excluded_splits
        self.cluster = cluster
        self.train = train
        self.solver = solver
        self.pins = pins
        self.progress = progress
        self.shape = ModelShape.from_profile(profile)
        self.splitter = ILPSplitter.for_training(profile, train)
        options = (pins.recompute,) if pins.recompute and not pins.layer_recompute else tuple(solver.recompute_options)
        if pins.layer_recompute:
            options = tuple(dict.fromkeys([*options, Recompute.NONE.value, *pins.layer_recompute.values()]))
        self.pricer = PlanPricer(profile, cluster, train, self.splitter, recompute_options=options)
        self._intervals: dict[ParallelLayout, PredictionInterval] = {}
        self._pessimistic: dict[tuple, PlanPricer] = {}

    def candidates(self, cluster: ClusterSpec | None = None) -> list[Candidate]:
        cluster = cluster or self.cluster
        found: Iterable[Candidate] = enumerate_candidates(self.shape, cluster.world_size, cluster.gpus_per_node,
                                                          self.train.global_batch_size, self.solver, self.pins)
        if self.excluded_splits:
            found = [c for c in found if split_of(c) not in self.excluded_splits]
        engine = getattr(self.pins, "engine", None)
        if engine:  # only what that engine runs (autopar/emit/)
            from autopar.emit import writer

            runs = writer(engine).layout_refusal
            found = [c for c in found if runs(c) is None]
        if self.pins.stages:
            return [c for c in found if c.pp * c.chunks == len(self.pins.stages)]
        if self.pins.layer_recompute:
            return [c for c in found if c.pp == 1]
        return list(found)

    def run(self) -> PlanningResult:
        with collector_paused():
            if self.solver.objective == "min_gpus":
                return self._fewest_gpus()
            return self._fastest()

    def _fewest_gpus(self) -> PlanningResult:
        """The smallest prefix of the cluster's nodes whose fastest plan reaches the target."""
        target = self.solver.target_tokens_per_s
        if target <= 0:
            raise UserError("solver.objective=min_gpus needs a throughput to reach.",
                            "set solver.target_tokens_per_s=<tokens per second>.")
        best_seen = 0.0
        for nodes in range(1, self.cluster.nodes + 1):
            cluster = replace(self.cluster, node_gpus=self.cluster.node_gpus[:nodes])
            fastest = replace(self.solver, objective="throughput")
            planner = Planner(self.profile, cluster, self.train, fastest, self.pins, self.progress,
                              self.excluded_splits)
            try:
                result = planner._fastest()
            except UserError:
                continue
            rate = result.plan.predicted.tokens_per_s or 0.0
            best_seen = max(best_seen, rate)
            if rate >= target:
                return result
        raise UserError(f"No plan on up to {self.cluster.world_size} GPUs reaches {target:,.0f} tokens/s "
                        f"(best {best_seen:,.0f}).", "raise cluster.nodes or lower solver.target_tokens_per_s.")

    def _fastest(self) -> PlanningResult:
        self._check_pins()
        candidates = self.candidates()
        if not candidates:
            raise UserError(self._why_no_candidates(), self._no_candidates_fix())
        not_offered: list[str] = []
        while True:
            search = PlanSearch(self.pricer, time_limit_s=self.solver.time_limit_s,
                                top_k=max(1, self.solver.top_k + 1), seed=self.solver.seed, workers=self.solver.threads,
                                progress=self.progress, fixed_partition=self._pinned_partition(),
                                work_limit=self.solver.work_limit)
            result = search.run(candidates)
            if not result.best:
                raise InfeasibleError(*self._smallest_fitting_change())
            winner = self._choose(result)
            idle_tp = self._idle_tp(winner.candidate)
            rest = [c for c in candidates if c.tp != idle_tp]
            if idle_tp is None or not rest:
                break
            # A tensor-parallel degree whose best split of this model replicates every linear layer
            # spends tp GPUs on one GPU's work: not offered (an unpinned degree only).
            not_offered.append(f"tp={idle_tp} not offered: its best split of this model replicates every linear "
                               f"layer ({FASTER_WHOLE}), so {idle_tp} GPUs would compute what one does")
            candidates = rest
        fastest, robust = winner, None
        if self.solver.objective == "robust":
            # The second searches start from what the first proved of each candidate it priced:
            # most of them need no pricing again.
            known = search.known_floors()
            robust = self._robust_choice(winner, candidates, result.work, known) \
                or self._better_known(winner, result.work, known)
            if robust is not None:
                winner = robust[0]
        plan, estimate = self.to_plan(winner, result)
        coverage = self.tp_coverage(plan.tp, plan.expert_tp) if plan.tp > 1 else None
        if coverage is not None and (self.pins.tp or 1) > 1:
            check_pinned_coverage(coverage)  # a pinned tp under which little splits is refused
            if coverage.param_share == 0:  # legal to split, but the search found every linear faster whole
                not_offered.append(f"warning: plan.tp={plan.tp} is pinned, but its best split of this model on this "
                                   f"cluster replicates every linear layer ({FASTER_WHOLE}), so {plan.tp} GPUs compute "
                                   "what one does: leave plan.tp unset to spend them on data parallelism")
        alternatives = [Alternative(self.to_plan(other, result)[0], self._why_lost(other, winner))
                        for other in result.best
                        if other.candidate != winner.candidate and other is not fastest][: self.solver.top_k]
        if robust is not None:
            alternatives.insert(0, Alternative(self.to_plan(fastest, result)[0], robust[1]))
        alternatives += self._faster_but_too_big(result, winner, search)
        binding = self._binding_constraints(winner, alternatives)
        if robust is not None:
            binding.insert(0, Binding("robust objective (solver.objective=robust)", robust[1]))
        return PlanningResult(plan=plan, alternatives=alternatives, search=result, estimate=estimate,
                              binding=binding, pricer=self.pricer,
                              replicated_ops=replicated_ops(self.splitter, plan.tp),
                              illegal_splits=not_offered + self._illegal_splits(plan), tp_coverage=coverage)

    def _idle_tp(self, candidate: Any) -> int | None:
        """``candidate``'s unpinned tensor-parallel degree when its best split shards none of the
        blocks' linear parameters (autopar.solver.tp_coverage), else None."""
        if candidate.tp <= 1 or (self.pins.tp or 1) > 1:
            return None
        share = self.tp_coverage(candidate.tp, candidate.expert_tp).param_share
        return candidate.tp if share == 0 else None

    def _illegal_splits(self, plan: Plan) -> list[str]:
        """Which splits legality analysis kept out of the search, one line per kind."""
        lines = illegal_splits(self.splitter, plan.tp) if plan.tp > 1 else []
        if plan.tp > 1 and self.shape.sp_blocker:
            lines.append(f"sequence parallelism not considered: {self.shape.sp_blocker}, and no torch style "
                         "gathers the sequence for it.")
        return lines

    # -- robustness to what the cost model extrapolates (cost_models.uncertainty) ---------------------

    def _extrapolation(self, layout: ParallelLayout) -> Extrapolation:
        """What the layout's price extrapolates: its widest collective group, and its all-to-all."""
        widest = max(self.pricer.groups.placement(layout, axes).nodes for axes in (("dp", "cp"), "tp", "cp"))
        all_to_all = self.pricer.groups.placement(layout, "ep").nodes if getattr(layout, "ep", 1) > 1 else 0
        return extrapolations(self.cluster, widest, all_to_all, techniques_of(layout),
                              data_parallel_ranks=layout.dp * layout.cp)

    def interval(self, scored: Scored) -> PredictionInterval:
        """The plan's predicted step, its pessimistic price and why they differ (once per layout:
        the plan, its runners-up and the robust choice ask for the same ones)."""
        layout = self._layout(scored)
        if layout not in self._intervals:
            self._intervals[layout] = self._priced_interval(layout)
        return self._intervals[layout]

    def _priced_interval(self, layout: ParallelLayout) -> PredictionInterval:
        predicted = self.pricer.estimate(layout).step_time_s
        extrapolation = self._extrapolation(layout)
        pessimistic_s = predicted
        if extrapolation.reprices:
            pessimistic_s = self._pessimistic_pricer(extrapolation).estimate(layout).step_time_s
        return PredictionInterval(predicted, pessimistic_s, extrapolation.reasons, extrapolation.residual_low,
                                  extrapolation.residual_high)

    def _pessimistic_pricer(self, extrapolation: Extrapolation) -> PlanPricer:
        """The pricer of the cluster as `extrapolation`'s pessimistic price sees it, one per such
        cluster: the plan's runners-up and the robust search mostly extrapolate alike, and a
        pricer shares its prices between the layouts it is asked about."""
        key = pessimistic_cluster_key(extrapolation)
        if key not in self._pessimistic:
            self._pessimistic[key] = PlanPricer(self.profile, pessimistic_cluster(self.cluster, extrapolation),
                                                self.train, self.splitter,
                                                recompute_options=self.pricer.recompute_options)
        return self._pessimistic[key]

    def _robust_choice(self, fastest: Scored, candidates: list[Candidate], spent: float,
                       floors: list[tuple[float, int, Candidate]]) -> tuple[Scored, str] | None:
        """When the fastest plan rests on extrapolated terms, the best plan under their pessimistic
        value; chosen (with the reason in words) if its interval overlaps the fastest plan's and
        its pessimistic price is lower."""
        extrapolation = self._extrapolation(self._layout(fastest))
        if extrapolation.network_factor == 1.0 and not extrapolation.exposed:
            return None  # an uncalibrated GPU's compute weighs on every plan alike: nothing to trade
        mine = self.interval(fastest)
        cautious = self._pessimistic_pricer(extrapolation)
        # The first search's work bounds this one's: a better-hedged plan need not be proven
        # optimal under pessimistic prices to be worth comparing, and planning time at most doubles.
        # Only plans whose pessimistic price beats the fastest plan's can be chosen: the search is
        # cut off there, so candidates whose floor is above it are neither priced nor solved.
        found = PlanSearch(cautious, time_limit_s=self.solver.time_limit_s, seed=self.solver.seed,
                           workers=self.solver.threads, work_limit=min(self.solver.work_limit, max(1.0, spent)),
                           fixed_partition=self._pinned_partition()).run(candidates, cutoff_s=mine.pessimistic_s,
                                                                         floors=floors)
        if not found.best or found.best[0].candidate == fastest.candidate:
            return None
        other = found.best[0]
        theirs = self.interval(other)
        if not theirs.overlaps(mine) or theirs.pessimistic_s >= mine.pessimistic_s:
            return None
        faster = theirs.predicted_s / mine.predicted_s - 1
        other = replace(other, step_time_s=theirs.predicted_s)  # its nominal price, as the others have
        return other, (f"{self._summary(fastest)} is {faster:.1%} faster on paper "
                       f"({mine.predicted_s:.2f} s vs {theirs.predicted_s:.2f} s a step) but rests on "
                       f"{'; '.join(mine.reasons)}: {mine.extrapolated_share:.0%} slower if those run at their "
                       f"pessimistic value (intervals {mine.low_s:.2f}-{mine.high_s:.2f} s and "
                       f"{theirs.low_s:.2f}-{theirs.high_s:.2f} s overlap); chose {self._summary(other)}, "
                       f"{theirs.extrapolated_share:.0%} slower at its pessimistic value")

    def _better_known(self, fastest: Scored, spent: float,
                      floors: list[tuple[float, int, Candidate]]) -> tuple[Scored, str] | None:
        """When the fastest plan's data-parallel group (dp x cp ranks) is wider than any calibration
        run's, so that its interval widens (cost_models.uncertainty.ScaleTrend): the best plan
        whose group is not, searched among the first search's candidates (within its work, cut off
        where its nominal price could no longer bring its worst case below the fastest plan's);
        chosen, with the reason in words, if its interval overlaps the fastest plan's and its top
        is lower. None otherwise."""
        from cost_models import uncertainty

        trend = uncertainty.SCALE_TRENDS.get("data_parallel_ranks")
        widest = trend.calibrated_max if trend is not None else None
        if widest is None or fastest.candidate.dp * fastest.candidate.cp <= widest:
            return None
        narrower = [floor for floor in floors if floor[2].dp * floor[2].cp <= widest]
        if not narrower:
            return None
        mine = self.interval(fastest)
        found = PlanSearch(self.pricer, time_limit_s=self.solver.time_limit_s, top_k=3, seed=self.solver.seed,
                           workers=self.solver.threads, work_limit=min(self.solver.work_limit, max(1.0, spent)),
                           fixed_partition=self._pinned_partition()).run(
            [floor[2] for floor in narrower], cutoff_s=mine.high_s * (1 + RESIDUAL_LOW), floors=narrower)
        for other in sorted(found.best):
            theirs = self.interval(other)
            if theirs.overlaps(mine) and theirs.high_s < mine.high_s:
                faster = theirs.predicted_s / mine.predicted_s - 1
                widened = [reason for reason in mine.reasons if uncertainty.BEYOND_CALIBRATION in reason]
                return other, (f"{self._summary(fastest)} is {faster:.1%} faster on paper ({_s(mine.predicted_s)} vs "
                               f"{_s(theirs.predicted_s)} a step) but its cost is less known: {'; '.join(widened)} "
                               f"(intervals {_s(mine.low_s)}-{_s(mine.high_s)} and {_s(theirs.low_s)}-"
                               f"{_s(theirs.high_s)} overlap); chose {self._summary(other)}, whose worst case is lower")
        return None

    def _layout(self, scored: Scored) -> ParallelLayout:
        return layout_of(scored.candidate, *self._named_partition(scored))

    def _named_partition(self, scored: Scored) -> tuple[list[list[str]], dict[str, str]]:
        """The partition's stages and each layer's recomputation, by layer name."""
        names = [layer.name for layer in self.profile.layers]
        stages = [[names[at] for at in stage] for stage in scored.partition.stages(len(names))]
        options = self.pricer.recompute_options
        return stages, {name: options[option] for name, option in zip(names, scored.partition.options)}

    @staticmethod
    def _summary(scored: Scored) -> str:
        c = scored.candidate
        return (f"dp={c.dp} tp={c.tp} pp={c.pp}" + (f" cp={c.cp} {c.cp_strategy}" if c.cp > 1 else "")
                + (f" ep={c.ep}" if c.ep > 1 else "")
                + f" ZeRO-{c.zero_stage}"
                + (f" {c.schedule}" if c.pp > 1 else ""))

    def _choose(self, result: SearchResult) -> Scored:
        if self.solver.objective != "memory":
            return result.best[0]
        fastest = result.best[0].step_time_s
        close = [s for s in result.best if s.step_time_s <= 1.05 * fastest]
        return min(close, key=lambda s: (max(s.partition.device_memory_bytes), s.step_time_s, s.index))

    # -- turning a solution into a Plan ------------------------------------------------------------

    def to_plan(self, scored: Scored, result: SearchResult) -> tuple[Plan, Estimate]:
        names = [layer.name for layer in self.profile.layers]
        stages, recompute = self._named_partition(scored)
        layout = layout_of(scored.candidate, stages, recompute)
        estimate = self.pricer.estimate(layout)
        interval = self.interval(scored)
        dp_sync = estimate.dp_sync_algorithm if scored.candidate.zero_stage <= 1 else DPSync.REDUCE_SCATTER
        plan = Plan.of(
            layout, recompute=recompute, tp_styles=self._tp_styles(scored.candidate.tp),
            tp_dtensor_regions=self._tp_regions(self.splitter.dtensor_regions, scored.candidate.tp),
            tp_random_regions=self._tp_regions(self.splitter.random_regions, scored.candidate.tp),
            tp_fused=self._tp_fused(scored.candidate.tp),
            tp_grouped_parts=self._by_layer(self.splitter.grouped_parts, scored.candidate.tp),
            tp_kv_heads=self._tp_kv_heads(scored.candidate.tp),
            tp_region_attributes=self._tp_region_attributes(scored.candidate.tp),
            loss_parallel=any(style == "colwise" and module == self.profile.layers[-1].name
                              for module, style in self._tp_styles(scored.candidate.tp).items())
            and (self.profile.layers[-1].name, scored.candidate.tp) in self.splitter.loss_parallel,
            dp_sync=dp_sync, dp_bucket_bytes=self.pricer.sync.bucket_bytes(layout),
            dp_shares=list(self.pricer.ranks.dp_shares(layout)),
            token_loss=self.pricer.structure.weighs_tokens(layout), data_dependent=self.profile.data_dependent,
            estimated=list(self.profile.estimated), real_values=self.profile.real_values,
            random_draws=self.profile.random_draws, layer_names=names,
            block_containers=list(self.profile.block_containers), global_batch_size=self.train.global_batch_size,
            precision=self.train.precision, optimizer=self.train.optimizer,
            moe_imbalance=self.train.moe_imbalance,
            expert_load={fqn: list(counts) for fqn, counts in self.train.expert_load},
            **priced_with(self.train),
            predicted=Predicted(step_time_s=estimate.step_time_s, tokens_per_s=estimate.tokens_per_s,
                                samples_per_s=estimate.samples_per_s, mfu=estimate.mfu,
                                peak_memory_bytes=estimate.peak_memory_bytes,
                                time_breakdown=estimate.time_breakdown, memory_breakdown=estimate.memory_breakdown,
                                step_time_low_s=interval.low_s, step_time_high_s=interval.high_s,
                                extrapolated=list(interval.reasons),
                                **self._coverage_fields(scored.candidate.tp, scored.candidate.expert_tp)),
            solver=SolverInfo(status=result.status, objective=scored.step_time_s, seconds=round(result.seconds, 3),
                              candidates=result.candidates, gap=result.gap,
                              priced=result.priced, work=result.work, stopped_by=result.stopped_by),
            provenance=Provenance(model_path=self.profile.model_path, model_sha256=self.profile.model_sha256,
                                  model_kwargs=dict(self.profile.model_kwargs), cluster=self.cluster.name,
                                  traced_micro_batch_size=self.profile.micro_batch_size,
                                  versions=software_versions()))
        return plan, estimate

    def tp_coverage(self, tp: int, expert_tp: bool = False) -> TPCoverage:
        """What tensor parallelism of degree ``tp`` splits of the blocks, as solved so far
        (autopar.solver.tp_coverage), with legality's reason for each module it refused."""
        illegal = {module: item for (_, degree), found in self.splitter.illegal.items() if degree == tp
                   for module, item in found.items()}
        sharded = {layer: ops for (layer, degree), ops in self.splitter.sharded_ops.items() if degree == tp}
        return tp_coverage(self.profile, self._tp_styles(tp), tp, illegal, sharded, self.splitter.tree, expert_tp)

    def _coverage_fields(self, tp: int, expert_tp: bool) -> dict[str, float | None]:
        """The plan's Predicted fields for its TP coverage (rounded: plan.json stays stable)."""
        if tp <= 1:
            return {}
        coverage = self.tp_coverage(tp, expert_tp)
        share = lambda value: None if value is None else round(value, 4)  # noqa: E731
        return {"tp_param_share": share(coverage.param_share), "tp_flop_share": share(coverage.flop_share)}

    def _tp_styles(self, tp: int) -> dict[str, str]:
        """Module FQN -> style for every layer, repeating each layer kind's ILP solution."""
        if tp == 1:
            return {}
        styles: dict[str, str] = {}
        for layer in self.profile.layers:
            kind = layer.repeat_of or layer.name
            for module, style in self.splitter.solutions.get((kind, tp), {}).items():
                styles[layer.name + module[len(kind):] if module.startswith(kind) else module] = style
        return styles

    def _tp_kv_heads(self, tp: int) -> int:
        """The key/value heads the plan's kv_group modules compute by group (0: none chosen)."""
        groups = self.splitter.kv_groups.get(tp)
        chosen = "kv_group" in self._tp_styles(tp).values()
        return groups.kv_heads if groups is not None and chosen else 0

    def _tp_region_attributes(self, tp: int) -> dict[str, dict[str, int]]:
        """Region -> attribute -> value set for its key/value groups, for every layer (as `_tp_styles`)."""
        found: dict[str, dict[str, int]] = {}
        for layer in self.profile.layers:
            kind = layer.repeat_of or layer.name
            for region, attributes in sorted(self.splitter.region_attributes.get((kind, tp), {}).items()):
                found[layer.name + region[len(kind):] if region.startswith(kind) else region] = dict(attributes)
        return found

    def _tp_regions(self, by_kind: dict[tuple[str, int], set[str]], tp: int) -> list[str]:
        """Paired regions of the splitter's ``by_kind`` (keeping DTensor activations, drawing
        random numbers on shards), for every layer (as `_tp_styles`)."""
        found: list[str] = []
        for layer in self.profile.layers:
            kind = layer.repeat_of or layer.name
            for region in sorted(by_kind.get((kind, tp), ())):
                found.append(layer.name + region[len(kind):] if region.startswith(kind) else region)
        return found

    def _tp_fused(self, tp: int) -> dict[str, list[int]]:
        """Fused projections split as their parts, for every layer (as `_tp_styles`)."""
        return self._by_layer(self.splitter.fused_parts, tp)

    def _by_layer(self, per_kind: dict[tuple[str, int], dict[str, list[int]]], tp: int) -> dict[str, list[int]]:
        """A splitter's per-layer-kind module -> list, for every layer (as `_tp_styles`)."""
        found: dict[str, list[int]] = {}
        for layer in self.profile.layers:
            kind = layer.repeat_of or layer.name
            for module, values in sorted(per_kind.get((kind, tp), {}).items()):
                found[layer.name + module[len(kind):] if module.startswith(kind) else module] = list(values)
        return found

    # -- explanations --------------------------------------------------------------------------------

    def _faster_but_too_big(self, result: SearchResult, winner: Scored, search: PlanSearch) -> list[Alternative]:
        """Candidates memory refused that would otherwise beat the winner: each re-solved with
        memory unbounded, reported with how far over the GPU it goes (at most 3, fastest first)."""
        found: list[Alternative] = []
        for bound, index, candidate, problem in result.over_memory:
            if len(found) == min(3, self.solver.top_k) or bound >= winner.step_time_s:
                break
            unbounded = replace(problem, capacity_bytes=[UNBOUNDED_BYTES] * problem.devices)
            partition = search.solve_partition(unbounded)
            if partition is None or not partition.stage_starts:
                continue
            scored = Scored(partition.step_time_s + self.pricer.fixed_time_s(candidate), index, candidate, partition)
            if scored.step_time_s >= winner.step_time_s:
                continue
            over = [used - cap for used, cap in zip(partition.device_memory_bytes, problem.capacity_bytes)]
            rank = max(range(len(over)), key=over.__getitem__)
            faster = 1 - scored.step_time_s / winner.step_time_s
            found.append(Alternative(self.to_plan(scored, result)[0],
                                     (f"faster by {faster:.1%}" if faster >= 0.001 else "faster by <0.1%")
                                     + f" but over memory by {over[rank] / 1e9:.1f} GB"
                                     + (f" on pipeline rank {rank}" if problem.devices > 1 else "")))
        return found

    def _why_lost(self, other: Scored, winner: Scored) -> str:
        slower = other.step_time_s / winner.step_time_s - 1
        if slower < -1e-9:  # faster on paper: the robust objective preferred the winner
            hedge = self.interval(other)
            return (f"faster by {-slower:.1%} on paper, but {hedge.extrapolated_share:.0%} slower if what its price "
                    f"extrapolates runs at its pessimistic value ({'; '.join(hedge.reasons) or 'nothing'})")
        return f"slower by {slower:.1%}" if slower > 1e-9 else "equal step time; later in the tie-break order"

    def _binding_constraints(self, winner: Scored, alternatives: list[Alternative]) -> list[Binding]:
        """Which limits shape the winner, each with what relaxing it would buy (priced where the
        search can price it: more memory, TP across nodes)."""
        found: list[Binding] = []
        problem = self.pricer.partition_problem(winner.candidate)
        assert problem is not None  # the winner was priced, so its layout runs
        too_big = [a for a in alternatives if "over memory" in a.reason]
        used = winner.partition.device_memory_bytes
        full = [d for d, nbytes in enumerate(used) if nbytes > 0.9 * problem.capacity_bytes[d]]
        if too_big or full:
            fullest = max(range(len(used)), key=lambda d: used[d] / problem.capacity_bytes[d])
            constraint = "GPU memory" + (
                f" ({len(full)} of {len(used)} pipeline ranks above 90% of the usable memory; fullest: rank "
                f"{fullest}, {used[fullest] / 2**30:.1f} of {problem.capacity_bytes[fullest] / 2**30:.1f} GiB)"
                if full else "")
            nearest = min(too_big, key=lambda a: a.plan.predicted.peak_memory_bytes, default=None)
            relaxing = (f"{len(too_big)} faster plan(s) were refused for memory; the one needing the least, "
                        f"{nearest.plan.summary()}, is {nearest.reason}" if nearest
                        else "no faster plan was refused for memory: more memory buys nothing here")
            found.append(Binding(constraint, relaxing))
        bigger_tp = winner.candidate.tp * 2
        heads_problem = self.shape.tp_problem(bigger_tp)
        if heads_problem:
            found.append(Binding(f"head divisibility: tp={bigger_tp} is impossible ({heads_problem})",
                                 "a model whose heads divide by the larger degree could be split further; "
                                 "nothing to relax in the plan"))
        elif bigger_tp > self.cluster.gpus_per_node and not self.solver.allow_cross_node_tp:
            found.append(Binding(f"TP kept inside a node of {self.cluster.gpus_per_node} GPUs",
                                 self._cross_node_tp_gain(winner)))
        batch, step = self.train.global_batch_size, winner.candidate.dp * winner.candidate.micro_batch_size
        if batch % (winner.candidate.dp * 2) and winner.candidate.dp * 2 * winner.candidate.tp * winner.candidate.pp \
                * winner.candidate.cp <= self.cluster.world_size:
            found.append(Binding(f"batch divisibility: global batch {batch} does not split over "
                                 f"dp={winner.candidate.dp * 2}",
                                 f"train.global_batch_size={-(-batch // (2 * step)) * 2 * step} would allow "
                                 f"dp={winner.candidate.dp * 2}; plan again with it to price that"))
        if self.shape.experts and winner.candidate.ep == 1:
            found.append(self._expert_parallel_binding(winner))
        pinned = self._pin_overrides()
        if pinned:
            found.append(Binding("your pins: " + ", ".join(pinned),
                                 "drop a pin to let the solver choose that decision (plan again to price it)"))
        return found

    def _expert_parallel_binding(self, winner: Scored) -> Binding:
        """Why a model with experts got no expert parallelism: no legal plan has it (and what
        would allow one), or the best that has it, priced."""
        world, batch = self.cluster.world_size, self.train.global_batch_size
        extra = [c for c in enumerate_candidates(self.shape, world, self.cluster.gpus_per_node, batch, self.solver,
                                                 self.pins) if c.ep > 1]
        if self.shape.ep_blocker:
            return Binding(f"expert parallelism: no plan can use it: {self.shape.ep_blocker}",
                           "route the tokens outside the experts module and hand it them grouped by expert")
        if not extra:
            reason = (f"no data-parallel degree an expert-parallel degree divides divides the global batch {batch}"
                      if batch % world else
                      "the pins exclude it" if self._pin_overrides() else "no degree divides both dp and the experts")
            return Binding("expert parallelism: no plan can use it (the generated code carves it from the "
                           "data-parallel ranks and runs it with ZeRO-2/3, cp=1, no sequence parallelism and no "
                           f"hybrid sharding): {reason}",
                           f"train.global_batch_size={-(-batch // world) * world} would allow it; plan again "
                           "with it to price that" if batch % world else "nothing to relax in the plan")
        search = PlanSearch(self.pricer, time_limit_s=self.solver.time_limit_s, seed=self.solver.seed,
                            work_limit=min(10.0, self.solver.work_limit))
        best = search.run(extra).best
        if not best:
            return Binding("expert parallelism", f"none of the {len(extra)} plans with ep > 1 fits in memory")
        change = best[0].step_time_s / winner.step_time_s - 1
        verdict = (f"{change:.1%} slower" if change >= 0
                   else f"{-change:.1%} faster on paper (the objective chose otherwise)")
        return Binding("expert parallelism", f"the best plan with it, {self._summary(best[0])}, is {verdict}")

    def _cross_node_tp_gain(self, winner: Scored) -> str:
        """Price the plans with TP groups spanning nodes, the search otherwise leaves out: each TP
        group packed into whole nodes (the placement that crosses the fewest nodes; pricing every
        strided placement too, with an operator-wise TP solve per layer kind and placement, took
        37% of planning a 405B model)."""
        wider = replace(self.solver, allow_cross_node_tp=True)
        per_node = self.cluster.gpus_per_node
        def packed(c: Candidate) -> bool:
            degrees = {"tp": c.tp, "cp": c.cp, "pp": c.pp, "dp": c.dp}
            return Mesh.from_degrees(c.mesh_order, degrees).span("tp", per_node) == (c.tp // per_node, per_node)

        # One enumeration per cross-node degree (as if pinned), not all 300,000 candidates filtered.
        degrees = [self.pins.tp] if self.pins.tp is not None else \
            [tp for tp in divisors(self.cluster.world_size) if tp > per_node]
        extra = [c for tp in degrees for c in enumerate_candidates(self.shape, self.cluster.world_size, per_node,
                                                                   self.train.global_batch_size, wider,
                                                                   replace(self.pins, tp=tp))
                 if c.tp > per_node and packed(c)]
        if not extra:
            return "no plan with TP across nodes exists for this model and batch"
        search = PlanSearch(self.pricer, time_limit_s=self.solver.time_limit_s, seed=self.solver.seed,
                            work_limit=min(10.0, self.solver.work_limit))
        best = search.run(extra).best
        if not best:
            return "no plan with TP across nodes fits in memory"
        change = best[0].step_time_s / winner.step_time_s - 1
        return (f"the best plan with TP across whole nodes (tp={best[0].candidate.tp}) is "
                + (f"{-change:.1%} faster" if change < 0 else f"{change:.1%} slower") + ": "
                + ("allow it with solver.allow_cross_node_tp=true" if change < 0
                   else "keeping TP inside costs nothing"))

    def _pinned_partition(self) -> Callable[[PartitionProblem], Partition | None] | None:
        """The layer-wise split and per-layer recomputation the pins fix, priced as they are
        (None when the solver chooses them)."""
        if not self.pins.stages and not self.pins.layer_recompute:
            return None
        names = [layer.name for layer in self.profile.layers]
        starts = [0]
        for stage in (self.pins.stages or [])[1:]:
            starts.append(names.index(stage[0]))
        chosen = self.pins.layer_recompute or {}
        options = [self.pricer.recompute_options.index(chosen.get(name, Recompute.NONE)) for name in names]
        return lambda problem: evaluate(problem, starts, options)

    def _check_pins(self) -> None:
        """Contradictory or impossible pins, each named with the values that would work."""
        self._check_pinned_values()
        self._check_pinned_layers()
        self._check_pinned_tp()  # before the GPU count: a degree the model cannot take is the first problem
        self._check_pinned_ep()  # before the degrees: what ep cannot go with is named before what the model lacks
        self._check_pinned_expert_tp()
        self._check_pinned_degrees()
        self._check_pinned_batching()

    def _check_pinned_layers(self) -> None:
        """Pinned stages and per-layer recomputation, by the rules every plan obeys (autopar.domain.rules)."""
        names = [layer.name for layer in self.profile.layers]
        broken = rules.stage_partition(self.pins.stages, names, "plan.stages") if self.pins.stages else None
        broken = broken or rules.recompute_choices(self.pins.layer_recompute or {}, names, "plan.layer_recompute")
        if broken:
            raise UserError(f"{broken.problem}.", f"{broken.fix}, or leave the pin unset.")
        if self.pins.layer_recompute and not self.pins.stages and (self.pins.pp or 1) != 1:
            raise UserError("plan.layer_recompute with a pipeline needs the stages fixed as well.",
                            "add plan.stages=[[...], ...] or pin plan.pp=1.")

    def _check_pinned_values(self) -> None:
        """Pins outside their field's choices (the schema types them only as int / str)."""
        # What can be pinned is what the technique registry says runs.
        choices = {"schedule": searchable(Family.SCHEDULE), "recompute": RECOMPUTE_OPTIONS,
                   "cp_strategy": searchable(Family.CP_STRATEGY), "dp_sync": searchable(Family.DP_SYNC),
                   "zero_stage": searchable(Family.ZERO_STAGE)}
        for name, allowed in choices.items():
            value = getattr(self.pins, name)
            if value is not None and value in {t.value for t in _entries_without_runtime(name)}:
                entry = technique(Family(name), value)
                raise UserError(f"plan.{name}={value} ({entry.summary}) is priced by the cost model but the generated "
                                "code does not implement it, so the plan would run something else.",
                                f"use one of {', '.join(map(str, allowed))}, or leave plan.{name} unset.")
            if value is not None and value not in allowed:
                raise UserError(f"plan.{name}={value} is not a valid choice.",
                                f"use one of {', '.join(map(str, allowed))}, or leave plan.{name} unset.")
        for name in ("dp", "tp", "pp", "cp", "ep", "micro_batch_size", "chunks"):
            value = getattr(self.pins, name)
            if value is not None and value < 1:
                raise UserError(f"plan.{name}={value}: it must be at least 1.", f"pin plan.{name} to 1 or more, "
                                "or leave it unset for the solver to choose.")
        if self.train.global_batch_size < 1:
            raise UserError(f"train.global_batch_size={self.train.global_batch_size}: a step needs samples.",
                            "set train.global_batch_size to 1 or more.")

    def _check_pinned_degrees(self) -> None:
        world = self.cluster.world_size
        pinned = {axis: getattr(self.pins, axis) for axis in ("dp", "tp", "pp", "cp") if getattr(self.pins, axis)}
        product = 1
        for value in pinned.values():
            product *= value
        listed = "×".join(f"{axis}={value}" for axis, value in pinned.items())
        if product > world:
            raise UserError(f"The pinned degrees {listed} need {product} GPUs; the cluster has {world}.",
                            "lower the pins, or add GPUs (cluster.nodes / cluster.gpus_per_node).")
        if world % product:
            raise UserError(f"The pinned degrees {listed} multiply to {product}, which does not divide the "
                            f"cluster's {world} GPUs (every GPU needs a place on the mesh).",
                            "pin degrees whose product divides the GPU count, or change cluster.nodes.")
        if (self.pins.cp or 1) > 1 and not self.shape.tokens_per_sample:
            raise UserError(f"plan.cp={self.pins.cp} has no sequence to split: context parallelism gives each rank "
                            f"a shard of every sequence, and this model has "
                            f"{self.shape.cp_blocker or 'no sequence of tokens in its batch'}.",
                            "pin plan.cp=1 (or leave it unset).")
        if (self.pins.cp or 1) > 1 and self.shape.cp_blocker:
            raise UserError(f"plan.cp={self.pins.cp} would train a different model: context parallelism gives each "
                            f"rank a shard of every sequence, and this model computes something else on a shard: "
                            f"{self.shape.cp_blocker}.",
                            "pin plan.cp=1 (or leave it unset), or change the model: "
                            f"{cp_remedy(self.shape.cp_blocker)}.")
        split = [f"plan.{axis}={getattr(self.pins, axis)}" for axis in ("dp", "cp")
                 if (getattr(self.pins, axis) or 1) > 1]
        micro = self.pins.micro_batch_size
        split += [f"plan.micro_batch_size={micro}"] if micro and micro < self.train.global_batch_size else []
        if self.shape.batch_blocker and split:
            raise UserError(f"{', '.join(split)} would train a different model: it splits the batch, and "
                            f"{self.shape.batch_blocker}.",
                            "leave them unset (each forward then sees the whole batch: dp=cp=1, one micro-batch), or "
                            "use a per-sample norm (GroupNorm, LayerNorm) or torch.nn.SyncBatchNorm in the model.")
        if self.pins.sequence_parallel and self.shape.sp_blocker:
            raise UserError(f"plan.sequence_parallel=true cannot run on this model: {self.shape.sp_blocker}, and "
                            "sequence parallelism has no style that gathers the sequence for it.",
                            "pin plan.sequence_parallel=false (or leave it unset).")
        blocks = max(1, self.shape.num_blocks)
        if self.pins.pp is not None and self.pins.pp > blocks:
            raise UserError(f"plan.pp={self.pins.pp} needs more pipeline stages than the model's {blocks} "
                            "repeated blocks.", f"use plan.pp of at most {blocks}, or leave it unset.")

    def _check_pinned_ep(self) -> None:
        """A pinned expert-parallel degree the model, the generated code or the batch cannot take."""
        ep, experts = self.pins.ep, self.shape.experts
        if ep is None or ep == 1:
            return
        if not experts:
            raise UserError(f"plan.ep={ep} shards experts, but this model has none (no module named 'experts' "
                            "holding parameters stacked by expert, [E, ...]).", "leave plan.ep unset or pin it to 1.")
        if self.shape.ep_blocker:
            raise UserError(f"plan.ep={ep} cannot run on this model: {self.shape.ep_blocker}.",
                            "leave plan.ep unset or pin it to 1, or route the tokens outside the experts module "
                            "and hand it them grouped by expert (examples/mixtral.py shows how).")
        if experts % ep:
            raise UserError(f"plan.ep={ep} does not divide the {experts} experts of every MoE layer.",
                            f"use one of ep={', '.join(map(str, divisors(experts)))}, or leave plan.ep unset.")
        dropless = self.shape.dropless_experts
        conflicts = [f"plan.cp={self.pins.cp}"] if (self.pins.cp or 1) > 1 and not dropless else []
        conflicts += [f"plan.zero_stage={self.pins.zero_stage}"] if self.pins.zero_stage in (0, 1) else []
        conflicts += ["plan.hybrid_shard=true"] if self.pins.hybrid_shard else []
        if conflicts:
            raise UserError(f"plan.ep={ep} cannot go with {', '.join(conflicts)}: expert parallelism is generated "
                            "for data-parallel ranks (and context-parallel ones where the experts are exchanged "
                            "dropless), with pipeline stages and tensor parallelism, and ZeRO-2 or 3 over all "
                            "data-parallel ranks.",
                            "drop those pins, or pin plan.ep=1 to keep them.")
        world, batch = self.cluster.world_size, self.train.global_batch_size
        # The ranks EP is carved from, dp x cp, are the cluster's GPUs over pp x tp.
        pps = [self.pins.pp] if self.pins.pp else divisors(world)
        tps = [self.pins.tp] if self.pins.tp else divisors(world)
        cps = [self.pins.cp] if self.pins.cp else (divisors(world) if dropless else [1])
        carved = sorted({world // (pp * tp) for pp in pps for tp in tps if world % (pp * tp) == 0}, reverse=True)
        if not any(n % ep == 0 and n % cp == 0 and batch % (n // cp) == 0 for n in carved for cp in cps):
            ranks, label = ("data- and context-parallel", "dp x cp") if dropless else ("data-parallel", "dp")
            raise UserError(f"plan.ep={ep} is carved from the {ranks} ranks, which are the cluster's {world} "
                            f"GPUs over the pipeline stages and tensor-parallel ranks ({label}="
                            f"{' or '.join(map(str, carved))}): none is divisible by ep and divides the global batch "
                            f"{batch}.",
                            f"set train.global_batch_size to a multiple of {max(carved)}, or leave plan.ep unset.")

    def _check_pinned_expert_tp(self) -> None:
        """A pinned expert TP that no TP degree could run on this model."""
        if not self.pins.expert_tp:
            return
        width, tp = self.shape.expert_width, self.pins.tp
        if not self.shape.experts:
            raise UserError("plan.expert_tp=true splits experts, but this model has none.",
                            "leave plan.expert_tp unset or pin it to false.")
        if not width:
            raise UserError(f"plan.expert_tp=true cannot split these experts: {UNSPLITTABLE_WIDTH}.",
                            "leave plan.expert_tp unset or pin it to false.")
        if tp is not None and (tp == 1 or width % tp):
            raise UserError(f"plan.expert_tp=true splits the experts' width {width} over the tensor-parallel group, "
                            f"which plan.tp={tp} cannot do.",
                            f"pin plan.tp to a divisor of {width} above 1, or leave plan.expert_tp unset.")

    def _check_pinned_tp(self) -> None:
        tp = self.pins.tp
        if tp is None:
            return
        node, world = self.cluster.gpus_per_node, self.cluster.world_size

        def inside_nodes(t: int) -> bool:
            """Every TP group of t consecutive ranks stays on one node, as the search's mesh orders
            require (tp=3 on 8-GPU nodes puts ranks 6, 7 and 8 together)."""
            return Mesh(("tp", "dp"), (t, world // t)).span("tp", node)[0] == 1

        legal = [t for t in divisors(world) if not self.shape.tp_problem(t)
                 and (inside_nodes(t) or self.solver.allow_cross_node_tp)]
        if self.shape.tp_problem(tp):
            raise UserError(f"plan.tp={tp} cannot split this model: {self.shape.tp_problem(tp)}.",
                            f"use one of tp={', '.join(map(str, legal))} (legal on this cluster) or leave "
                            "plan.tp unset.")
        if tp > node and not self.solver.allow_cross_node_tp:
            raise UserError(f"plan.tp={tp} spans nodes of {node} GPUs; tensor parallelism is kept inside a node.",
                            f"use one of tp={', '.join(map(str, legal))}, or set solver.allow_cross_node_tp=true.")
        if not inside_nodes(tp) and not self.solver.allow_cross_node_tp:
            raise UserError(f"plan.tp={tp} does not divide the {node} GPUs of a node: some of its groups (ranks "
                            f"{node - node % tp} to {node - node % tp + tp - 1}) cross from one node to the next, and "
                            "tensor parallelism is kept inside a node.",
                            f"use one of tp={', '.join(map(str, legal))}, or set solver.allow_cross_node_tp=true.")

    def _check_pinned_batching(self) -> None:
        batch, dp, micro = self.train.global_batch_size, self.pins.dp, self.pins.micro_batch_size
        world = self.cluster.world_size
        if dp is not None and batch % dp:
            legal = [d for d in divisors(world) if batch % d == 0]
            raise UserError(f"plan.dp={dp} does not divide train.global_batch_size={batch}: every data-parallel "
                            "rank must get the same number of samples.",
                            f"pin plan.dp to one of {', '.join(map(str, legal))} (they divide both the batch and the "
                            f"{world} GPUs), or make train.global_batch_size a multiple of {dp} "
                            f"(e.g. {-(-batch // dp) * dp}).")
        per_rank = batch // dp if dp else batch
        if micro is not None and per_rank % micro:
            where = f"the {per_rank} samples per data-parallel rank" if dp else f"the global batch of {batch}"
            raise UserError(f"plan.micro_batch_size={micro} does not divide {where}.",
                            "pin a micro-batch size that divides it, or leave plan.micro_batch_size unset.")

    def _pin_overrides(self) -> list[str]:
        """The pins as the plan.<name>=<value> overrides that set them (layer maps, and how the
        model is traced, left out)."""
        return [f"plan.{name}={value}" for name, value in vars(self.pins).items()
                if value not in (None, {}, []) and name not in NOT_DECISIONS]

    def _why_no_candidates(self) -> str:
        pins = self._pin_overrides()
        return (f"No plan satisfies the constraints: the {self.cluster.world_size} GPUs must split as "
                f"dp×tp×pp×cp with dp dividing the global batch {self.train.global_batch_size}, tp dividing "
                f"the model's heads and weights within a node of {self.cluster.gpus_per_node} GPUs, pp at most "
                f"the {max(1, self.shape.num_blocks)} blocks, cp cutting the sequence into 2·cp equal chunks"
                + (f"; and since {self.shape.batch_blocker}, dp=cp=1 with the whole batch in one micro-batch (a "
                   f"pipeline schedule then has one micro-batch to run)" if self.shape.batch_blocker else "")
                + (f", and your pins ({', '.join(pins)})." if pins else "."))

    def _no_candidates_fix(self) -> str:
        """The nearest larger global batch that admits a plan, else dropping the pins."""
        batch, world = self.train.global_batch_size, self.cluster.world_size
        # A batch with a legal split is a multiple of its data-parallel degree, a divisor of the
        # world size: only the next multiple of each divisor is tried (a scan of every batch up to
        # 2x the world size never ended at a million GPUs).
        nearest = sorted({(batch // dp + 1) * dp for dp in divisors(world)})
        for larger in nearest:
            if self._any_candidate(larger, self.pins):
                return (f"use train.global_batch_size={larger} (the nearest larger batch with a legal split)"
                        + (", or change the pins." if self._pin_overrides() else "."))
        if self._pin_overrides() and self._any_candidate(batch, replace(self.pins, dp=None, tp=None, pp=None, cp=None,
                                                                        micro_batch_size=None)):
            return "drop the pinned degrees and micro-batch size (plan.dp/tp/pp/cp/micro_batch_size)."
        return ("use a cluster this model can fill (fewer GPUs per node or nodes, cluster.gpus_per_node / "
                "cluster.nodes), or a global batch divisible by more data-parallel ranks.")

    def _any_candidate(self, batch: int, pins: "PlanPins") -> bool:
        found = enumerate_candidates(self.shape, self.cluster.world_size, self.cluster.gpus_per_node, batch,
                                     self.solver, pins)
        return next(iter(found), None) is not None

    def _smallest_fitting_change(self) -> tuple[str, str]:
        """Re-run the search on larger clusters / bigger GPUs: the first that fits is the answer."""
        pins = self._pin_overrides()
        problem = (f"Nothing fits in memory on {self.cluster.world_size} × {self.cluster.node_gpus[0].name} "
                   f"({self.cluster.node_gpus[0].memory_bytes / 1e9:.0f} GB) with every split, ZeRO stage, "
                   "micro-batch size and recomputation the search allows"
                   + (f" under your pins ({', '.join(pins)})." if pins else "."))
        quick = replace(self.solver, work_limit=min(20.0, self.solver.work_limit), top_k=0)
        for factor in (2, 4, 8, 16):
            if self.cluster.world_size * factor > MAX_WORLD_SIZE:
                break  # beyond what the search handles in bounded time
            bigger = replace(self.cluster, node_gpus=self.cluster.node_gpus * factor)
            if self._fits(bigger, quick):
                return problem, f"use {factor}× the nodes ({bigger.world_size} GPUs; cluster.nodes={bigger.nodes})."
        current = self.cluster.node_gpus[0]
        # The GPU with the least memory that fits is the smallest change.
        for gpu in sorted((get_gpu(name) for name in known_gpus()), key=lambda g: (g.memory_bytes, g.name)):
            if gpu.memory_bytes > current.memory_bytes and gpu.name != "cpu":
                bigger = replace(self.cluster, node_gpus=tuple(gpu for _ in self.cluster.node_gpus))
                if self._fits(bigger, quick):
                    return problem, (f"use {gpu.name} GPUs ({gpu.memory_bytes / 1e9:.0f} GB) instead "
                                     f"(cluster.gpu={gpu.name}).")
        return problem, "use a larger cluster or a smaller model; even 16× the nodes does not fit."

    def _fits(self, cluster: ClusterSpec, solver: "SolverConfig") -> bool:
        planner = Planner(self.profile, cluster, self.train, solver, self.pins)
        candidates = planner.candidates()
        return bool(candidates) and bool(PlanSearch(planner.pricer, time_limit_s=solver.time_limit_s,
                                                    work_limit=solver.work_limit).run(candidates).best)


def _entries_without_runtime(name: str) -> list:
    """Registry entries of a plan field that are priced but not generated."""
    from autopar.domain.techniques import entries

    if name not in {f.value for f in Family}:
        return []
    return [t for t in entries(Family(name)) if t.runtime is None]

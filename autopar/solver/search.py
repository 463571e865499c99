"""Top-level search: best plan over every candidate configuration, exact within the space.

Branch and bound with three bounds, cheapest first (autopar.solver.bounds):
1. every candidate gets a floor from compute alone (`compute_floor`, `floor_bound_s`) and the
   candidates are taken in floor order;
2. a candidate is priced past its floor only when its floor is below the best priced bound
   still waiting: its memory first (`memory_rows`: a candidate that cannot fit however its
   layers are split and recomputed is refused there), then per-layer times (the whole
   `PartitionProblem`), whose `lower_bound_s` (balanced stages, fastest options) orders the
   priced ones;
3. before its partition ILP is solved, the memory-aware `block_lower_bound_s` may exclude it.
The loop stops when the smallest bound left cannot beat the k-th best plan found: the best
plan is then optimal within the space (status OPTIMAL). Each partition solve has a
deterministic work limit; one that stops early still proves a lower bound, which prunes the
candidate if it cannot beat the best plan.

The budget is deterministic work, not wall time, so the same inputs give the same plan on a busy
laptop and an idle server: work = CP-SAT's deterministic seconds over every general partition
solve + the block program's counted steps (`block_counts`) + `PRICING_WORK` per candidate priced
past its floor. A wall-clock `time_limit_s` remains only as a
generous safety cap; `SearchResult.stopped_by` says which limit (if any) stopped the loop, and
a plan stopped by the wall clock is reported as depending on machine load. If a limit stops the
loop, or a stopped solve could still beat the best plan, the status is FEASIBLE with
gap = (best - smallest bound not excluded) / best. A limit stops the search only once it has a
plan: a limit too short to find one still returns the first plan found (marked FEASIBLE), never
a false "nothing fits".
Ties are broken by enumeration order (smaller TP, then CP, PP, micro-batch, ...), so the same
inputs always give the same plan.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from autopar.solver.block_partition import BlockPartitioner, find_block_run
from autopar.solver.bounds import block_lower_bound_s, floor_bound_s, lower_bound_s, memory_cannot_fit
from autopar.solver.space import Candidate
from autopar.solver.stage_partition import StagePartitioner
from cost_models.pipeline import MemoryRows, Partition, PartitionProblem


OVER_MEMORY_KEPT = 16
# Work units charged per candidate priced past its floor: about its wall seconds on a 2-core laptop when
# it was set (~0.1 ms: 166,380 candidates priced in ~17 s for a 145.6B GPT on 1536 A100), so one
# unit of `work_limit` is roughly a second there, as one CP-SAT deterministic second roughly is.
# Pricing is faster now; the constant stays, since it is part of the deterministic budget (the
# same inputs must keep giving the same plan).
PRICING_WORK = 1e-4


class CandidatePricer(Protocol):
    """What the search needs from the cost model for one candidate."""

    def partition_problem(self, candidate: Candidate) -> PartitionProblem | None:
        """Per-layer prices under the candidate, or None when it cannot run at all."""

    def compute_floor(self, candidate: Candidate) -> tuple[list[float], list[float]] | None:
        """(per-layer seconds below every option's price, speed per pipeline rank), or None."""

    def memory_rows(self, candidate: Candidate) -> MemoryRows | None:
        """The memory part of `partition_problem`, dearer than the floor and far cheaper than the
        whole problem (None when the candidate cannot run, or the pricer has no such part: then
        its memory is checked on the whole problem)."""

    def fixed_time_s(self, candidate: Candidate) -> float:
        """Step time that does not depend on the partition (e.g. the optimizer's launch)."""


@dataclass(order=True)
class Scored:
    """A solved candidate: ordered by step time, then by enumeration index (the tie-break)."""

    step_time_s: float
    index: int
    candidate: Candidate = field(compare=False)
    partition: Partition = field(compare=False)


@dataclass
class SearchResult:
    best: list[Scored]
    status: str
    seconds: float
    candidates: int
    partitions_solved: int
    gap: float
    rejected: dict[str, int]
    work: float = 0.0  # deterministic work spent (module docstring): the same on any machine load
    stopped_by: str = ""  # "", "work_limit" or "time_limit" (the wall-clock safety cap)
    pruned: int = 0  # excluded by the memory-aware bound without a partition solve
    priced: int = 0  # candidates priced past their floor (in full, or their memory alone where it cannot fit)
    # (bound, index, candidate, problem) of candidates refused for memory, fastest bound first:
    # what the report shows as "would be faster, but does not fit".
    over_memory: list = field(default_factory=list)


@dataclass(frozen=True)
class SearchProgress:
    """Where the search is, for a progress display: the phase (pricing the candidates' compute
    floors, or solving in bound order), how far, and once a plan is found its step time and the
    relative gap to the lowest bound still open."""

    phase: str  # "pricing" | "solving"
    done: int
    total: int
    incumbent_s: float | None = None
    bound_s: float | None = None

    @property
    def gap(self) -> float | None:
        if self.incumbent_s is None or self.bound_s is None:
            return None
        return max(0.0, (self.incumbent_s - self.bound_s) / self.incumbent_s)


class PlanSearch:
    """Branch and bound over candidates with the partition ILP as the inner solver."""

    def __init__(self, pricer: CandidatePricer, time_limit_s: float = 600.0, top_k: int = 1, seed: int = 0,
                 workers: int = 1, progress: Callable[[SearchProgress], None] | None = None,
                 solve_work_limit: float = 2.0,
                 fixed_partition: Callable[[PartitionProblem], Partition | None] | None = None,
                 work_limit: float = float("inf")):
        self.pricer = pricer
        self.fixed_partition = fixed_partition  # pinned split: priced, not solved
        self.time_limit_s = time_limit_s  # wall-clock safety cap
        self.work_limit = work_limit  # deterministic budget (module docstring)
        self.top_k = max(1, top_k)
        self.general = StagePartitioner(time_limit_s=solve_work_limit, seed=seed, workers=workers)
        self.blocks = BlockPartitioner(time_limit_s=solve_work_limit)
        self.progress = progress

    def run(self, candidates: list[Candidate], cutoff_s: float = float("inf"),
            floors: list[tuple[float, int, Candidate]] | None = None) -> SearchResult:
        """The best `top_k` candidates; with `cutoff_s`, only plans faster than it are looked for
        (the robust objective's second search: a plan no faster than the one it would replace
        under the same prices cannot be chosen, so nothing at or above the cutoff is priced or
        solved, and finding nothing is an answer, not a failure). `floors`: another search's
        floors of the same candidates under prices no higher than this pricer's (the robust
        search's pessimistic prices only raise them), still lower bounds here, not computed again;
        the floors used are kept as `self.floors`."""
        start = time.perf_counter()
        rejected: dict[str, int] = {}
        if self.progress:
            self.progress(SearchProgress("pricing", 0, len(candidates)))
        if floors is None:
            floors = self._floors(candidates, rejected)
        self.floors = floors
        self.proven: dict[int, float] = {}  # index -> what pricing and solving proved of its price (`known_floors`)
        waiting: list[tuple[float, int, Candidate, PartitionProblem]] = []  # priced, by lower bound
        next_floor = 0
        best: list[Scored] = []  # max-heap by negated time, size top_k
        solved: dict[int, Partition | None] = {}
        open_bounds: list[float] = []  # lower bounds of solves stopped by their work limit
        stopped_at: float | None = None
        pruned = priced = 0
        stopped_by = ""

        def out_of_budget() -> bool:
            """Whether a limit is spent: the deterministic work budget first (so that a machine fast
            enough never reaches the wall clock cap and the result does not depend on load)."""
            nonlocal stopped_by
            if self._work(priced) > self.work_limit:
                stopped_by = "work_limit"
            elif time.perf_counter() - start > self.time_limit_s:
                stopped_by = "time_limit"
            return bool(stopped_by)

        over_memory: list[tuple[float, int, Candidate, PartitionProblem | None]] = []  # bound below the k-th best then

        def refuse_for_memory(bound: float, index: int, candidate: Candidate, problem: PartitionProblem | None
                              ) -> None:
            rejected["memory"] = rejected.get("memory", 0) + 1
            over_memory.append((bound, index, candidate, problem))
            self.proven[index] = float("inf")  # no partition fits: out of any later search

        while stopped_at is None:
            kth = -best[0].step_time_s if len(best) == self.top_k else cutoff_s
            # Price, in floor order, every candidate whose floor is below the best priced bound:
            # then no unpriced candidate can beat the one about to be solved.
            while next_floor < len(floors) and (not waiting or floors[next_floor][0] < waiting[0][0]):
                floor, index, candidate = floors[next_floor]
                if floor >= kth:
                    next_floor = len(floors)  # sorted: nothing later can beat the k-th best either
                    break
                if best and out_of_budget():
                    stopped_at = min(floor, waiting[0][0]) if waiting else floor
                    break
                next_floor += 1
                priced += 1
                memory = self.pricer.memory_rows(candidate)
                if memory is not None and memory_cannot_fit(memory):
                    # Its times are not priced: most candidates of a large search end here (70B
                    # on 512 H100: 1,877 of the 3,084 priced), and pricing their times was most
                    # of the search. Its floor stands for its bound among those refused.
                    refuse_for_memory(floor, index, candidate, None)
                    continue
                problem = self.pricer.partition_problem(candidate)
                if problem is None:
                    rejected["cannot run"] = rejected.get("cannot run", 0) + 1
                else:
                    item = (lower_bound_s(problem) + self.pricer.fixed_time_s(candidate), index, candidate, problem)
                    if memory is None and memory_cannot_fit(problem):  # a pricer without memory rows
                        refuse_for_memory(*item)
                    else:
                        heapq.heappush(waiting, item)
                        self.proven[index] = item[0]
            if stopped_at is not None or not waiting or waiting[0][0] >= kth:
                break
            if best and out_of_budget():
                stopped_at = waiting[0][0]
                break
            bound, index, candidate, problem = heapq.heappop(waiting)
            if self.progress:
                incumbent = min(-entry.step_time_s for entry in best) if best else None
                self.progress(SearchProgress("solving", next_floor, len(floors), incumbent, bound))
            fixed = self.pricer.fixed_time_s(candidate)
            key = id(problem)
            if key not in solved:
                tighter = self._memory_aware_bound(problem)
                self.proven[index] = max(bound, tighter + fixed)
                if tighter + fixed >= kth:
                    if tighter == float("inf"):
                        refuse_for_memory(bound, index, candidate, problem)
                    else:
                        pruned += 1
                    continue
                solved[key] = self.solve_partition(problem, kth - fixed)
            partition = solved[key]
            if partition is None:
                refuse_for_memory(bound, index, candidate, problem)
                continue
            if partition.bound_s is not None:
                self.proven[index] = max(self.proven[index], partition.bound_s + fixed)
            if partition.status != "OPTIMAL":
                assert partition.bound_s is not None  # a stopped solve reports its proven bound
                open_bounds.append(partition.bound_s + fixed)
            if not partition.stage_starts:
                continue
            scored = Scored(partition.step_time_s + fixed, index, candidate, partition)
            if scored.step_time_s >= cutoff_s:
                continue  # the partition solver's cutoff is a hint: not faster than asked for
            entry = Scored(-scored.step_time_s, -scored.index, candidate, partition)
            if len(best) < self.top_k:
                heapq.heappush(best, entry)
            elif entry > best[0]:
                heapq.heapreplace(best, entry)
        ranked = sorted(Scored(-e.step_time_s, -e.index, e.candidate, e.partition) for e in best)
        status, gap = "OPTIMAL", 0.0
        if ranked:
            top = ranked[0].step_time_s
            unexcluded = [b for b in open_bounds + ([stopped_at] if stopped_at is not None else []) if b < top]
            if unexcluded:
                status, gap = "FEASIBLE", (top - min(unexcluded)) / top
        elif open_bounds or stopped_at is not None:
            status = "UNKNOWN"
        if status == "OPTIMAL":
            stopped_by = ""  # a limit reached once nothing left could win changed nothing
        return SearchResult(best=ranked, status=status if ranked or status == "UNKNOWN" else "INFEASIBLE",
                            seconds=time.perf_counter() - start, candidates=len(candidates),
                            partitions_solved=len(solved), gap=gap, rejected=rejected,
                            work=round(self._work(priced), 6), stopped_by=stopped_by, pruned=pruned,
                            priced=priced,
                            over_memory=self._fastest_over_memory(over_memory))

    def _fastest_over_memory(self, refused: list[tuple[float, int, Candidate, PartitionProblem | None]]
                             ) -> list[tuple[float, int, Candidate, PartitionProblem]]:
        """The OVER_MEMORY_KEPT refused candidates of lowest bound, each with its problem and
        bound: those refused on their memory rows carry their floor, below their bound, so they
        are priced in floor order until the next floor is above the last one kept (the same
        list as had each been priced in full when refused)."""
        kept = sorted(((bound, index, candidate, problem) for bound, index, candidate, problem in refused
                       if problem is not None), key=lambda item: item[:2])[:OVER_MEMORY_KEPT]
        for floor, index, candidate, _ in sorted((item for item in refused if item[3] is None),
                                                 key=lambda item: item[:2]):
            if len(kept) == OVER_MEMORY_KEPT and floor > kept[-1][0]:
                break
            problem = self.pricer.partition_problem(candidate)
            if problem is None:
                continue
            kept.append((lower_bound_s(problem) + self.pricer.fixed_time_s(candidate), index, candidate, problem))
            kept = sorted(kept, key=lambda item: item[:2])[:OVER_MEMORY_KEPT]
        return kept

    def known_floors(self) -> list[tuple[float, int, Candidate]]:
        """The floors of the last run raised to what its pricing and solving proved of each
        candidate (its partition problem's lower bound, a solve's proven bound), those that
        cannot fit in memory left out. Still lower bounds under prices no lower than this
        search's (the robust objective's pessimistic prices raise every time and leave memory
        as it is), and far tighter for the candidates it priced: a later search over the same
        candidates given these prices few of them again."""
        raised = [(max(floor, self.proven.get(index, floor)), index, candidate)
                  for floor, index, candidate in self.floors]
        return sorted(entry for entry in raised if entry[0] != float("inf"))

    def _work(self, priced: int) -> float:
        """Deterministic work so far: the partition solves' deterministic seconds plus the pricing
        charge."""
        return self.general.work_s + self.blocks.work_s + priced * PRICING_WORK

    def _floors(self, candidates: list[Candidate], rejected: dict[str, int]) -> list[tuple[float, int, Candidate]]:
        """(compute-only lower bound, index, candidate) of every runnable candidate, ascending."""
        floors = []
        bounds: dict[tuple, float] = {}  # the pricer shares floor rows between candidates: bound them once
        # Bound once: this loop runs once per candidate, hundreds of thousands at frontier scale.
        compute_floor, fixed_time_s = self.pricer.compute_floor, self.pricer.fixed_time_s
        for index, candidate in enumerate(candidates):
            floor = compute_floor(candidate)
            if floor is None:
                rejected["cannot run"] = rejected.get("cannot run", 0) + 1
                continue
            layer_s, speeds = floor
            key = (id(layer_s), id(speeds), candidate.num_micro_batches, candidate.chunks)
            bound = bounds.get(key)
            if bound is None:
                bound = bounds[key] = floor_bound_s(layer_s, speeds, candidate.num_micro_batches, candidate.chunks)
            floors.append((bound + fixed_time_s(candidate), index, candidate))
        floors.sort()  # by floor, then index: indices are unique, so candidates are never compared
        return floors

    @staticmethod
    def _memory_aware_bound(problem: PartitionProblem) -> float:
        """`block_lower_bound_s` where the block program applies, else the plain bound."""
        run = find_block_run(problem)
        if run is None or problem.num_layers - run.count > 4:
            return lower_bound_s(problem)
        return max(lower_bound_s(problem), block_lower_bound_s(problem, run))

    def solve_partition(self, problem: PartitionProblem, beat_s: float = float("inf")) -> Partition | None:
        """Solve briefly first: the bound of a short solve often already shows the candidate
        cannot beat `beat_s`; only otherwise spend the full work limit."""
        if self.fixed_partition is not None:
            return self.fixed_partition(problem)
        found = find_block_run(problem)
        run = found if found is not None and problem.num_layers - found.count <= 4 else None
        partitioner = self.blocks if run is not None else self.general

        def solve() -> Partition | None:
            return self.blocks.solve(problem, run) if run is not None else self.general.solve(problem)

        full = partitioner.time_limit_s
        partitioner.time_limit_s = min(full, 0.2)
        try:
            quick = solve()
        finally:
            partitioner.time_limit_s = full
        if quick is None or quick.status == "OPTIMAL" or (quick.bound_s is not None and quick.bound_s >= beat_s):
            return quick
        return solve()

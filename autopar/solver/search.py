"""Top-level search: best plan over every candidate configuration, exact within the space.

Each candidate (autopar.solver.space) is priced into a `PartitionProblem` (per-layer times and
memory for that configuration) plus a partition-independent time. Its step time is at least
the lower bound `lower_bound_s` (perfectly balanced stages, cheapest recompute option, no
p2p), so candidates are visited in order of that bound and the partition ILP is solved only
while the bound can still beat the k-th best plan found: when the loop stops on the bound,
the best plan is optimal within the space (status OPTIMAL). Each partition solve has a
deterministic work limit; one that stops early still proves a lower bound, which prunes the
candidate if it cannot beat the best plan. If the time limit stops the loop, or a stopped solve
could still beat the best plan, the status is FEASIBLE with
gap = (best - smallest bound not excluded) / best.
Ties are broken by enumeration order (smaller TP, then CP, PP, micro-batch, ...), so the same
inputs always give the same plan.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from autopar.solver.block_partition import BlockPartitioner, find_block_run
from autopar.solver.bounds import block_lower_bound_s, lower_bound_s, memory_cannot_fit
from autopar.solver.space import Candidate
from autopar.solver.stage_partition import StagePartitioner
from cost_models.pipeline import Partition, PartitionProblem


class CandidatePricer(Protocol):
    """What the search needs from the cost model for one candidate."""

    def partition_problem(self, candidate: Candidate) -> PartitionProblem | None:
        """Per-layer prices under the candidate, or None when it cannot run at all."""

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
    pruned: int = 0  # excluded by the memory-aware bound without a partition solve


class PlanSearch:
    """Branch and bound over candidates with the partition ILP as the inner solver."""

    def __init__(self, pricer: CandidatePricer, time_limit_s: float = 60.0, top_k: int = 1, seed: int = 0,
                 workers: int = 1, progress: Callable[[int, int], None] | None = None,
                 solve_work_limit: float = 2.0):
        self.pricer = pricer
        self.time_limit_s = time_limit_s
        self.top_k = max(1, top_k)
        self.general = StagePartitioner(time_limit_s=solve_work_limit, seed=seed, workers=workers)
        self.blocks = BlockPartitioner(time_limit_s=solve_work_limit, seed=seed, workers=workers)
        self.progress = progress

    def run(self, candidates: list[Candidate]) -> SearchResult:
        start = time.perf_counter()
        rejected: dict[str, int] = {}
        bounded: list[tuple[float, int, Candidate, PartitionProblem]] = []
        for index, candidate in enumerate(candidates):
            problem = self.pricer.partition_problem(candidate)
            if problem is None:
                rejected["cannot run"] = rejected.get("cannot run", 0) + 1
                continue
            if memory_cannot_fit(problem):
                rejected["memory"] = rejected.get("memory", 0) + 1
                continue
            bounded.append((lower_bound_s(problem) + self.pricer.fixed_time_s(candidate), index, candidate, problem))
        bounded.sort(key=lambda item: (item[0], item[1]))

        best: list[Scored] = []  # max-heap by negated time, size top_k
        solved: dict[int, Partition | None] = {}
        open_bounds: list[float] = []  # lower bounds of solves stopped by their work limit
        stopped_at: float | None = None
        explored = 0
        pruned = 0  # candidates the memory-aware bound excluded without a solve
        for position, (bound, index, candidate, problem) in enumerate(bounded):
            kth = -best[0].step_time_s if len(best) == self.top_k else float("inf")
            if bound >= kth:
                break
            if time.perf_counter() - start > self.time_limit_s:
                stopped_at = bound
                break
            key = id(problem)
            if key not in solved:
                fixed = self.pricer.fixed_time_s(candidate)
                tighter = self._memory_aware_bound(problem)
                if tighter + fixed >= kth:
                    if tighter == float("inf"):
                        rejected["memory"] = rejected.get("memory", 0) + 1
                    else:
                        pruned += 1
                    continue
                solved[key] = self._solve_partition(problem, kth - fixed)
            explored += 1
            if self.progress:
                self.progress(position + 1, len(bounded))
            partition = solved[key]
            if partition is None:
                rejected["memory"] = rejected.get("memory", 0) + 1
                continue
            if partition.status != "OPTIMAL":
                open_bounds.append(partition.bound_s + self.pricer.fixed_time_s(candidate))
            if not partition.stage_starts:
                continue
            scored = Scored(partition.step_time_s + self.pricer.fixed_time_s(candidate), index, candidate, partition)
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
        return SearchResult(best=ranked, status=status if ranked or status == "UNKNOWN" else "INFEASIBLE",
                            seconds=time.perf_counter() - start, candidates=len(candidates),
                            partitions_solved=len(solved), gap=gap, rejected=rejected, pruned=pruned)

    @staticmethod
    def _memory_aware_bound(problem: PartitionProblem) -> float:
        """`block_lower_bound_s` where the block program applies, else the plain bound."""
        run = find_block_run(problem)
        if run is None or problem.num_layers - run.count > 4:
            return lower_bound_s(problem)
        return max(lower_bound_s(problem), block_lower_bound_s(problem, run))

    def _solve_partition(self, problem: PartitionProblem, beat_s: float = float("inf")) -> Partition | None:
        """Solve briefly first: the bound of a short solve often already shows the candidate
        cannot beat `beat_s`; only otherwise spend the full work limit."""
        run = find_block_run(problem)
        partitioner = self.blocks if run is not None and problem.num_layers - run.count <= 4 else self.general
        full = partitioner.time_limit_s
        partitioner.time_limit_s = min(full, 0.2)
        try:
            quick = partitioner.solve(problem, run) if partitioner is self.blocks else partitioner.solve(problem)
        finally:
            partitioner.time_limit_s = full
        if quick is None or quick.status == "OPTIMAL" or quick.bound_s >= beat_s:
            return quick
        return partitioner.solve(problem, run) if partitioner is self.blocks else partitioner.solve(problem)

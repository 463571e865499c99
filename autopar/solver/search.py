"""Top-level search: best plan over every candidate configuration, exact within the space.

Each candidate (autopar.solver.space) is priced into a `PartitionProblem` (per-layer times and
memory for that configuration) plus a partition-independent time. Its step time is at least
the lower bound `lower_bound_s` (perfectly balanced stages, cheapest recompute option, no
p2p), so candidates are visited in order of that bound and the partition ILP is solved only
while the bound can still beat the k-th best plan found: when the loop stops on the bound,
the best plan is optimal within the space (status OPTIMAL); if the time limit stops it first,
the status is FEASIBLE with gap = (best - smallest unexplored bound) / best.
Ties are broken by enumeration order (smaller TP, then CP, PP, micro-batch, ...), so the same
inputs always give the same plan.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from autopar.solver.block_partition import BlockPartitioner, find_block_run
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


_WORK: dict[int, tuple[list, float]] = {}


def _work_s(time_s: list[list[float]]) -> float:
    """Σ_l min_r time: memoised per table (the pricer shares tables between candidates)."""
    cached = _WORK.get(id(time_s))
    if cached is None or cached[0] is not time_s:
        cached = (time_s, sum(min(row) for row in time_s))
        _WORK[id(time_s)] = cached
    return cached[1]


def lower_bound_s(problem: PartitionProblem) -> float:
    """A step time no partition of the problem can beat (see module docstring)."""
    speeds = [problem.speed_of(d) for d in range(problem.devices)]
    work = _work_s(problem.time_s)
    slowest = work / sum(1.0 / s for s in speeds)
    v, m = problem.chunks, problem.micro_batches
    once = min(speeds) * sum(problem.per_step_s) / problem.devices if problem.per_step_s else 0.0
    return (m - 1 + 1 - 1 / v) * slowest + min(speeds) * work / v + once


def memory_cannot_fit(problem: PartitionProblem) -> bool:
    """Even with the least activation memory, the layers' bytes exceed all devices together."""
    need = sum(problem.static_bytes) + sum(min(row) * min(problem.in_flight) for row in problem.activation_bytes)
    return need + sum(problem.overhead_bytes) > sum(problem.capacity_bytes)


class PlanSearch:
    """Branch and bound over candidates with the partition ILP as the inner solver."""

    def __init__(self, pricer: CandidatePricer, time_limit_s: float = 60.0, top_k: int = 1, seed: int = 0,
                 workers: int = 1, progress: Callable[[int, int], None] | None = None):
        self.pricer = pricer
        self.time_limit_s = time_limit_s
        self.top_k = max(1, top_k)
        self.general = StagePartitioner(time_limit_s=min(30.0, time_limit_s), seed=seed, workers=workers)
        self.blocks = BlockPartitioner(time_limit_s=min(30.0, time_limit_s), seed=seed, workers=workers)
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
        status, gap, explored = "OPTIMAL", 0.0, 0
        for position, (bound, index, candidate, problem) in enumerate(bounded):
            kth = -best[0].step_time_s if len(best) == self.top_k else float("inf")
            if bound >= kth:
                break
            if time.perf_counter() - start > self.time_limit_s:
                status = "FEASIBLE"
                top = min((-item.step_time_s for item in best), default=float("inf"))
                gap = (top - bound) / top if best else 1.0
                break
            key = id(problem)
            if key not in solved:
                solved[key] = self._solve_partition(problem)
            explored += 1
            if self.progress:
                self.progress(position + 1, len(bounded))
            partition = solved[key]
            if partition is None:
                rejected["memory"] = rejected.get("memory", 0) + 1
                continue
            scored = Scored(partition.step_time_s + self.pricer.fixed_time_s(candidate), index, candidate, partition)
            entry = Scored(-scored.step_time_s, -scored.index, candidate, partition)
            if len(best) < self.top_k:
                heapq.heappush(best, entry)
            elif entry > best[0]:
                heapq.heapreplace(best, entry)
        ranked = sorted(Scored(-e.step_time_s, -e.index, e.candidate, e.partition) for e in best)
        return SearchResult(best=ranked, status=status if ranked else "INFEASIBLE",
                            seconds=time.perf_counter() - start, candidates=len(candidates),
                            partitions_solved=len(solved), gap=gap, rejected=rejected)

    def _solve_partition(self, problem: PartitionProblem) -> Partition | None:
        run = find_block_run(problem)
        if run is not None and problem.num_layers - run.count <= 4:
            return self.blocks.solve(problem, run)
        return self.general.solve(problem)

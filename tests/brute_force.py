"""Brute-force oracles for the planner tests: every candidate, every partition, every recompute option.

Prices each complete plan with the cost model (`cost_models.pipeline.evaluate` on the
pricer's per-layer prices) and returns the fastest that fits. It enumerates exactly the space
the real search covers — cuts at block boundaries when the model is prefix + identical blocks +
suffix, anywhere otherwise — so the two must agree on the optimum's step time.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from autopar.solver.block_partition import BlockRun, find_block_run
from autopar.solver.space import Candidate
from cost_models.pipeline import Partition, PartitionProblem, evaluate


@dataclass(frozen=True)
class BruteForceBest:
    candidate: Candidate
    partition: Partition
    step_time_s: float


def brute_force_plan(pricer, candidates: list[Candidate]) -> BruteForceBest | None:
    best: BruteForceBest | None = None
    for candidate in candidates:
        problem = pricer.partition_problem(candidate)
        if problem is None:
            continue
        run = find_block_run(problem)
        allowed = None
        if run is not None and problem.num_layers - run.count <= 4:
            allowed = set(range(run.first, run.first + run.count + 1))
        partition = brute_force_partition(problem, allowed_starts=allowed, even_chunks=run if allowed else None)
        if partition is None:
            continue
        step = partition.step_time_s + pricer.fixed_time_s(candidate)
        if best is None or step < best.step_time_s:
            best = BruteForceBest(candidate, partition, step)
    return best


def brute_force_partition(problem: PartitionProblem, allowed_starts: set[int] | None = None,
                          even_chunks: BlockRun | None = None) -> Partition | None:
    """Every contiguous partition (cuts only at `allowed_starts` if given; with `even_chunks`,
    only those whose device's chunks hold as many of the run's blocks as each other, one more
    at most, bar a first/last stage holding none) and option per layer, priced by `evaluate`:
    the oracle the partition ILPs are checked against."""
    L, P, options = problem.num_layers, problem.num_stages, len(problem.time_s[0])
    best: Partition | None = None
    positions = [start for start in range(1, L) if allowed_starts is None or start in allowed_starts]
    for cuts in itertools.combinations(positions, P - 1):
        starts = [0, *cuts]
        if even_chunks is not None and not _chunks_even(problem, even_chunks, starts):
            continue
        for chosen in itertools.product(range(options), repeat=L):
            candidate = evaluate(problem, starts, list(chosen))
            if candidate is not None and (best is None or candidate.step_time_s < best.step_time_s - 1e-12):
                best = candidate
    return best


def _chunks_even(problem: PartitionProblem, run: BlockRun, starts: list[int]) -> bool:
    bounds = starts + [problem.num_layers]
    blocks = [len(set(range(bounds[j], bounds[j + 1])) & set(range(run.first, run.first + run.count)))
              for j in range(problem.num_stages)]
    for device in range(problem.devices):
        counts = [blocks[j] for j in range(device, problem.num_stages, problem.devices)
                  if not (blocks[j] == 0 and j in (0, problem.num_stages - 1))]
        if counts and max(counts) - min(counts) > 1:
            return False
    return True

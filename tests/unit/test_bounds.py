"""Search bounds: never above the partition optimum (else the search would prune the best plan),
and the memory-aware bound sees the recomputation memory forces."""
from __future__ import annotations

import math
import random

import pytest

from autopar.solver.block_partition import BlockPartitioner, find_block_run
from autopar.solver.bounds import block_lower_bound_s, least_time_per_block, least_total, lower_bound_s
from tests.brute_force import brute_force_partition
from cost_models.pipeline import PartitionProblem
from tests.unit.test_stage_partition import GiB, block_problem


@pytest.mark.parametrize("seed", range(40))
def test_bounds_never_exceed_the_optimum(seed):
    rng = random.Random(500 + seed)
    devices = rng.choice([1, 2, 3])
    chunks = 2 if devices == 2 and rng.random() < 0.5 else 1
    problem = block_problem(rng, blocks=rng.randint(3, 6), devices=devices, chunks=chunks,
                            options=rng.choice([1, 2, 3]))
    if rng.random() < 0.5:  # GPipe: every device holds every micro-batch
        problem = PartitionProblem(**{**problem.__dict__, "in_flight": [float(problem.micro_batches)] * devices})
    run = find_block_run(problem)
    optimum = brute_force_partition(problem, allowed_starts=set(range(run.first, run.first + run.count + 1)),
                                    even_chunks=run)
    bound = block_lower_bound_s(problem, run)
    if optimum is None:
        return  # nothing to stay under (the bound may or may not see the infeasibility)
    assert bound <= optimum.step_time_s
    assert lower_bound_s(problem) <= optimum.step_time_s
    assert BlockPartitioner().solve(problem, run).step_time_s == optimum.step_time_s


def test_memory_aware_bound_sees_forced_recomputation():
    """GPipe with 8 micro-batches in flight: storing every activation needs 8 × 4 blocks × 1 GiB,
    the device has room for a quarter of that, so most blocks must recompute (1.5× the time).
    The plain bound assumes no recomputation; the memory-aware one sees most of it."""
    blocks, m = 4, 8
    problem = PartitionProblem(
        time_s=[[1.0, 1.5]] * blocks, activation_bytes=[[GiB, GiB // 16]] * blocks, static_bytes=[0] * blocks,
        send_s=[0.0] * blocks, devices=1, chunks=1, micro_batches=m, in_flight=[float(m)],
        capacity_bytes=[8 * GiB], overhead_bytes=[0])
    run = find_block_run(problem)
    optimum = BlockPartitioner().solve(problem, run)
    plain, aware = lower_bound_s(problem), block_lower_bound_s(problem, run)
    assert plain == pytest.approx(m * blocks * 1.0, abs=1e-3)
    # By hand: 1 GiB per micro-batch across 4 blocks -> mean 1/4 GiB per block, mixing the options
    # (1 GiB, 1.0 s) and (1/16 GiB, 1.5 s): share of the slow one (1 - 1/4) / (1 - 1/16) = 0.8,
    # time per block 1.0 + 0.8 × 0.5 = 1.4. In integers even one stored block overflows, so the
    # optimum recomputes all four (1.5 s each).
    assert aware == pytest.approx(m * blocks * 1.4, abs=1e-3)
    assert optimum.step_time_s == pytest.approx(m * blocks * 1.5)
    assert plain < aware <= optimum.step_time_s


def test_least_time_per_block_is_the_lower_envelope():
    times, acts = [1.0, 1.2, 2.0], [4.0, 2.0, 0.0]
    assert least_time_per_block(times, acts, 5.0) == 1.0
    assert least_time_per_block(times, acts, 3.0) == pytest.approx(1.1)  # halfway between the first two
    assert least_time_per_block(times, acts, 1.0) == pytest.approx(1.6)
    assert least_time_per_block(times, acts, -1.0) == math.inf


def _mix_by_pairs(times: list[float], acts: list[float], budget: float) -> float:
    """The envelope by brute force: the best single option that fits, or the best mix of any two."""
    best = min((t for t, a in zip(times, acts) if a <= budget), default=math.inf)
    for i in range(len(times)):
        for j in range(len(times)):
            if acts[i] < budget < acts[j]:
                share = (budget - acts[i]) / (acts[j] - acts[i])
                best = min(best, times[i] + share * (times[j] - times[i]))
    return best


def test_least_time_per_block_equals_the_best_mix_of_two_options():
    rng = random.Random(0)
    for _ in range(500):
        count = rng.randint(1, 5)
        times = [rng.choice([1.0, 2.0, rng.uniform(0.5, 3.0)]) for _ in range(count)]
        acts = [rng.choice([0.0, 4.0, rng.uniform(0.0, 8.0)]) for _ in range(count)]
        for budget in [rng.uniform(-1.0, 9.0), *acts]:
            assert least_time_per_block(times, acts, budget) == pytest.approx(_mix_by_pairs(times, acts, budget),
                                                                              rel=1e-12, abs=0)


def test_least_total_matches_exhaustive_split():
    rows = [[0.0, 1.0, 3.0, 6.0], [0.5, 1.0, 2.0, 4.0]]
    best = min(rows[0][a] + rows[1][3 - a] for a in range(4) if 3 - a < 4)
    assert least_total(rows, 3) == best

"""The block-count allocation (the second part of the block program): its exact enumeration
equals brute force over every allocation, and its work limit returns a valid bound."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from autopar.solver.block_counts import DeviceRow, allocate


def random_rows(rng: random.Random, devices: int, per_step: bool) -> list[DeviceRow]:
    """Tables as devices have them: counts from a few up, times growing with the count (with
    jumps where memory forces recomputation), once-per-step times growing with it or absent."""
    rows = []
    for _ in range(devices):
        first = rng.randint(0, 2)
        counts = np.arange(first, first + rng.randint(1, 6))
        per_block = rng.randint(50, 120)
        units = np.cumsum([rng.randint(0, 40) + per_block * (1 + (rng.random() < 0.3)) for _ in counts])
        once = np.array([rng.randint(0, 5) + 7 * n for n in counts]) if per_step else np.zeros(len(counts), int)
        rows.append(DeviceRow(counts, units.astype(np.int64), once.astype(np.int64)))
    return rows


def brute_force(rows: list[DeviceRow], blocks: int, weight: int, chunks: int) -> int | None:
    best = None
    for picks in itertools.product(*(range(len(row.counts)) for row in rows)):
        if sum(int(row.counts[i]) for row, i in zip(rows, picks)) != blocks:
            continue
        units = [int(row.units[i]) for row, i in zip(rows, picks)]
        value = weight * max(units) + sum(units) + chunks * max(int(row.once[i]) for row, i in zip(rows, picks))
        best = value if best is None else min(best, value)
    return best


@pytest.mark.parametrize("seed", range(60))
def test_allocation_equals_brute_force(seed):
    rng = random.Random(seed)
    rows = random_rows(rng, devices=rng.randint(1, 4), per_step=seed % 2 == 1)
    blocks = rng.randint(sum(int(row.counts.min()) for row in rows), sum(int(row.counts.max()) for row in rows) + 1)
    weight, chunks = rng.choice([0, 3, 15]), rng.choice([1, 2, 4])
    expected = brute_force(rows, blocks, weight, chunks)
    found = allocate(rows, blocks, weight, chunks)
    assert found.optimal
    if expected is None:
        assert found.picks is None
        return
    assert found.objective == found.bound == expected
    assert sum(int(row.counts[i]) for row, i in zip(rows, found.picks)) == blocks
    units = [int(row.units[i]) for row, i in zip(rows, found.picks)]
    once = max(int(row.once[i]) for row, i in zip(rows, found.picks))
    assert weight * max(units) + sum(units) + chunks * once == expected


def test_a_work_limit_returns_the_best_found_and_a_bound_below_the_optimum():
    rng = random.Random(3)
    rows = random_rows(rng, devices=4, per_step=True)
    blocks = sum(int(row.counts.max()) for row in rows) - 2
    optimum = brute_force(rows, blocks, 15, 2)
    stopped = allocate(rows, blocks, 15, 2, work_limit_s=0.0)
    assert not stopped.optimal
    assert stopped.bound <= optimum
    assert stopped.objective is None or stopped.objective >= optimum

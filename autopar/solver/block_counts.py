"""How many identical blocks each pipeline device holds: the second part of the block program
(`block_partition`), solved exactly by enumeration.

Each device d has a table over the counts n it can hold: D_d(n), its time per micro-batch at its
best recompute mix, and E_d(n), its once-per-step time (integer units). The program is

    min  W·max_d D_d(n_d) + Σ_d D_d(n_d) + v·max_d E_d(n_d)    s.t.  Σ_d n_d = K

with W = (m - 1)·v + (v - 1), the pipeline step of `stage_partition` in its units. For a
threshold M on the slowest device and E on the once-per-step time, every device may take the
counts whose D and E stay within them, and the least Σ_d D_d over those is a dynamic program over
the blocks handed out so far (one numpy vector of K + 1 per device and count). Thresholds are
taken in increasing order, and the first whose W·M + (least Σ_d D_d of any allocation) + v·E
reaches the best objective found ends the search: no later threshold can do better, so the answer
is optimal.
(CP-SAT solved the same program, a multiple-choice knapsack, in ~0.2 s whatever its size; a
frontier-scale search solves dozens.)

Work is counted in steps (a device's count tried by the dynamic program, a count priced in a
device's table), as deterministic seconds (`WORK_PER_STEP`, `WORK_PER_PRICE`), so the search's
budget and a solve's limit stay independent of machine load.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Deterministic seconds charged per step: about what one costs on a laptop core (a few numpy
# calls each), so that a unit of the search's budget stays roughly a second, as for CP-SAT's
# deterministic time. A table entry is dearer: it prices every split of its blocks over options.
WORK_PER_STEP = 1e-5
WORK_PER_PRICE = 2e-4
_NONE = 2**62  # "no way": larger than any sum of device times in units


@dataclass(frozen=True)
class DeviceRow:
    """A device's table: block counts it can hold and, for each, D and E in integer units."""

    counts: np.ndarray
    units: np.ndarray
    once: np.ndarray


@dataclass(frozen=True)
class Allocation:
    """Blocks per device (indices into each row; None if nothing was found), the objective, a
    proven lower bound of it, and whether the search finished (then bound == objective)."""

    picks: list[int] | None
    objective: int | None
    bound: int
    optimal: bool
    work_s: float


def allocate(rows: list[DeviceRow], blocks: int, weight: int, chunks: int,
             work_limit_s: float = float("inf")) -> Allocation:
    """The exact optimum of the program in the module docstring (or the best found within
    `work_limit_s` deterministic seconds, with its bound). No allocation at all: picks None,
    optimal True (proven infeasible)."""
    everything = [np.ones(len(row.counts), dtype=bool) for row in rows]
    unconstrained, steps = _least_sum(rows, everything, blocks)
    work = steps * WORK_PER_STEP
    if unconstrained is None:
        return Allocation(None, None, 0, True, work)
    floor_sum = _units(rows, unconstrained)  # Σ D of any allocation is at least this
    floor_once = int(max(row.once.min() for row in rows))
    best: tuple[int, list[int]] | None = None
    for slowest in np.unique(np.concatenate([row.units for row in rows])):
        bound = weight * int(slowest) + floor_sum + chunks * floor_once
        if best is not None and bound >= best[0]:
            break  # every allocation not yet seen has a device at least this slow
        within = [row.units <= slowest for row in rows]
        if not _can_hold(rows, within, blocks):
            continue
        if work > work_limit_s:
            return _stopped(best, bound, work)
        fastest, steps = _least_sum(rows, within, blocks)
        work += steps * WORK_PER_STEP
        if fastest is None:
            continue
        sum_within = _units(rows, fastest)  # Σ D of any allocation within this slowest device
        onces = np.unique(np.concatenate([row.once[mask] for row, mask in zip(rows, within)]))
        for once in onces[onces >= max(int(row.once[mask].min()) for row, mask in zip(rows, within))]:
            bound = weight * int(slowest) + sum_within + chunks * int(once)
            if best is not None and bound >= best[0]:
                break
            if work > work_limit_s:
                return _stopped(best, bound, work)
            masks = [mask & (row.once <= once) for row, mask in zip(rows, within)]
            picks = fastest if once >= _once(rows, fastest) else None
            if picks is None and _can_hold(rows, masks, blocks):
                picks, steps = _least_sum(rows, masks, blocks)
                work += steps * WORK_PER_STEP
            if picks is not None:
                objective = weight * max(int(row.units[i]) for row, i in zip(rows, picks)) \
                    + _units(rows, picks) + chunks * _once(rows, picks)
                if best is None or objective < best[0]:
                    best = (objective, picks)
    if best is None:
        return Allocation(None, None, 0, True, work)
    return Allocation(best[1], best[0], best[0], True, work)


def _units(rows: list[DeviceRow], picks: list[int]) -> int:
    return sum(int(row.units[i]) for row, i in zip(rows, picks))


def _once(rows: list[DeviceRow], picks: list[int]) -> int:
    return max(int(row.once[i]) for row, i in zip(rows, picks))


def _stopped(best: tuple[int, list[int]] | None, bound: int, work: float) -> Allocation:
    if best is None:
        return Allocation(None, None, bound, False, work)
    return Allocation(best[1], best[0], min(bound, best[0]), False, work)


def _can_hold(rows: list[DeviceRow], masks: list[np.ndarray], blocks: int) -> bool:
    """Whether counts within the masks can sum to `blocks` (a cheap necessary test)."""
    if not all(mask.any() for mask in masks):
        return False
    least = sum(int(row.counts[mask].min()) for row, mask in zip(rows, masks))
    most = sum(int(row.counts[mask].max()) for row, mask in zip(rows, masks))
    return least <= blocks <= most


def _least_sum(rows: list[DeviceRow], masks: list[np.ndarray], blocks: int) -> tuple[list[int] | None, int]:
    """(a pick per device with Σ counts = blocks and least Σ units, or None; steps taken)."""
    cost = np.full(blocks + 1, _NONE, dtype=np.int64)
    cost[0] = 0
    chosen_at: list[np.ndarray] = []
    steps = 0
    handed = np.arange(blocks + 1)
    for row, mask in zip(rows, masks):
        allowed = np.flatnonzero(mask & (row.counts <= blocks))
        if not len(allowed):
            return None, steps
        before = handed[None, :] - row.counts[allowed][:, None]  # blocks handed out before this device
        reached = np.where(before >= 0, cost[np.maximum(before, 0)] + row.units[allowed][:, None], _NONE)
        which = reached.argmin(axis=0)
        cost = np.minimum(reached[which, handed], _NONE)
        chosen_at.append(allowed[which])
        steps += len(allowed)
    if cost[blocks] >= _NONE:
        return None, steps
    picks, left = [], blocks
    for row, pick in zip(reversed(rows), reversed(chosen_at)):
        index = int(pick[left])
        picks.append(index)
        left -= int(row.counts[index])
    return picks[::-1], steps

"""Which micro-batches' activations a pipeline rank holds, chunk by chunk, as its schedule plays.

A rank's activation peak is not one count times its layers' bytes once it runs several model
chunks: torch's interleaved 1F1B (`ScheduleInterleaved1F1B`, Narayanan et al. 2021 §2.2.2)
runs (v-1)·r + 2·(p-1-d) forwards before its first backward (r micro-batches per round,
r = m / max(1, m // p)), taking them r at a time from chunk 0, 1, ..., so the first chunk
holds the most: on rank 0 of p = 8, v = 4, m = 32 its chunks hold 15/8/8/8 micro-batches at
the end of the warm-up, 39 in all (Korthikanti et al. 2022 §4.2.3: p·(1 + (p-1)/(p·v)) chunks'
worth, 1.22 p rather than p). In the steady state a forward of an early chunk pairs with a
backward of a late one, so the counts shift (16/9/8/6, 16/12/8/3, ...) while their sum stays:
which moment is the peak depends on how heavy each chunk is, which the partition decides. So
a rank's memory is priced at each moment no other covers chunk by chunk (`held_moments`), and
the partition solver keeps every one of them under the capacity.

GPipe holds all m micro-batches and 1F1B min(m, p - d) on rank d: one moment, the same on
every chunk.
"""
from __future__ import annotations

import functools

from autopar.domain.vocabulary import Schedule

Moment = tuple[float, ...]  # micro-batches held per local chunk (0 = the rank's first chunk)


def interleaved_order(stages: int, chunks: int, micro_batches: int, device: int) -> list[tuple[str, int]]:
    """("F" or "B", local chunk) of every compute action of rank `device` under interleaved 1F1B,
    in the order torch's schedule runs them (its `_get_1f1b_rank_ops` without zero bubble)."""
    p, v, m = stages, chunks, micro_batches
    per_round = m // max(1, m // p)
    warmup = min((v - 1) * per_round + 2 * (p - 1 - device), v * m)

    def forward_chunk(op: int) -> int:
        return (op // per_round) % v

    def backward_chunk(op: int) -> int:
        return v - 1 - ((op - warmup) // per_round) % v

    order = [("F", forward_chunk(op)) for op in range(warmup)]
    for op in range(warmup, v * m):
        order += [("F", forward_chunk(op)), ("B", backward_chunk(op))]
    order += [("B", backward_chunk(op)) for op in range(v * m, v * m + warmup)]
    return order


@functools.lru_cache(maxsize=4096)
def held_moments(schedule: str, stages: int, micro_batches: int, device: int, chunks: int = 1) -> tuple[Moment, ...]:
    """Rank `device`'s candidate activation peaks (module docstring): the counts per local chunk
    after each forward, keeping those no other moment covers on every chunk. Kept per arguments:
    a search asks for the same ranks' moments for every candidate sharing a pipeline shape (the
    145.6B GPT's: 693 calls, 2.2 s uncached)."""
    if stages == 1:
        return ((1.0,) * chunks,)  # no pipeline: gradient accumulation frees each micro-batch
    if schedule == Schedule.GPIPE:
        return ((float(micro_batches),) * chunks,)
    if schedule != Schedule.INTERLEAVED_1F1B or chunks == 1:
        return ((float(min(micro_batches, stages - device)),) * chunks,)
    counts = [0] * chunks
    seen: set[Moment] = set()
    for kind, chunk in interleaved_order(stages, chunks, micro_batches, device):
        counts[chunk] += 1 if kind == "F" else -1
        if kind == "F":
            seen.add(tuple(float(c) for c in counts))
    # Largest totals first: a moment covered by another is covered by one kept before it.
    kept: list[Moment] = []
    for moment in sorted(seen, key=sum, reverse=True):
        if not any(covers(other, moment) for other in kept):
            kept.append(moment)
    return tuple(sorted(kept))


def covers(moment: Moment, other: Moment) -> bool:
    """Whether `moment` holds at least as much as `other` on every chunk."""
    return all(a >= b for a, b in zip(moment, other))


def least_held(moments: tuple[Moment, ...]) -> float:
    """A count c with (rank's activation bytes) >= c · (its layers' activation bytes) whatever
    the partition: the most any moment holds on its emptiest chunk (a bound's memory floor)."""
    return max(min(moment) for moment in moments)

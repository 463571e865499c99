"""Lower bounds on a partition problem's step time: what lets the search skip a candidate
without solving its partition ILP.

Two bounds, the second tighter and dearer:

- `lower_bound_s`: perfectly balanced stages, every layer at its fastest option, the fewest
  possible sends, and for identical blocks the pigeonhole fact that some device holds at least
  ceil(K / p) of them. It ignores memory, so it is loose exactly where memory forces
  recomputation (GPipe holding every micro-batch, or a pipeline's first stage under 1F1B).
- `block_lower_bound_s`: for models of identical blocks (the `block_partition` program), it
  adds memory. Given n blocks, device d can at best mix recompute options fractionally so that
  their activations fit what its edges, buffers and in-flight micro-batches leave; g_d(n), the
  least time of such a mix, is the lower convex envelope of the options' (activation, time)
  points, scaled by n. Then the slowest device is at least the K-th smallest value of
  {D_d(n) : d, n >= 1} (each D_d grows with n, so a threshold T lets device d take every n with
  D_d(n) <= T), and the sum of device times is at least the greedy (D_d is convex in n)
  minimum of sum_d D_d(n_d) with sum_d n_d = K. Both relax the program (fractional options,
  edge layers at their cheapest time and, separately, their least memory), so they never exceed
  its optimum.
"""
from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING

from cost_models.held_activations import least_held
from cost_models.pipeline import TIME_UNITS_PER_S, MemoryRows, PartitionProblem

if TYPE_CHECKING:
    from autopar.solver.block_partition import BlockRun


_TABLE_SUMS: dict[int, tuple[list, float]] = {}


def table_sum(table: list) -> float:
    """Σ over layers of the row minimum (or the value): memoised per table object, since the
    pricer shares one table between the many candidates it applies to."""
    cached = _TABLE_SUMS.get(id(table))
    if cached is None or cached[0] is not table:
        cached = (table, sum(min(row) if isinstance(row, list) else row for row in table))
        _TABLE_SUMS[id(table)] = cached
    return cached[1]


_LONGEST_RUN: dict[int, tuple[list, int, float]] = {}


def longest_identical_run(time_s: list[list[float]]) -> tuple[int, float]:
    """(length, fastest time) of the longest run of layers with identical time rows."""
    cached = _LONGEST_RUN.get(id(time_s))
    if cached is None or cached[0] is not time_s:
        best, start = (0, 0.0), 0
        for layer in range(1, len(time_s) + 1):
            if layer == len(time_s) or time_s[layer] != time_s[start]:
                if layer - start > best[0]:
                    best = (layer - start, min(time_s[start]))
                start = layer
        cached = (time_s, *best)
        _LONGEST_RUN[id(time_s)] = cached
    return cached[1], cached[2]


def pipeline_step_s(slowest: float, total: float, once: float, micro_batches: int, chunks: int) -> float:
    """The step formula of `cost_models.pipeline.evaluate` from its three ingredients: the
    slowest device's time per micro-batch, the sum over devices, and the per-step part."""
    return (micro_batches - 1 / chunks) * slowest + total / chunks + once


def lower_bound_s(problem: PartitionProblem) -> float:
    """A step time no partition of the problem can beat, memory aside (module docstring)."""
    speeds = [problem.speed_of(d) for d in range(problem.devices)]
    sends = (problem.num_stages - 1) * min(problem.send_s) if problem.send_s else 0.0
    work = table_sum(problem.time_s) + sends
    slowest = work / sum(1.0 / s for s in speeds)
    blocks, block_time = longest_identical_run(problem.time_s)
    slowest = max(slowest, -(-blocks // problem.devices) * block_time * min(speeds))
    once = min(speeds) * table_sum(problem.per_step_s) / problem.devices if problem.per_step_s else 0.0
    return (pipeline_step_s(slowest, min(speeds) * work, once, problem.micro_batches, problem.chunks)
            - problem_slack_s(problem))


def floor_bound_s(layer_s: list[float], speeds: list[float], micro_batches: int, chunks: int) -> float:
    """`lower_bound_s` from compute alone (the pricer's `compute_floor`): below it, before the
    candidate's full prices exist. Balanced devices, plus the pigeonhole on identical layers."""
    work, longest, block = _floor_summary(layer_s)
    slowest = work / sum(1.0 / s for s in speeds)
    slowest = max(slowest, -(-longest // len(speeds)) * block * min(speeds))
    return (pipeline_step_s(slowest, min(speeds) * work, 0.0, micro_batches, chunks)
            - rounding_slack_s(micro_batches, len(speeds), len(layer_s), len(speeds) * chunks))


_FLOOR_SUMMARIES: dict[int, tuple[list, float, int, float]] = {}


def _floor_summary(layer_s: list[float]) -> tuple[float, int, float]:
    """(Σ seconds, length and value of the longest run of equal layers), memoised per list."""
    cached = _FLOOR_SUMMARIES.get(id(layer_s))
    if cached is None or cached[0] is not layer_s:
        longest, value, start = 0, 0.0, 0
        for layer in range(1, len(layer_s) + 1):
            if layer == len(layer_s) or layer_s[layer] != layer_s[start]:
                if layer - start > longest:
                    longest, value = layer - start, layer_s[start]
                start = layer
        cached = (layer_s, sum(layer_s), longest, value)
        _FLOOR_SUMMARIES[id(layer_s)] = cached
    return cached[1], cached[2], cached[3]


def memory_cannot_fit(problem: PartitionProblem | MemoryRows) -> bool:
    """Even with the least activation memory, the layers' bytes exceed all devices together
    (read from a problem, or from its memory rows before its times are priced)."""
    held = min(least_held(moments) for moments in problem.in_flight)
    need = table_sum(problem.static_bytes) + table_sum(problem.activation_bytes) * held
    return need + sum(problem.overhead_bytes) > sum(problem.capacity_bytes)


def least_time_per_block(times: list[float], activations: list[float], budget: float) -> float:
    """Least time of a fractional mix of options whose mean activation is at most `budget`
    (the lower convex envelope of the (activation, time) points); inf if none fits."""
    return _envelope_at(lower_envelope(times, activations), budget)


def lower_envelope(times: list[float], activations: list[float]) -> list[tuple[float, float]]:
    """The vertices (activation, time) of the options' lower convex envelope where time still
    falls, by rising activation: below the first no mix fits, past the last none is faster, and
    between two vertices the best mix is of those two (every other pair lies above the segment)."""
    points = sorted(zip(activations, times))
    hull: list[tuple[float, float]] = []
    for a, t in points:
        if hull and t >= hull[-1][1]:
            continue  # no faster than an option that needs no more memory
        while len(hull) >= 2 and _not_below(hull[-2], hull[-1], (a, t)):
            hull.pop()
        hull.append((a, t))
    return hull


def _not_below(first: tuple[float, float], middle: tuple[float, float], last: tuple[float, float]) -> bool:
    """Whether `middle` lies on or above the segment from `first` to `last` (not a vertex)."""
    return (middle[1] - first[1]) * (last[0] - first[0]) >= (last[1] - first[1]) * (middle[0] - first[0])


def _envelope_at(hull: list[tuple[float, float]], budget: float) -> float:
    """The envelope's time at mean activation `budget` (inf below its first vertex)."""
    if not hull or budget < hull[0][0]:
        return math.inf
    for (low_a, low_t), (high_a, high_t) in zip(hull, hull[1:]):
        if budget < high_a:
            if budget == low_a:
                return low_t
            return low_t + (budget - low_a) / (high_a - low_a) * (high_t - low_t)
    return hull[-1][1]


def block_lower_bound_s(problem: PartitionProblem, run: "BlockRun") -> float:
    """A memory-aware lower bound for the block program (module docstring); inf if even the
    relaxation cannot fit the blocks in memory."""
    p, v, K, f = problem.devices, problem.chunks, run.count, run.first
    P = problem.num_stages
    prefix, suffix = range(0, f), range(f + K, problem.num_layers)
    times, acts = problem.time_s[f], [float(a) for a in problem.activation_bytes[f]]
    envelope = lower_envelope(times, acts)
    static = problem.static_bytes[f]
    block_send = problem.send_s[f]
    if prefix:
        block_send = min(block_send, problem.send_s[prefix[-1]])
    device_times: list[list[float]] = []
    for d in range(p):
        edges = (list(prefix) if d == 0 else []) + (list(suffix) if d == (P - 1) % p else [])
        in_flight = least_held(problem.in_flight[d])  # the fewest micro-batches any of its layers holds
        edge_bytes = sum(problem.static_bytes[layer] + in_flight * min(problem.activation_bytes[layer])
                         for layer in edges)
        budget = problem.capacity_bytes[d] - problem.overhead_bytes[d] - edge_bytes
        if budget < 0:
            return math.inf
        senders = v - (1 if d == p - 1 else 0) if P > 1 else 0
        fixed = sum(min(problem.time_s[layer]) for layer in edges) + senders * block_send
        speed = problem.speed_of(d)
        row = [speed * fixed]
        for n in range(1, K + 1):
            room = budget - n * static
            per_block = _envelope_at(envelope, room / (in_flight * n)) if in_flight else \
                (min(times) if room >= 0 else math.inf)
            if per_block == math.inf:
                break
            row.append(speed * (fixed + n * per_block))
        device_times.append(row)
    candidates = sorted(value for row in device_times for value in row[1:])
    if len(candidates) < K:
        return math.inf
    slowest = max(candidates[K - 1], max(row[0] for row in device_times))
    total = least_total(device_times, K)
    once = min(problem.speed_of(d) for d in range(p)) * table_sum(problem.per_step_s) / p if problem.per_step_s else 0.0
    return pipeline_step_s(slowest, total, once, problem.micro_batches, v) - problem_slack_s(problem)


def rounding_slack_s(micro_batches: int, devices: int, num_layers: int, num_stages: int) -> float:
    """How far below the exact value the ILP's objective can fall: it rounds every time term to
    whole units (half a unit each), and the step formula weighs a device's terms up to m + p + 1
    times. A bound lowered by this never prunes a candidate that ties the best plan."""
    return (micro_batches + devices + 1) * (2 * num_layers + num_stages) * 0.5 / TIME_UNITS_PER_S


def least_total(device_times: list[list[float]], blocks: int) -> float:
    """min Σ_d D_d(n_d) over Σ_d n_d = blocks, for convex rows D_d (greedy by marginal cost)."""
    total = sum(row[0] for row in device_times)
    taken = [0] * len(device_times)
    heap = [(row[1] - row[0], d) for d, row in enumerate(device_times) if len(row) > 1]
    heapq.heapify(heap)
    for _ in range(blocks):
        if not heap:
            return math.inf
        step, d = heapq.heappop(heap)
        total += step
        taken[d] += 1
        row = device_times[d]
        if taken[d] + 1 < len(row):
            heapq.heappush(heap, (row[taken[d] + 1] - row[taken[d]], d))
    return total


def problem_slack_s(problem: PartitionProblem) -> float:
    return rounding_slack_s(problem.micro_batches, problem.devices, problem.num_layers, problem.num_stages)

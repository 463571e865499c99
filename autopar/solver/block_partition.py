"""Pipeline partition for models made of identical blocks: the same program as
`stage_partition`, compressed so a 96-layer model on 64 stages solves in milliseconds.

Transformers are a prefix (embeddings), K identical blocks and a suffix (final norm, head).
Cuts fall at block boundaries; the prefix stays with the first stage and the suffix with the
last, and either of those stages may hold no block at all (the uneven embedding/head stages).
Because the blocks are identical, a stage is described by how many blocks it holds with each
recompute option; the order inside a stage does not change time or memory.

    variables  n[j] ∈ [0, K]  blocks on virtual stage j;  k[j,r] ∈ [0, K] of them with option r;
               y[l,r] ∈ {0,1} option of each prefix/suffix layer; z ∈ {0,1}: n[0] = 0
    constraints Σ_j n[j] = K, Σ_r k[j,r] = n[j], n[j] ≥ 1 for stages that hold nothing else,
               the n[j] of one device's chunks within one of each other (bar an empty
               first/last stage), memory per device at every moment of its schedule as in
               `stage_partition` (a device's chunks are held unevenly, so where its blocks with
               each option sit matters), D_d, M, E as there
    objective  identical to `stage_partition` (same integer units), so `evaluate` prices the
               decoded partition to exactly the optimum's value.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ortools.sat.python import cp_model

from autopar.solver.stage_partition import priced_solution, solve_deterministically, unresolved
from cost_models.pipeline import Partition, PartitionProblem, mib_down, mib_up, time_units


@dataclass(frozen=True)
class BlockRun:
    """Layers [first, first + count) are identical blocks."""

    first: int
    count: int


def _earlier_chunks_held_longer(moments: tuple[tuple[float, ...], ...]) -> bool:
    return all(moment[c] >= moment[c + 1] for moment in moments for c in range(len(moment) - 1))


def _empty_flags(problem: PartitionProblem, device: int, chunk: int, empty_first, empty_last) -> list:
    """The flags saying that chunk `chunk` of `device` is the first or last stage left without
    blocks (it holds the prefix or the suffix alone); none for any other stage."""
    stage = chunk * problem.devices + device
    return [flag for flag, edge in ((empty_first, 0), (empty_last, problem.num_stages - 1)) if stage == edge]


def _heaviest_first(problem: PartitionProblem, block: int) -> list[int]:
    """The recompute options, those keeping the most activation bytes of a block first."""
    return sorted(range(len(problem.time_s[block])), key=lambda r: -problem.activation_bytes[block][r])


def find_block_run(problem: PartitionProblem) -> BlockRun | None:
    """The longest run of layers with identical prices (time, memory, send, per-step)."""
    def key(layer: int) -> tuple:
        return (tuple(problem.time_s[layer]), tuple(problem.activation_bytes[layer]), problem.static_bytes[layer],
                problem.send_s[layer], problem.per_step_s[layer] if problem.per_step_s else 0.0,
                problem.step_bytes[layer] if problem.step_bytes else 0)

    best = BlockRun(0, 0)
    start = 0
    for layer in range(1, problem.num_layers + 1):
        if layer == problem.num_layers or key(layer) != key(start):
            if layer - start > best.count:
                best = BlockRun(start, layer - start)
            start = layer
    return best if best.count >= 2 else None


class BlockPartitioner:
    """Solves the compressed program for a problem whose middle layers are identical."""

    def __init__(self, time_limit_s: float = 10.0, seed: int = 0, workers: int = 1):
        self.time_limit_s = time_limit_s  # CP-SAT deterministic seconds per solve
        self.seed = seed
        self.workers = workers
        self.work_s = 0.0  # deterministic seconds spent by all solves so far (the search's budget)

    def solve(self, problem: PartitionProblem, run: BlockRun) -> Partition | None:
        P, p, v = problem.num_stages, problem.devices, problem.chunks
        K, f = run.count, run.first
        prefix = list(range(0, f))
        suffix = list(range(f + K, problem.num_layers))
        options = len(problem.time_s[0])
        if P - 2 > K or (P == 1 and not K):
            return None
        model = cp_model.CpModel()
        # Per virtual stage j = c·p + d (chunk c of device d) where the schedule holds a device's
        # chunks unevenly (interleaving, m > p): its time is the sum over its chunks, its memory
        # is not. Otherwise per device, which solves far faster (a device's chunks are one group,
        # spread evenly when decoded).
        per_chunk = any(len(set(moment)) > 1 for moments in problem.in_flight for moment in moments)
        groups = v if per_chunk else 1
        n = [[model.new_int_var(0, K, f"n[{d},{g}]") for g in range(groups)] for d in range(p)]
        k = [[[model.new_int_var(0, K, f"k[{d},{g},{r}]") for r in range(options)] for g in range(groups)]
             for d in range(p)]
        y = {layer: [model.new_bool_var(f"y[{layer},{r}]") for r in range(options)] for layer in prefix + suffix}
        empty_first = model.new_bool_var("first_stage_without_blocks")
        empty_last = model.new_bool_var("last_stage_without_blocks")
        if not prefix or P == 1:
            model.add(empty_first == 0)
        if not suffix or P == 1:
            model.add(empty_last == 0)
        model.add(sum(n[d][g] for d in range(p) for g in range(groups)) == K)
        for d in range(p):
            for g in range(groups):
                model.add(sum(k[d][g]) == n[d][g])
            if per_chunk:
                self._even_chunks(model, problem, d, n[d], empty_first, empty_last, K)
                if _earlier_chunks_held_longer(problem.in_flight[d]):
                    self._canonical_chunks(model, problem, d, n[d], k[d], f, empty_first, empty_last)
                continue
            # Every chunk holds at least one block, except a first/last stage that holds the
            # prefix/suffix and may hold nothing else.
            flags = [flag for c in range(v) for flag in _empty_flags(problem, d, c, empty_first, empty_last)]
            model.add(n[d][0] >= v - sum(flags))
            if v == 1:  # the empty stage is the device's only chunk: the device holds no block
                for flag in flags:
                    model.add(n[d][0] == 0).only_enforce_if(flag)
        for choices in y.values():
            model.add_exactly_one(choices)
        hint = self._hint(problem, run) if per_chunk else None
        if hint is not None:  # the cautious per-device program's answer, arranged as the program allows
            for d in range(p):
                for g in range(groups):
                    model.add_hint(n[d][g], sum(hint[g * p + d]))
                    for r in range(options):
                        model.add_hint(k[d][g][r], hint[g * p + d][r])
        else:  # blocks spread evenly, fastest option (a good start for the search; not a constraint)
            fastest = min(range(options), key=lambda r: problem.time_s[f][r])
            for d in range(p):
                for g in range(groups):
                    stages = [c * p + d for c in range(v)] if not per_chunk else [g * p + d]
                    share = sum(K // P + (1 if j < K % P else 0) for j in stages)
                    model.add_hint(n[d][g], share)
                    for r in range(options):
                        model.add_hint(k[d][g][r], share if r == fastest else 0)

        block = f  # any block's prices stand for all of them
        device_time: list[list[Any]] = [[] for _ in range(p)]
        per_step: list[list[Any]] = [[] for _ in range(p)]
        memory: list[list[list[Any]]] = [[[] for _ in problem.in_flight[d]] for d in range(p)]
        step_memory: list[list[Any]] = [[] for _ in range(p)]
        for d in range(p):
            speed = problem.speed_of(d)
            moments = problem.in_flight[d]
            for g in range(groups):
                device_time[d] += [time_units(speed * problem.time_s[block][r]) * k[d][g][r] for r in range(options)]
                for q, moment in enumerate(moments):
                    memory[d][q] += [mib_up(problem.held_bytes(block, r, moment[g])) * k[d][g][r]
                                     for r in range(options)]
                if problem.step_bytes:
                    step_memory[d] += [mib_up(problem.at_step_bytes(block)) * n[d][g]]
                if problem.per_step_s:
                    per_step[d].append(time_units(speed * problem.per_step_s[block]) * n[d][g])
            block_send = time_units(speed * problem.send_s[block])
            senders = v - (1 if d == p - 1 else 0)  # every stage but the last sends its output
            if d == 0 and prefix and P > 1:
                prefix_send = time_units(speed * problem.send_s[prefix[-1]])
                device_time[d].append(senders * block_send + (prefix_send - block_send) * empty_first)
            else:
                device_time[d].append(senders * block_send)
            edge_layers = [(layer, 0) for layer in prefix if d == 0]
            edge_layers += [(layer, groups - 1) for layer in suffix if d == (P - 1) % p]
            for layer, c in edge_layers:
                device_time[d] += [time_units(speed * problem.time_s[layer][r]) * y[layer][r] for r in range(options)]
                for q, moment in enumerate(moments):
                    memory[d][q] += [mib_up(problem.held_bytes(layer, r, moment[c])) * y[layer][r]
                                     for r in range(options)]
                if problem.step_bytes:
                    step_memory[d] += [mib_up(problem.at_step_bytes(layer)) * y[layer][r] for r in range(options)]
                if problem.per_step_s:
                    per_step[d].append(time_units(speed * problem.per_step_s[layer]))

        horizon = 10**15
        slowest = model.new_int_var(0, horizon, "slowest")
        once = model.new_int_var(0, horizon, "per_step")
        device_vars = []
        for d in range(p):
            var = model.new_int_var(0, horizon, f"D[{d}]")
            model.add(var == sum(device_time[d]))
            model.add(slowest >= var)
            model.add(once >= sum(per_step[d]))
            for terms in memory[d]:  # every moment that can be the device's peak
                model.add(sum(terms) + mib_up(problem.overhead_bytes[d]) <= mib_down(problem.capacity_bytes[d]))
            if problem.step_bytes:
                model.add(sum(step_memory[d]) + mib_up(problem.step_overhead_bytes[d])
                          <= mib_down(problem.capacity_bytes[d]))
            device_vars.append(var)
        m = problem.micro_batches
        model.minimize(((m - 1) * v + (v - 1)) * slowest + sum(device_vars) + v * once)

        solver, status = solve_deterministically(model, self.time_limit_s, self.seed, self.workers)
        self.work_s += solver.deterministic_time
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return unresolved(problem, solver, status)
        counts = [[solver.value(var) for var in k[d][g]] for g in range(groups) for d in range(p)]
        if not per_chunk:
            counts = self._spread(problem, [[solver.value(var) for var in k[d][0]] for d in range(p)],
                                  solver.value(empty_first), solver.value(empty_last))
        starts, chosen = self._decode(solver, problem, run, counts, y, prefix, suffix)
        return priced_solution(problem, starts, chosen, solver, status)

    def _hint(self, problem: PartitionProblem, run: BlockRun) -> list[list[int]] | None:
        """Blocks per option of each virtual stage from the per-device program with every chunk
        held as long as the device's chunks on average at its fullest moment (it solves in
        milliseconds), arranged heaviest options last; None if that program finds nothing."""
        cautious = replace(problem, in_flight=[((max(sum(moment) for moment in moments) / problem.chunks,)
                                                 * problem.chunks,) for moments in problem.in_flight])
        found = self.solve(cautious, run)
        if found is None or found.status not in ("OPTIMAL", "FEASIBLE"):
            return None
        P, p = problem.num_stages, problem.devices
        options = len(problem.time_s[0])
        stages = found.stages(problem.num_layers)
        blocks = range(run.first, run.first + run.count)
        heaviest_first = _heaviest_first(problem, run.first)
        counts = [[0] * options for _ in range(P)]
        for d in range(p):
            chunks = list(range(d, P, p))
            sizes = sorted(sum(1 for layer in stages[j] if layer in blocks) for j in chunks)
            pool = [r for r in heaviest_first for layer in blocks
                    if found.options[layer] == r and any(layer in stages[j] for j in chunks)]
            for j, size in zip(reversed(chunks), reversed(sizes)):  # the last chunk first
                for r in pool[:size]:
                    counts[j][r] += 1
                pool = pool[size:]
        return counts

    @staticmethod
    def _canonical_chunks(model, problem, d, n, k, block, empty_first, empty_last) -> None:
        """Of a device's arrangements of its blocks over its chunks, allow only the one that holds
        least, where the schedule holds its earlier chunks at least as long as its later ones at
        every moment (as torch's interleaved schedule does): larger chunks last, and blocks with
        more activations in later chunks than blocks with fewer (the rearrangement inequality).
        Time does not depend on the arrangement, so the optimum stays; the search space shrinks
        to one arrangement per device's totals."""
        v = problem.chunks
        flags = {c: _empty_flags(problem, d, c, empty_first, empty_last) for c in range(v)}
        heaviest_first = _heaviest_first(problem, block)
        for c in range(v - 1):
            unflagged = [flag.Not() for flag in flags[c] + flags[c + 1]]
            model.add(n[c] <= n[c + 1]).only_enforce_if(unflagged)
            # Where chunk c holds any of the heaviest `depth` options, chunk c + 1 holds only them.
            for depth in range(1, len(heaviest_first)):
                heavier = heaviest_first[:depth]
                spills = model.new_bool_var(f"spills[{d},{c},{depth}]")
                model.add(sum(k[c][r] for r in heavier) == 0).only_enforce_if(spills.Not())
                model.add(sum(k[c + 1][r] for r in heavier) == n[c + 1]).only_enforce_if(spills)

    @staticmethod
    def _even_chunks(model, problem, d, n, empty_first, empty_last, K) -> None:
        """Every chunk of device d holds at least one block, except a first/last stage that holds
        the prefix/suffix and may hold nothing else; and its chunks hold as many blocks as each
        other (one more at most), as interleaving runs them in turn: the step time prices a
        device's total, which uneven chunks would keep while stalling the stages waiting on them."""
        fewest = model.new_int_var(0, K, f"fewest[{d}]")
        for c, blocks in enumerate(n):
            empty = _empty_flags(problem, d, c, empty_first, empty_last)
            model.add(blocks >= 1 - sum(empty))
            for flag in empty:
                model.add(blocks == 0).only_enforce_if(flag)
            for constraint in (fewest <= blocks, blocks <= fewest + 1):
                model.add(constraint).only_enforce_if([flag.Not() for flag in empty])

    @staticmethod
    def _spread(problem, device_options, empty_first, empty_last) -> list[list[int]]:
        """Each device's blocks (per option) spread over its chunks: evenly, first chunks get the
        remainder, an empty first/last stage none; option 0's blocks first. Per virtual stage."""
        P, p = problem.num_stages, problem.devices
        counts = [[0] * len(device_options[0]) for _ in range(P)]
        for d in range(p):
            chunks = [j for j in range(d, P, p) if not (j == 0 and empty_first) and not (j == P - 1 and empty_last)]
            left = list(device_options[d])
            total = sum(left)
            for position, j in enumerate(chunks):
                for _ in range(total // len(chunks) + (1 if position < total % len(chunks) else 0)):
                    option = next(r for r, count in enumerate(left) if count > 0)
                    left[option] -= 1
                    counts[j][option] += 1
        return counts

    @staticmethod
    def _decode(solver, problem, run, counts, y, prefix, suffix) -> tuple[list[int], list[int]]:
        """Lay the stages out in order, each with its blocks per option (`counts[j]`); within a
        stage, option 0's blocks come first, then option 1's, ..."""
        P = problem.num_stages
        starts, chosen = [0], [0] * problem.num_layers
        for layer in prefix + suffix:
            chosen[layer] = next(r for r, var in enumerate(y[layer]) if solver.value(var))
        position = run.first
        for j in range(P):
            if j > 0:
                starts.append(position)
            for option, count in enumerate(counts[j]):
                for _ in range(count):
                    chosen[position] = option
                    position += 1
        return starts, chosen

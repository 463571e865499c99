"""Pipeline partition for models made of identical blocks: the same program as
`stage_partition`, compressed so a 126-block model on 64 stages solves in milliseconds.

Transformers are a prefix (embeddings), K identical blocks and a suffix (final norm, head).
Cuts fall at block boundaries; the prefix stays with the first stage and the suffix with the
last, and either of those stages may hold no block at all (the uneven embedding/head stages).
Because the blocks are identical, a device is described by how many blocks it holds with each
recompute option; its chunks hold as many blocks as each other (one more at most, the larger
ones last), as interleaving runs them in turn and the step time prices the device's total.

Memory and time are separable by device: what device d holds decides only its own memory and
its own time D_d, and the step time grows with every D_d. So the program is solved in two parts:

1. `DeviceTable`, per device and block count n: the least time of any way to hold n blocks that
   fits at every moment of its schedule (options per block, the edge layers' options, whether
   its first/last stage holds the prefix/suffix alone), enumerated exactly with numpy. Where
   the schedule holds the device's earlier chunks at least as long as its later ones at every
   moment (torch's interleaved 1F1B always does: `held_activations`), the arrangement that holds
   least is known without search: heavier options in later chunks (the rearrangement
   inequality), so a device's option totals decide its memory.
2. How many blocks each device holds (`block_counts.allocate`, exact): Σ n[d] = K, each n[d]
   one its table priced, minimising the objective of `stage_partition` (same integer units), so
   `evaluate` prices the decoded partition to exactly the optimum's value. Tables are priced up
   to a little above an even share first and extended as far as the answer shows a device could
   usefully go.

tests/unit/test_stage_partition.py checks the optimum against brute force over every
even-chunked partition and option (tests/brute_force.py).
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import numpy as np
from autopar.solver.block_counts import WORK_PER_PRICE, DeviceRow, allocate
from autopar.solver.stage_partition import priced_solution, unresolved
from cost_models.pipeline import Partition, PartitionProblem, mib_down, mib_up, time_units


@dataclass(frozen=True)
class BlockRun:
    """Layers [first, first + count) are identical blocks."""

    first: int
    count: int


@dataclass(frozen=True)
class DeviceChoice:
    """How a device holds a given number of blocks at its least time."""

    units: int  # its time per micro-batch (`time_units`), sends and edge layers included
    per_step_units: int  # its once-per-step time
    chunk_options: tuple[tuple[int, ...], ...]  # [local chunk][option] blocks
    edge_options: dict[int, int]  # option of each prefix/suffix layer it holds


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


@dataclass(frozen=True)
class _Splits:
    """Every split of `blocks` over the options, heaviest option first: `cumulative[s, t]` blocks
    take one of the t + 1 heaviest options (the last column is every block), `before[s, t]` is
    the column before it (0 first) and `each[s, t]` the blocks with the t-th heaviest."""

    cumulative: np.ndarray
    before: np.ndarray
    each: np.ndarray


@functools.lru_cache(maxsize=512)
def _splits(blocks: int, options: int) -> _Splits:
    inner = list(itertools.combinations_with_replacement(range(blocks + 1), options - 1))
    cumulative = np.array([row + (blocks,) for row in inner], dtype=np.int64).reshape(-1, options)
    before = np.concatenate([np.zeros((len(cumulative), 1), dtype=np.int64), cumulative[:, :-1]], axis=1)
    for array in (cumulative, before):
        array.setflags(write=False)
    each = cumulative - before
    each.setflags(write=False)
    return _Splits(cumulative, before, each)


_NO_SPLIT = np.iinfo(np.int64).max  # a split that does not fit, in `_price`'s ordering key


def _chunk_sizes(blocks: int, holding: list[int], chunks: int) -> list[int]:
    """Blocks per local chunk: spread evenly over the chunks in `holding`, the later ones taking
    the remainder (where they are held least); none on the others."""
    sizes = [0] * chunks
    base, extra = divmod(blocks, len(holding)) if holding else (0, 0)
    for position, chunk in enumerate(holding):
        sizes[chunk] = base + (1 if position >= len(holding) - extra else 0)
    return sizes


@dataclass
class _Layout:
    """A device's first/last stage left empty (holding the prefix/suffix alone) or not, the
    local chunks holding blocks then, and the next count of blocks its table prices (None:
    no more fit)."""

    empty_first: bool
    empty_last: bool
    holding: list[int]
    next_count: int | None = field(init=False)

    def __post_init__(self):
        self.next_count = len(self.holding)  # one block on each chunk holding any (none if none)


def _earlier_chunks_held_longer(moments: tuple[tuple[float, ...], ...]) -> bool:
    return all(moment[c] >= moment[c + 1] for moment in moments for c in range(len(moment) - 1))


class DeviceTable:
    """For one device: the least-time way to hold each feasible number of blocks (module
    docstring, part 1), built upwards from the fewest blocks on demand (`extend`): a device
    holding far more than its share cannot be in the optimum, and the search need not price it."""

    def __init__(self, problem: PartitionProblem, run: BlockRun, device: int):
        self.problem, self.run, self.device = problem, run, device
        P, p, v = problem.num_stages, problem.devices, problem.chunks
        moments = problem.in_flight[device]
        if not _earlier_chunks_held_longer(moments):
            # No schedule of ours does this; hold every chunk as long as the longest (safe, not least).
            moments = tuple((max(moment),) * v for moment in moments)
        self.moments = moments
        block = run.first
        options = len(problem.time_s[block])
        self.heaviest_first = sorted(range(options), key=lambda r: -problem.activation_bytes[block][r])
        speed = problem.speed_of(device)
        self.speed = speed
        self.block_units = np.array([time_units(speed * problem.time_s[block][r]) for r in self.heaviest_first])
        # mib[t, c, q]: one block with the t-th heaviest option on local chunk c at moment q
        self.block_mib = np.array([[[mib_up(problem.held_bytes(block, r, moment[c])) for moment in moments]
                                    for c in range(v)] for r in self.heaviest_first], dtype=np.int64)
        prefix = list(range(0, run.first)) if device == 0 else []
        suffix = list(range(run.first + run.count, problem.num_layers)) if device == (P - 1) % p else []
        self.edges = [(layer, 0) for layer in prefix] + [(layer, v - 1) for layer in suffix]
        self.edge_choices, self.edge_units, self.edge_mib = self._edge_layouts()
        self.edge_once = self._edge_once()
        self.capacity_mib = mib_down(problem.capacity_bytes[device])
        self.room = self.capacity_mib - mib_up(problem.overhead_bytes[device])
        self.choices: dict[int, DeviceChoice] = {}
        self._work = 0.0
        self._layouts = [_Layout(first, last, self._holding(first, last))
                         for first in (False, True)[:1 + (bool(prefix) and P > 1)]
                         for last in (False, True)[:1 + (bool(suffix) and P > 1)]]

    @property
    def complete(self) -> bool:
        """Whether every count of blocks that can fit is priced."""
        return all(layout.next_count is None or layout.next_count > self.run.count for layout in self._layouts)

    def extend(self, most: int) -> None:
        """Price every count of blocks up to `most` (those that fit)."""
        for layout in self._layouts:
            while layout.next_count is not None and layout.next_count <= min(most, self.run.count):
                fits = self._price(layout, layout.next_count)
                # A device without blocks on its chunks holds none; more blocks only hold more.
                layout.next_count = layout.next_count + 1 if fits and layout.holding else None

    def row(self) -> DeviceRow:
        """The priced counts with their times, for `block_counts.allocate`."""
        counts = sorted(self.choices)
        return DeviceRow(np.array(counts), np.array([self.choices[n].units for n in counts], dtype=np.int64),
                         np.array([self.choices[n].per_step_units for n in counts], dtype=np.int64))

    def most_useful(self, units: float) -> int:
        """The most blocks whose least conceivable time (every block at its fastest option, the
        cheapest edges and sends) is within `units`."""
        fastest = int(self.block_units.min())
        fixed = min(self._fixed_units(layout.empty_first) for layout in self._layouts) + int(self.edge_units.min())
        if fastest <= 0:
            return self.run.count
        return max(0, min(self.run.count, int((units - fixed) // fastest)))

    def take_work(self) -> float:
        """Deterministic seconds spent pricing since last asked."""
        work, self._work = self._work, 0.0
        return work

    def _holding(self, empty_first: bool, empty_last: bool) -> list[int]:
        """The device's local chunks that hold blocks with the first/last stage left empty or not."""
        problem = self.problem
        return [c for c in range(problem.chunks)
                if not (empty_first and c * problem.devices + self.device == 0)
                and not (empty_last and c * problem.devices + self.device == problem.num_stages - 1)]

    def _edge_layouts(self) -> tuple[list[tuple[int, ...]], np.ndarray, np.ndarray]:
        """Every option of the edge layers: (options, time units, MiB per moment) each."""
        problem = self.problem
        choices = list(itertools.product(range(len(problem.time_s[0])), repeat=len(self.edges)))

        def units_of(options: tuple[int, ...]) -> int:
            return sum(time_units(self.speed * problem.time_s[layer][r]) for (layer, _), r in zip(self.edges, options))

        def mib_of(options: tuple[int, ...], moment: tuple[float, ...]) -> int:
            return sum(mib_up(problem.held_bytes(layer, r, moment[c])) for (layer, c), r in zip(self.edges, options))

        units = np.array([units_of(options) for options in choices], dtype=np.int64)
        mib = np.array([[mib_of(options, moment) for moment in self.moments] for options in choices],
                       dtype=np.int64).reshape(len(choices), -1)
        return choices, units, mib

    def _fixed_units(self, empty_first: bool) -> int:
        """Sends: every stage of the device but the pipeline's last sends its output."""
        problem, p, v = self.problem, self.problem.devices, self.problem.chunks
        if problem.num_stages == 1:
            return 0
        block_send = time_units(self.speed * problem.send_s[self.run.first])
        senders = v - (1 if self.device == p - 1 else 0)
        units = senders * block_send
        if empty_first:
            units += time_units(self.speed * problem.send_s[self.run.first - 1]) - block_send
        return units

    def _edge_once(self) -> tuple[int, int]:
        """(once-per-step time units, MiB at the optimizer step) of the edge layers and the
        device's step overhead: what `_once` adds to every count's."""
        problem, layers = self.problem, [layer for layer, _ in self.edges]
        once = sum(time_units(self.speed * problem.per_step_s[layer]) for layer in layers) if problem.per_step_s else 0
        step = mib_up(problem.step_overhead_bytes[self.device]) \
            + sum(mib_up(problem.at_step_bytes(layer)) for layer in layers) if problem.step_bytes else 0
        return once, step

    def _once(self, blocks: int) -> tuple[int, int]:
        """(once-per-step time units, MiB at the optimizer step) of the edges and `blocks` blocks."""
        problem, (once, step) = self.problem, self.edge_once
        if problem.per_step_s:
            once += blocks * time_units(self.speed * problem.per_step_s[self.run.first])
        if problem.step_bytes:
            step += blocks * mib_up(problem.at_step_bytes(self.run.first))
        return once, step

    def _price(self, layout: _Layout, blocks: int) -> bool:
        """The least-time way to hold `blocks` blocks in this first/last-stage layout, kept if it
        beats another layout's; False when no way fits."""
        problem, v = self.problem, self.problem.chunks
        options = len(self.heaviest_first)
        self._work += WORK_PER_PRICE
        once, step_mib = self._once(blocks)
        if problem.step_bytes and step_mib > self.capacity_mib:
            return False
        sizes = _chunk_sizes(blocks, layout.holding, v)
        chunk_of = np.repeat(np.arange(v), sizes)  # local chunk of each position, first to last
        # prefix[t, x, q]: MiB of the first x positions all holding the t-th heaviest option
        prefix = np.zeros((options, blocks + 1, len(self.moments)), dtype=np.int64)
        np.cumsum(self.block_mib[:, chunk_of, :], axis=1, out=prefix[:, 1:, :])
        splits = _splits(blocks, options)  # the t + 1 heaviest options fill the last positions
        option = np.arange(options)[None, :]
        mib = (prefix[option, blocks - splits.before] - prefix[option, blocks - splits.cumulative]).sum(axis=1)
        units = splits.each @ self.block_units
        total_mib = mib[:, None, :] + self.edge_mib[None, :, :]  # [split, edge choice, moment]
        peak = total_mib.max(axis=2)
        fits = peak <= self.room
        if not fits.any():
            return False
        total_units = units[:, None] + self.edge_units[None, :]
        # least time, then least memory (peaks are MiB, far below 2**24 of them)
        best = int(np.where(fits, total_units * 2**24 + peak, _NO_SPLIT).argmin())
        split, edge = divmod(best, len(self.edge_choices))
        found = DeviceChoice(int(total_units[split, edge]) + self._fixed_units(layout.empty_first), once,
                             self._chunk_options(splits.each[split], sizes),
                             {layer: r for (layer, _), r in zip(self.edges, self.edge_choices[edge])})
        known = self.choices.get(blocks)
        if known is None or found.units < known.units:
            self.choices[blocks] = found
        return True

    def _chunk_options(self, each: np.ndarray, sizes: list[int]) -> tuple[tuple[int, ...], ...]:
        """Blocks per option on each chunk (`each`: blocks per option, heaviest first): the
        heaviest options fill the last positions."""
        order = [r for t, r in enumerate(self.heaviest_first) for _ in range(int(each[t]))]
        order.reverse()  # first position to last: lightest first
        counts, position = [], 0
        for size in sizes:
            row = [0] * len(self.heaviest_first)
            for r in order[position:position + size]:
                row[r] += 1
            counts.append(tuple(row))
            position += size
        return tuple(counts)


class BlockPartitioner:
    """Solves the compressed program for a problem whose middle layers are identical."""

    def __init__(self, time_limit_s: float = 10.0):
        self.time_limit_s = time_limit_s  # deterministic seconds per solve (`block_counts` counts them)
        self.work_s = 0.0  # deterministic seconds spent by all solves so far (the search's budget)

    def solve(self, problem: PartitionProblem, run: BlockRun) -> Partition | None:
        """Optimal partition, or None when no partition fits in memory. The tables are priced up
        to a little above an even share first; the allocation over them then bounds how many
        blocks any device can hold in the optimum (W·D_d + D_d <= the objective, W the slowest
        device's weight), and the tables are extended to that before the answer is taken."""
        P, p, v, K = problem.num_stages, problem.devices, problem.chunks, run.count
        if P - 2 > K or (P == 1 and not K):
            return None
        tables = [DeviceTable(problem, run, d) for d in range(p)]
        weight = (problem.micro_batches - 1) * v + (v - 1)
        most = [-(-K // p) + v + 1] * p
        while True:
            for table, upto in zip(tables, most):
                table.extend(upto)
            self.work_s += sum(table.take_work() for table in tables)
            if any(not table.choices for table in tables):
                return None
            rows = [table.row() for table in tables]
            found = allocate(rows, K, weight, v, self.time_limit_s)
            self.work_s += found.work_s
            if found.picks is None:
                if not all(table.complete or upto >= K for table, upto in zip(tables, most)):
                    most = [K] * p  # nothing within the share: let every device take any count
                    continue
                return unresolved(problem, "INFEASIBLE" if found.optimal else "UNKNOWN", found.bound)
            assert found.objective is not None
            useful = [table.most_useful(found.objective / (weight + 1)) for table in tables]
            if all(need <= upto or table.complete for table, need, upto in zip(tables, useful, most)):
                chosen = [table.choices[int(row.counts[i])] for table, row, i in zip(tables, rows, found.picks)]
                starts, options = self._decode(problem, run, chosen)
                return priced_solution(problem, starts, options, "OPTIMAL" if found.optimal else "FEASIBLE",
                                       found.bound)
            most = [max(upto, need) for upto, need in zip(most, useful)]

    @staticmethod
    def _decode(problem: PartitionProblem, run: BlockRun, chosen: list[DeviceChoice]) -> tuple[list[int], list[int]]:
        """Lay the stages out in order, each with its blocks per option; within a stage, option
        0's blocks come first, then option 1's, ..."""
        options = [0] * problem.num_layers
        for choice in chosen:
            for layer, r in choice.edge_options.items():
                options[layer] = r
        starts, position = [0], run.first
        for j in range(problem.num_stages):
            if j > 0:
                starts.append(position)
            for r, count in enumerate(chosen[j % problem.devices].chunk_options[j // problem.devices]):
                options[position:position + count] = [r] * count
                position += count
        return starts, options

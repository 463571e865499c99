"""Pipeline schedules: step time from stage times, bubble, activations held in flight, and the
exact pricing of a layer partition (`PartitionProblem` / `evaluate`) that the planner's
partition ILP encodes.

Step time (used identically by the planner's partition ILP): with D_d the time of device d
for one micro-batch (all its stages/chunks, forward + backward + sends), m micro-batches and v
chunks per device,

    t = (m - 1) · max_d D_d + (1/v) · Σ_d D_d + (1 - 1/v) · max_d D_d

Fill and drain pass every stage once; the steady state is paced by the slowest device. For
equal stages this is (m + (p-1)/v) · D, i.e. the bubble fraction (p-1)/m of GPipe and 1F1B and
(p-1)/(v·m) of interleaved 1F1B (Narayanan et al. 2021, §2.2). The schedules differ in memory:
GPipe keeps all m micro-batches' activations, 1F1B at most p - d on device d, interleaved
1F1B a count per chunk that shifts as its schedule plays (`cost_models.held_activations`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from autopar.domain.vocabulary import Schedule
from cost_models.held_activations import Moment


def pipeline_step_time_s(device_time_s: list[float], micro_batches: int, chunks: int = 1) -> float:
    """The closed form above: D_d per device (forward + backward + its sends for one micro-batch)."""
    slowest = max(device_time_s)
    return (micro_batches - 1) * slowest + sum(device_time_s) / chunks + (1 - 1 / chunks) * slowest


def bubble_fraction(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """Idle share relative to the ideal m·D for equal stages."""
    return (stages - 1) / (chunks * micro_batches)


def simulate_schedule(forward_s: list[float], backward_s: list[float], micro_batches: int, schedule: str = "1f1b",
                      p2p_s: float = 0.0) -> float:
    """Makespan of GPipe or 1F1B (one chunk per stage) by playing the schedule op by op: each
    stage runs its ops in the schedule's order, a forward waits for the previous stage's
    forward of that micro-batch and a backward for the next stage's backward, each hop p2p_s.
    The reference the closed form is tested against (uneven stages included)."""
    p, m = len(forward_s), micro_batches
    order: list[list[tuple[str, int]]] = []
    for s in range(p):
        if schedule == Schedule.GPIPE:
            order.append([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
            continue
        warmup = min(p - s - 1, m)
        ops = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            ops += [("F", warmup + i), ("B", i)]
        ops += [("B", i) for i in range(m - warmup, m)]
        order.append(ops)
    done: dict[tuple[str, int, int], float] = {}
    position, clock = [0] * p, [0.0] * p
    while len(done) < 2 * p * m:
        progressed = False
        for s in range(p):
            while position[s] < len(order[s]):
                kind, i = order[s][position[s]]
                deps = [("F", s - 1, i)] if kind == "F" and s > 0 else []
                deps += [("F", s, i)] + ([("B", s + 1, i)] if s < p - 1 else []) if kind == "B" else []
                if any(dep not in done for dep in deps):
                    break
                ready = max([clock[s]] + [done[dep] + (p2p_s if dep[1] != s else 0.0) for dep in deps])
                clock[s] = ready + (forward_s[s] if kind == "F" else backward_s[s])
                done[(kind, s, i)] = clock[s]
                position[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("schedule deadlocked")
    return max(done.values())


TIME_UNITS_PER_S = 1e6  # microseconds: step times of seconds stay well inside int64 products
MEMORY_UNIT_BYTES = 2**20  # memory constraints in MiB (rounded up, so feasibility is kept)


@dataclass(frozen=True)
class MemoryRows:
    """What a partition problem's memory check reads (`autopar.solver.bounds.memory_cannot_fit`),
    priced before its per-layer times: most candidates a large search prices cannot fit, and
    their times are never needed (fields as `PartitionProblem`'s)."""

    activation_bytes: list[list[int]]
    static_bytes: list[int]
    in_flight: list[tuple[Moment, ...]]
    capacity_bytes: list[int]
    overhead_bytes: list[int]


@dataclass(frozen=True)
class PartitionProblem:
    """Everything the partitioner needs, priced per layer by the cost model.

    Attributes:
        time_s: [layer][option] training time of one micro-batch on a speed-1.0 device.
        activation_bytes: [layer][option] activation bytes one in-flight micro-batch keeps.
        static_bytes: [layer] bytes independent of micro-batches (params, grads, optimizer).
        send_s: [layer] time to send the layer's output to the next stage and its gradient back.
        devices: p, the number of pipeline ranks.
        chunks: v, model chunks per device (1 unless interleaved).
        micro_batches: m.
        in_flight: [device] the moments that can be its activation peak, each the micro-batches
            held per local chunk (`cost_models.held_activations.held_moments`); a number stands
            for one moment holding that many on every chunk.
        capacity_bytes: [device] memory available for the model on that device.
        overhead_bytes: [device] memory used regardless of the layers it gets (buffers, headroom).
        speed: [device] time multiplier (1.0 = reference device; 2.0 = twice as slow).
        option_names: names of the recompute options, e.g. ("none", "selective", "full").
        per_step_s: [layer] time once per step (exposed gradient sync, optimizer update).
        step_bytes: [layer] bytes the optimizer step holds beside the layer's static bytes, when
            no activations are (empty: that moment is not priced).
        step_overhead_bytes: [device] memory used at the optimizer step whatever the layers.
    """

    time_s: list[list[float]]
    activation_bytes: list[list[int]]
    static_bytes: list[int]
    send_s: list[float]
    devices: int
    chunks: int
    micro_batches: int
    in_flight: list[tuple[Moment, ...]]  # a number per device is read as one moment (__post_init__)
    capacity_bytes: list[int]
    overhead_bytes: list[int]
    speed: list[float] = field(default_factory=list)
    option_names: tuple[str, ...] = ("none",)
    per_step_s: list[float] = field(default_factory=list)
    step_bytes: list[int] = field(default_factory=list)
    step_overhead_bytes: list[int] = field(default_factory=list)

    def __post_init__(self):
        moments = [((float(held),) * self.chunks,) if isinstance(held, (int, float)) else held
                   for held in self.in_flight]
        object.__setattr__(self, "in_flight", moments)

    @property
    def num_layers(self) -> int:
        return len(self.time_s)

    @property
    def num_stages(self) -> int:
        return self.devices * self.chunks

    def speed_of(self, device: int) -> float:
        return self.speed[device] if self.speed else 1.0

    def held_bytes(self, layer: int, option: int, held: float) -> int:
        """A layer's bytes while `held` micro-batches of its activations are in flight, with its
        static bytes."""
        return int(self.static_bytes[layer] + held * self.activation_bytes[layer][option])

    def at_step_bytes(self, layer: int) -> int:
        """A layer's bytes at the optimizer step: its static bytes and the step's transients."""
        return int(self.static_bytes[layer] + self.step_bytes[layer])


@dataclass(frozen=True)
class Partition:
    """Stage boundaries (first layer index of each virtual stage), option per layer, and cost."""

    stage_starts: list[int]
    options: list[int]
    step_time_s: float
    device_time_s: list[float]
    device_memory_bytes: list[int]
    status: str = "OPTIMAL"
    bound_s: float | None = None  # proven lower bound on this problem's step time (= step if OPTIMAL)

    def stages(self, num_layers: int) -> list[list[int]]:
        bounds = self.stage_starts + [num_layers]
        return [list(range(bounds[j], bounds[j + 1])) for j in range(len(self.stage_starts))]


def evaluate(problem: PartitionProblem, stage_starts: list[int], options: list[int]) -> Partition | None:
    """Price one partition with the ILP's own integer arithmetic; None if it breaks a memory
    limit. The ILP and the brute force both go through here, so their optima compare exactly."""
    stages = Partition(stage_starts, options, 0.0, [], []).stages(problem.num_layers)
    device_units = [0] * problem.devices
    per_step_units = [0] * problem.devices
    moment_mib = [[0] * len(moments) for moments in problem.in_flight]
    moment_bytes = [[0] * len(moments) for moments in problem.in_flight]
    step_mib = [mib_up(overhead) for overhead in problem.step_overhead_bytes]
    step_bytes = list(problem.step_overhead_bytes)
    for j, layers in enumerate(stages):
        device = j % problem.devices
        speed = problem.speed_of(device)
        device_units[device] += sum(time_units(speed * problem.time_s[layer][options[layer]]) for layer in layers)
        if j < problem.num_stages - 1:
            device_units[device] += time_units(speed * problem.send_s[layers[-1]])
        if problem.per_step_s:
            per_step_units[device] += sum(time_units(speed * problem.per_step_s[layer]) for layer in layers)
        for layer in layers:
            for q, moment in enumerate(problem.in_flight[device]):
                layer_bytes = problem.held_bytes(layer, options[layer], moment[j // problem.devices])
                moment_mib[device][q] += mib_up(layer_bytes)
                moment_bytes[device][q] += layer_bytes
            if problem.step_bytes:
                step_mib[device] += mib_up(problem.at_step_bytes(layer))
                step_bytes[device] += problem.at_step_bytes(layer)
    device_mib = [mib_up(overhead) + max(mib) for overhead, mib in zip(problem.overhead_bytes, moment_mib)]
    device_bytes = [overhead + max(held) for overhead, held in zip(problem.overhead_bytes, moment_bytes)]
    moments = [device_mib, step_mib] if problem.step_bytes else [device_mib]
    if any(used > mib_down(cap) for mib in moments for used, cap in zip(mib, problem.capacity_bytes)):
        return None
    if problem.step_bytes:
        device_bytes = [max(pair) for pair in zip(device_bytes, step_bytes)]
    v, m = problem.chunks, problem.micro_batches
    objective = ((m - 1) * v + (v - 1)) * max(device_units) + sum(device_units) + v * max(per_step_units)
    return Partition(list(stage_starts), list(options), objective / v / TIME_UNITS_PER_S,
                     [units / TIME_UNITS_PER_S for units in device_units], device_bytes)


def held_activation_bytes(problem: PartitionProblem, partition: Partition, device: int) -> tuple[int, Moment]:
    """The activation bytes `device` holds at its peak under `partition`, and the micro-batches
    each of its chunks holds then (the moment of its schedule where those bytes are most)."""
    stages = partition.stages(problem.num_layers)
    per_chunk = [sum(problem.activation_bytes[layer][partition.options[layer]] for layer in stages[j])
                 for j in range(device, problem.num_stages, problem.devices)]
    return max((int(sum(held * nbytes for held, nbytes in zip(moment, per_chunk))), moment)
               for moment in problem.in_flight[device])


def time_units(seconds: float) -> int:
    return int(round(seconds * TIME_UNITS_PER_S))


def mib_up(nbytes: float) -> int:
    return -(-int(nbytes) // MEMORY_UNIT_BYTES)


def mib_down(nbytes: float) -> int:
    return int(nbytes) // MEMORY_UNIT_BYTES

"""One simulated training step, op by op: what each pipeline rank computes and sends, and when.

The cost model prices a step in closed form; the timeline plays the same per-stage times through
the plan's schedule (GPipe, 1F1B or interleaved 1F1B) so a user sees the fill, the steady state,
the drain and the bubbles. Each pipeline rank stands for its whole DP x TP x CP group (they run
in lockstep). Forward of micro-batch i on virtual stage j waits for stage j-1's forward of i and
its send; backward waits for stage j+1's backward and the gradient's send. After its last
backward a rank synchronises gradients (the part not hidden under backward) and steps the
optimizer.

`chrome_trace` writes the Chrome trace-event format (open in Perfetto or chrome://tracing);
`render_png` draws the same events with matplotlib.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopar.domain.vocabulary import Schedule

COMPUTE, COMMUNICATION = "compute", "communication"
PHASE_COLOURS = {"forward": "#4C78A8", "backward": "#F58518", "send": "#9D9D9D", "dp_sync": "#E45756",
                 "optimizer": "#54A24B"}


@dataclass(frozen=True)
class TimelineEvent:
    """One op on one pipeline rank's compute or communication lane."""

    pp_rank: int
    lane: str
    phase: str  # forward, backward, send, dp_sync, optimizer
    start_s: float
    duration_s: float
    micro_batch: int | None = None
    stage: int | None = None  # virtual stage (interleaved schedules have several per rank)

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s

    @property
    def label(self) -> str:
        if self.micro_batch is None:
            return self.phase
        short = {"forward": "F", "backward": "B", "send": "send"}[self.phase]
        return f"{short}{self.micro_batch}" + (f" (stage {self.stage})" if self.stage is not None else "")


@dataclass(frozen=True)
class Timeline:
    """The simulated step: events, makespan and per-rank idle time inside the step."""

    events: list[TimelineEvent]
    pp: int
    micro_batches: int
    schedule: str

    @property
    def step_time_s(self) -> float:
        return max(event.end_s for event in self.events)

    def busy_s(self, pp_rank: int) -> float:
        return sum(e.duration_s for e in self.events if e.pp_rank == pp_rank and e.lane == COMPUTE)

    def bubble_s(self, pp_rank: int) -> float:
        """Time a rank's compute lane is idle during the step."""
        return self.step_time_s - self.busy_s(pp_rank)


def schedule_order(schedule: str, pp: int, chunks: int, micro_batches: int, pp_rank: int) -> list[tuple[str, int, int]]:
    """Ops of one pipeline rank in the schedule's order: (F or B, chunk, micro-batch).

    GPipe runs every forward then every backward; 1F1B warms up with p-d-1 forwards, then
    alternates; interleaved 1F1B (Narayanan et al. 2021) walks micro-batches in groups of p,
    chunk by chunk, with a warm-up of 2(p-d-1) + (v-1)p forwards.
    """
    m, v, p, d = micro_batches, chunks, pp, pp_rank
    if schedule == Schedule.INTERLEAVED_1F1B and v > 1:
        forwards = [(c, mb) for g in range(0, m, p) for c in range(v) for mb in range(g, min(g + p, m))]
        backwards = [(v - 1 - c, mb) for c, mb in forwards]
        warmup = min(m * v, 2 * (p - d - 1) + (v - 1) * p)
    else:
        forwards = [(c, mb) for mb in range(m) for c in range(v)]
        backwards = [(v - 1 - c, mb) for mb in range(m) for c in range(v)]
        warmup = m * v if schedule == Schedule.GPIPE else min(m * v, p - d - 1)
    ops = [("F", c, mb) for c, mb in forwards[:warmup]]
    for k in range(len(forwards) - warmup):
        ops += [("F", *forwards[warmup + k]), ("B", *backwards[k])]
    ops += [("B", c, mb) for c, mb in backwards[len(forwards) - warmup:]]
    return ops


def simulate(stage_timings: list[dict[str, float]], device_tails: list[dict[str, float]], pp: int, chunks: int,
             micro_batches: int, schedule: str) -> Timeline:
    """Play one step. `stage_timings[j]`: forward_s, backward_s, send_s of virtual stage j (on
    pipeline rank j mod pp); `device_tails[d]`: dp_comm_s and optimizer_s of rank d per step."""
    stages = len(stage_timings)
    if stages != pp * chunks:
        raise ValueError(f"{stages} stage timings for pp={pp} x chunks={chunks}")
    order = [schedule_order(schedule, pp, chunks, micro_batches, d) for d in range(pp)]
    finished: dict[tuple[str, int, int], float] = {}  # (F/B, virtual stage, micro-batch) -> time ready downstream
    position, clock, comm_clock = [0] * pp, [0.0] * pp, [0.0] * pp
    events: list[TimelineEvent] = []
    while any(position[d] < len(order[d]) for d in range(pp)):
        progressed = False
        for d in range(pp):
            while position[d] < len(order[d]):
                kind, chunk, mb = order[d][position[d]]
                j = chunk * pp + d
                needed = ([("F", j - 1, mb)] if kind == "F" and j > 0 else
                          [("F", j, mb)] + ([("B", j + 1, mb)] if j < stages - 1 else []) if kind == "B" else [])
                if any(dep not in finished for dep in needed):
                    break
                start = max([clock[d]] + [finished[dep] for dep in needed])
                timing = stage_timings[j]
                duration = timing["forward_s"] if kind == "F" else timing["backward_s"]
                phase = "forward" if kind == "F" else "backward"
                events.append(TimelineEvent(d, COMPUTE, phase, start, duration, mb, j if chunks > 1 else None))
                clock[d] = start + duration
                ready = clock[d]
                # Forward output goes to stage j+1, the input gradient back to stage j-1.
                target = j + 1 if kind == "F" else j - 1
                if 0 <= target < stages:
                    send = timing["send_s"] if kind == "F" else stage_timings[target]["send_s"]
                    if target % pp != d and send > 0:
                        send_start = max(ready, comm_clock[d])
                        events.append(TimelineEvent(d, COMMUNICATION, "send", send_start, send, mb,
                                                    j if chunks > 1 else None))
                        comm_clock[d] = send_start + send
                        ready = comm_clock[d]
                finished[(kind, j, mb)] = ready
                position[d] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the {schedule} schedule deadlocked in simulation")
    for d in range(pp):
        end = max(clock[d], comm_clock[d])
        tail = device_tails[d] if d < len(device_tails) else {}
        if tail.get("dp_comm_s", 0.0) > 0:
            events.append(TimelineEvent(d, COMMUNICATION, "dp_sync", end, tail["dp_comm_s"]))
            end += tail["dp_comm_s"]
        if tail.get("optimizer_s", 0.0) > 0:
            events.append(TimelineEvent(d, COMPUTE, "optimizer", end, tail["optimizer_s"]))
    return Timeline(events=events, pp=pp, micro_batches=micro_batches, schedule=schedule)


def rank_label(pp_rank: int, ranks: list[int] | None = None) -> str:
    if not ranks:
        return f"pipeline rank {pp_rank}"
    shown = ", ".join(map(str, ranks[:4])) + (", ..." if len(ranks) > 4 else "")
    return f"pipeline rank {pp_rank} (ranks {shown})"


def chrome_trace(timeline: Timeline, ranks_of: dict[int, list[int]] | None = None,
                 metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """Trace-event JSON: one process per pipeline rank, a compute and a communication thread,
    complete ("X") events in microseconds."""
    ranks_of = ranks_of or {}
    events: list[dict[str, Any]] = []
    for d in range(timeline.pp):
        events.append({"ph": "M", "name": "process_name", "pid": d, "tid": 0,
                       "args": {"name": rank_label(d, ranks_of.get(d))}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": d, "tid": 0, "args": {"sort_index": d}})
        for tid, lane in enumerate((COMPUTE, COMMUNICATION)):
            events.append({"ph": "M", "name": "thread_name", "pid": d, "tid": tid, "args": {"name": lane}})
    for event in timeline.events:
        events.append({"ph": "X", "name": event.label, "cat": event.phase, "pid": event.pp_rank,
                       "tid": 0 if event.lane == COMPUTE else 1, "ts": round(event.start_s * 1e6, 3),
                       "dur": round(event.duration_s * 1e6, 3),
                       "args": {"micro_batch": event.micro_batch, "stage": event.stage, "phase": event.phase}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": dict(metadata or {})}


def render_png(timeline: Timeline, path: str | Path, title: str = "") -> None:
    """A Gantt chart of the step: per pipeline rank a compute row and a communication row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    scale, unit = (1e3, "ms") if timeline.step_time_s < 10 else (1.0, "s")
    rows = 2 * timeline.pp
    figure, axes = plt.subplots(figsize=(11, 1.0 + 0.45 * rows))
    labels_on = timeline.micro_batches * max(1, len({e.stage for e in timeline.events})) <= 64
    for event in timeline.events:
        row = 2 * event.pp_rank + (0 if event.lane == COMPUTE else 1)
        axes.barh(row, event.duration_s * scale, left=event.start_s * scale, height=0.8,
                  color=PHASE_COLOURS[event.phase], edgecolor="white", linewidth=0.3)
        if labels_on and event.micro_batch is not None and event.lane == COMPUTE:
            axes.text((event.start_s + event.duration_s / 2) * scale, row, str(event.micro_batch),
                      ha="center", va="center", fontsize=6, color="white")
    axes.set_yticks(range(rows))
    axes.set_yticklabels([f"PP {d} {lane}" for d in range(timeline.pp) for lane in ("compute", "comm")], fontsize=8)
    axes.invert_yaxis()
    axes.set_xlabel(f"time in the step ({unit})")
    axes.set_title(title or f"one training step, {timeline.schedule}, {timeline.micro_batches} micro-batches",
                   fontsize=10)
    axes.legend(handles=[Patch(color=colour, label=phase) for phase, colour in PHASE_COLOURS.items()],
                loc="upper center", bbox_to_anchor=(0.5, -0.25 if rows <= 4 else -0.12), ncol=5, fontsize=8,
                frameon=False)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plan_timeline(plan: Any, estimate: dict[str, Any]) -> Timeline:
    """The timeline of a priced plan (`Estimate.to_dict()`: its stage timings and per-rank tails)."""
    tails = [{"dp_comm_s": d.get("dp_comm_s", 0.0), "optimizer_s": d.get("optimizer_s", 0.0)}
             for d in estimate["stage_details"]]
    return simulate(estimate["stage_timings"], tails, plan.pp, plan.chunks, plan.num_micro_batches, plan.schedule)


def pp_rank_members(plan: Any) -> dict[int, list[int]]:
    """Ranks each pipeline rank stands for (its DP x TP x CP ranks)."""
    from autopar.domain.mesh import Mesh

    mesh = Mesh.of(plan)
    members: dict[int, list[int]] = {}
    for rank in range(plan.world_size):
        members.setdefault(mesh.coordinate(rank, "pp"), []).append(rank)
    return members

"""Loss curves of the runs recorded beside a plan (run.jsonl), for `autopar report`.

run.jsonl gathers every run of a folder: step records (``step``, ``loss``, ...) and validation
records (``step``, ``val_loss``), appended in the order they happened. A restarted or resumed
run repeats steps (``attempt`` and ``run_id`` tell them apart); the curves keep the last record
of each step, which is the run that went on from there.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

LOSS_FIGURE = "loss.png"
RUN_LOG = "run.jsonl"


@dataclass
class LossCurves:
    """(step, value) series, by step.

    Attributes:
        train: the training loss of each step.
        validation: the validation loss at each step it was measured.
        step_times_s: each kept step's measured time, in step order.
    """

    train: list[tuple[int, float]] = field(default_factory=list)
    validation: list[tuple[int, float]] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.train or self.validation)


def read_run_log(path: str | Path) -> list[dict]:
    """The records of a run.jsonl; none when it is missing. A line that is not a JSON object (a
    run killed while writing it) is skipped: the curves show what was recorded."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def _last_per_step(records: list[dict], key: str) -> dict[int, dict]:
    kept: dict[int, dict] = {}
    for record in records:
        if isinstance(record.get(key), (int, float)):
            kept[record["step"]] = record  # a later record of the step replaces an earlier one
    return dict(sorted(kept.items()))


def loss_curves(records: list[dict]) -> LossCurves:
    """The train and validation loss series of run.jsonl's records, the last record per step."""
    train = _last_per_step(records, "loss")
    validation = _last_per_step(records, "val_loss")
    return LossCurves(train=[(step, float(r["loss"])) for step, r in train.items()],
                      validation=[(step, float(r["val_loss"])) for step, r in validation.items()],
                      step_times_s=[float(r["step_time_s"]) for r in train.values()
                                    if isinstance(r.get("step_time_s"), (int, float))])


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (fewer at the start)."""
    averaged, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        averaged.append(total / min(index + 1, window))
    return averaged


def smoothing_window(points: int) -> int:
    """A light smoothing: a tenth of the steps, between 1 (no smoothing) and 50."""
    return max(1, min(50, points // 10))


def summary(curves: LossCurves, predicted_step_time_s: float | None) -> str:
    """One paragraph on what the figure shows."""
    parts = []
    if curves.train:
        (first, _), (last, loss) = curves.train[0], curves.train[-1]
        parts.append(f"{len(curves.train)} steps recorded (steps {first}-{last}); last training loss {loss:.4f}")
    if curves.validation:
        step, loss = curves.validation[-1]
        parts.append(f"last validation loss {loss:.4f} (step {step})")
    if curves.step_times_s and predicted_step_time_s:
        measured = statistics.median(curves.step_times_s)
        parts.append(f"median measured step {measured * 1e3:,.1f} ms against {predicted_step_time_s * 1e3:,.1f} ms "
                     "predicted")
    smoothed = smoothing_window(len(curves.train))
    line = f" The solid line is the mean of the last {smoothed} steps." if smoothed > 1 else ""
    return (f"From {RUN_LOG} beside the plan: " + "; ".join(parts) + ". A step recorded more than once "
            f"(a restarted or resumed run) shows its last record.{line}")

"""Pipeline schedules: step time from stage times, bubble, and activations held in flight.

Step time (used identically by the planner's partition ILP): with D_d the time of device d
for one micro-batch (all its stages/chunks, forward + backward + sends), m micro-batches and v
chunks per device,

    t = (m - 1) · max_d D_d + (1/v) · Σ_d D_d + (1 - 1/v) · max_d D_d

Fill and drain pass every stage once; the steady state is paced by the slowest device. For
equal stages this is (m + (p-1)/v) · D, i.e. the bubble fraction (p-1)/m of GPipe and 1F1B and
(p-1)/(v·m) of interleaved 1F1B (Narayanan et al. 2021, §2.2). The schedules differ in memory:
GPipe keeps all m micro-batches' activations, 1F1B at most p - d on device d, interleaved
1F1B that times 1 + (p-1)/(p·m) (Korthikanti et al. 2022, §4.2.3).
"""
from __future__ import annotations


def pipeline_step_time_s(device_time_s: list[float], micro_batches: int, chunks: int = 1) -> float:
    slowest = max(device_time_s)
    return (micro_batches - 1) * slowest + sum(device_time_s) / chunks + (1 - 1 / chunks) * slowest


def bubble_fraction(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """Idle share relative to the ideal m·D for equal stages."""
    return (stages - 1) / (chunks * micro_batches)


def in_flight_micro_batches(schedule: str, stages: int, micro_batches: int, device: int, chunks: int = 1) -> float:
    """Micro-batches whose activations device `device` (0 = first stage) holds at its peak."""
    if stages == 1:
        return 1.0
    if schedule == "gpipe":
        return float(micro_batches)
    held = float(min(micro_batches, stages - device))
    if schedule == "interleaved_1f1b":
        held *= 1 + (stages - 1) / (stages * micro_batches)
    return held

"""Prediction intervals, and what a prediction rests on that nobody has measured.

A predicted step time s comes with an interval for the step a run would measure:

    [s / (1 + RESIDUAL_HIGH),  s_pessimistic / (1 + RESIDUAL_LOW)]

RESIDUAL_LOW and RESIDUAL_HIGH are the 10th and 90th percentiles (INTERVAL_QUANTILES) of the
cost model's out-of-sample errors (predicted / measured - 1) over the calibration rows of
benchmarks/published/runs.yaml: each row priced with every constant fitted to the calibration
set refitted on the other rows (`python -m benchmarks.published.refit` computes them with
`interval_from_residuals` and writes them to cost_models/calibration.json, read here).
`s_pessimistic` is the same plan priced again with what it extrapolates
set to its pessimistic value (`extrapolations`, `pessimistic_cluster`):

- a collective group spanning more nodes than any published measurement on that network
  (`NetworkSpec.measured_nodes` in cost_models/topology.py: 64 on EFA, the Playbook's collective
  curve; 48 on InfiniBand, which has no collective curve, only the training runs' data-parallel
  groups; none on RoCE, so every RoCE group across nodes is extrapolated): the network's bandwidth
  divided by NETWORK_FALL_PER_DOUBLING per doubling
  of nodes beyond. 1.8 is how fast measured bus bandwidth fell per doubling where it was
  measured falling (the Ultra-Scale Playbook's all-gather: x1.25, x1.96, x2.5 from 8 to 64
  nodes; geometric mean 1.8);
- an all-to-all (expert-parallel dispatch) across nodes: no all-to-all is measured on any
  fabric (PUBLISHED.md has none), so it is extrapolated from two nodes on, its bandwidth divided
  by NETWORK_FALL_PER_DOUBLING per doubling of nodes beyond one (UNMEASURED_COLLECTIVES);
- a GPU type without a calibration row: its compute UNCALIBRATED_GPU_SLOWDOWN slower (the
  largest median |out-of-sample error| of a calibration table, rounded up to a percent; written
  to cost_models/calibration.json with the interval);
- a technique whose price credits communication hidden behind compute, where no calibration run
  used it (`techniques_of`; calibration.json's `techniques` lists those the rows use): that
  communication priced exposed (ring attention's K/V exchange without the attention it overlaps;
  ClusterSpec.exposed_overlap). No calibration row uses context parallelism today.

The planner's robust objective uses `s_pessimistic`: of two plans whose intervals overlap, the
one that depends less on what was extrapolated is preferred (autopar.solver.planner).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from cost_models.calibration import load_calibration
from cost_models.topology import ClusterSpec

INTERVAL_QUANTILES = (0.10, 0.90)
RESIDUAL_LOW = float(load_calibration()["interval"]["low"])
RESIDUAL_HIGH = float(load_calibration()["interval"]["high"])
NETWORK_FALL_PER_DOUBLING = 1.8
UNCALIBRATED_GPU_SLOWDOWN = float(load_calibration()["uncalibrated_gpu_slowdown"])
CALIBRATED_GPUS = ("A100-80GB", "H100-SXM")
UNMEASURED_COLLECTIVES = ("all_to_all",)
RING_ATTENTION = "ring_attention"
CALIBRATED_TECHNIQUES = frozenset(load_calibration().get("techniques", ()))
TECHNIQUE_WORDS = {RING_ATTENTION: "ring attention's K/V exchange hidden behind attention"}


def techniques_of(plan: Any) -> frozenset[str]:
    """The techniques of a layout, plan or a published run's pins (any object with their
    attributes) whose price credits an overlap of communication with compute."""
    found = set()
    if (getattr(plan, "cp", 1) or 1) > 1 and (getattr(plan, "cp_strategy", "ring") or "ring") == "ring":
        found.add(RING_ATTENTION)
    return frozenset(found)


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1) of values, linearly interpolated between order statistics
    (numpy's default: position q·(n - 1) in the sorted values)."""
    if not values:
        raise ValueError("a percentile of no values")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (position - below) * (ordered[above] - ordered[below])


def interval_from_residuals(residuals: list[float], quantiles: tuple[float, float] = INTERVAL_QUANTILES
                            ) -> tuple[float, float]:
    """(RESIDUAL_LOW, RESIDUAL_HIGH): the residuals' low and high quantiles."""
    return percentile(residuals, quantiles[0]), percentile(residuals, quantiles[1])


def coverage(residuals: list[float], low: float, high: float) -> float:
    """Share of residuals inside [low, high]: of runs whose measurement the interval holds."""
    return sum(low <= r <= high for r in residuals) / len(residuals) if residuals else float("nan")


def held_out_coverage(residuals: list[float], quantiles: tuple[float, float] = INTERVAL_QUANTILES) -> float:
    """Share of residuals inside the interval computed from the others: the coverage to expect of
    a row the interval was not computed from (the in-sample coverage flatters by construction)."""
    inside = 0
    for i, r in enumerate(residuals):
        low, high = interval_from_residuals(residuals[:i] + residuals[i + 1:], quantiles)
        inside += low <= r <= high
    return inside / len(residuals) if residuals else float("nan")


@dataclass(frozen=True)
class Extrapolation:
    """What a plan's price assumes beyond the calibration set, and the pessimistic factors."""

    network_factor: float = 1.0  # the widest group's network bandwidth divided by this, pessimistically
    compute_factor: float = 1.0  # compute multiplied by this
    reasons: tuple[str, ...] = ()
    measured_nodes: int = 0  # groups over more nodes than this are extrapolated
    unmeasured_ops: tuple[str, ...] = ()  # collectives extrapolated from two nodes on
    exposed: tuple[str, ...] = ()  # techniques whose overlap no published run measured: priced exposed

    @property
    def any(self) -> bool:
        return bool(self.reasons)


@dataclass(frozen=True)
class PredictionInterval:
    """A predicted step and the interval a measurement is expected in (module docstring)."""

    predicted_s: float
    pessimistic_s: float
    reasons: tuple[str, ...] = ()

    @property
    def low_s(self) -> float:
        return self.predicted_s / (1 + RESIDUAL_HIGH)

    @property
    def high_s(self) -> float:
        return self.pessimistic_s / (1 + RESIDUAL_LOW)

    @property
    def extrapolated_share(self) -> float:
        """How much slower the plan gets if what was extrapolated is at its pessimistic value."""
        return self.pessimistic_s / self.predicted_s - 1 if self.predicted_s else 0.0

    def overlaps(self, other: "PredictionInterval") -> bool:
        return self.low_s <= other.high_s and other.low_s <= self.high_s


def network_name(cluster: ClusterSpec) -> str:
    return cluster.inter.network.name if cluster.inter.network else cluster.inter.name.split(" ")[0]


def measured_nodes(cluster: ClusterSpec) -> int:
    """Widest group across nodes a published measurement on this cluster's fabric spans."""
    return cluster.inter.network.measured_nodes if cluster.inter.network else 0


def extrapolations(cluster: ClusterSpec, widest_nodes: int, all_to_all_nodes: int = 0,
                   techniques: frozenset[str] = frozenset()) -> Extrapolation:
    """The pessimistic factors for a plan whose widest collective group spans `widest_nodes`,
    whose all-to-all group (if any) spans `all_to_all_nodes` and which uses `techniques`
    (`techniques_of`)."""
    reasons: list[str] = []
    network_factor = compute_factor = 1.0
    measured = measured_nodes(cluster)
    gpus = sorted({gpu.name for gpu in cluster.node_gpus})
    network = network_name(cluster)
    uncalibrated = [gpu for gpu in gpus if gpu not in CALIBRATED_GPUS]
    if uncalibrated and gpus != ["cpu"]:
        compute_factor = 1 + UNCALIBRATED_GPU_SLOWDOWN
        reasons.append(f"{', '.join(uncalibrated)} compute, with no published run to check it")
    if widest_nodes > 1 and gpus != ["cpu"]:
        if widest_nodes > measured:
            doublings = math.log2(widest_nodes / max(1, measured)) if measured else math.log2(widest_nodes)
            network_factor = NETWORK_FALL_PER_DOUBLING ** doublings
            reasons.append(f"collectives over {widest_nodes} nodes of {network}, beyond any measurement"
                           + (f" (widest measured: {measured})" if measured else " (none measured)"))
    unmeasured: tuple[str, ...] = ()
    if all_to_all_nodes > 1 and gpus != ["cpu"]:
        unmeasured = UNMEASURED_COLLECTIVES
        network_factor = max(network_factor, NETWORK_FALL_PER_DOUBLING ** math.log2(all_to_all_nodes))
        reasons.append(f"all-to-all over {all_to_all_nodes} nodes of {network}, with no published all-to-all "
                       "measurement (priced as the ring's links)")
    exposed = tuple(sorted(techniques - CALIBRATED_TECHNIQUES)) if gpus != ["cpu"] else ()
    reasons += [f"{TECHNIQUE_WORDS[name]}, an overlap no published run measured (priced exposed at its pessimistic "
                "value)" for name in exposed]
    return Extrapolation(network_factor, compute_factor, tuple(reasons), measured, unmeasured, exposed)


def pessimistic_cluster(cluster: ClusterSpec, extrapolation: Extrapolation) -> ClusterSpec:
    """The cluster as the pessimistic price sees it: every group over more nodes than were measured
    loses NETWORK_FALL_PER_DOUBLING of bandwidth per doubling beyond (groups within the measured
    range, and point-to-point sends, keep their price); an uncalibrated GPU computes slower; an
    unmeasured overlap is priced exposed."""
    inter = cluster.inter
    if extrapolation.network_factor != 1.0:
        inter = replace(inter, measured_nodes=extrapolation.measured_nodes,
                        fall_per_doubling=NETWORK_FALL_PER_DOUBLING, unmeasured_ops=extrapolation.unmeasured_ops)
    gpus = cluster.node_gpus
    if extrapolation.compute_factor != 1.0:
        slower = {gpu.name: gpu.with_overrides(peak_flops={d: f / extrapolation.compute_factor
                                                           for d, f in gpu.peak_flops.items()},
                                               memory_bandwidth_Bps=gpu.memory_bandwidth_Bps
                                               / extrapolation.compute_factor)
                  for gpu in gpus}
        gpus = tuple(slower[gpu.name] for gpu in gpus)
    return replace(cluster, inter=inter, node_gpus=gpus, exposed_overlap=extrapolation.exposed)

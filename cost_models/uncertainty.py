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

A run larger than every calibration row, in GPUs or in data-parallel ranks (the gradient group,
dp x cp), widens the interval itself (`ScaleTrend`): the out-of-sample residuals as a straight line
in log2 of that size, and the line's prediction band (Student's t at the interval's quantiles);
beyond the largest calibrated size, each bound moves by as much as the band's does from that
size to the run's (never narrower). refit computes the lines and writes them to
calibration.json (`scale_trends`); a test recomputes them from the stored residuals and sizes.

The planner's robust objective uses `s_pessimistic`: of two plans whose intervals overlap, the
one that depends less on what was extrapolated is preferred (autopar.solver.planner).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from cost_models.calibration import load_calibration
from cost_models.topology import ClusterSpec
from autopar.domain.vocabulary import CPStrategy

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
    if (getattr(plan, "cp", 1) or 1) > 1 and (getattr(plan, "cp_strategy", None) or CPStrategy.RING) == CPStrategy.RING:
        found.add(RING_ATTENTION)
    return frozenset(found)


def student_t_quantile(q: float, dof: int) -> float:
    """The q-quantile (0.5 <= q < 1) of Student's t with `dof` degrees of freedom: its density
    integrated by Simpson's rule, inverted by bisection (no statistics package needed)."""
    if not 0.5 <= q < 1 or dof < 1:
        raise ValueError(f"a t quantile needs 0.5 <= q < 1 and dof >= 1 (got q={q}, dof={dof})")
    scale = math.exp(math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2)) / math.sqrt(dof * math.pi)

    def density(t: float) -> float:
        return scale * (1 + t * t / dof) ** (-(dof + 1) / 2)

    def above_half(t: float, steps: int = 400) -> float:  # P(0 <= T <= t)
        h = t / steps
        inner = sum((4 if i % 2 else 2) * density(i * h) for i in range(1, steps))
        return h / 3 * (density(0.0) + inner + density(t))

    low, high = 0.0, 1.0
    while above_half(high) < q - 0.5:
        low, high = high, 2 * high
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if above_half(middle) < q - 0.5 else (low, middle)
    return (low + high) / 2


@dataclass(frozen=True)
class ScaleTrend:
    """Out-of-sample residuals as a line in log2 of a run's size (module docstring): what the
    calibration set says about error at sizes beyond its largest row."""

    size: str  # what is counted: "gpus" or "data_parallel_ranks"
    calibrated_max: int  # the largest size a calibration row ran
    intercept: float
    slope: float  # residual change per doubling of the size
    spread: float  # the residuals' standard deviation about the line (n - 2 degrees of freedom)
    count: int
    mean_log2: float
    sum_squares_log2: float  # sum of (log2 size - mean)^2
    t_quantile: float  # Student's t at the interval's upper quantile, n - 2 degrees of freedom

    @classmethod
    def fit(cls, size: str, sizes: list[int], residuals: list[float],
            quantiles: tuple[float, float] = INTERVAL_QUANTILES) -> "ScaleTrend":
        """Least squares of residual on log2(size); needs three rows of two sizes at least."""
        xs = [math.log2(value) for value in sizes]
        n = len(xs)
        mean_x, mean_y = sum(xs) / n, sum(residuals) / n
        sxx = sum((x - mean_x) ** 2 for x in xs)
        if n < 3 or sxx == 0:
            raise ValueError(f"a trend in {size} needs three rows of two sizes at least")
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, residuals)) / sxx
        intercept = mean_y - slope * mean_x
        sse = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, residuals))
        return cls(size, max(sizes), intercept, slope, math.sqrt(sse / (n - 2)), n, mean_x, sxx,
                   student_t_quantile(quantiles[1], n - 2))

    def band(self, value: float) -> tuple[float, float]:
        """The prediction band's residual bounds at `value`: the line ± t·spread·sqrt(1 + 1/n +
        (x - mean)^2 / Sxx), x = log2(value)."""
        x = math.log2(value)
        half = self.t_quantile * self.spread * math.sqrt(1 + 1 / self.count
                                                         + (x - self.mean_log2) ** 2 / self.sum_squares_log2)
        centre = self.intercept + self.slope * x
        return centre - half, centre + half

    def widening(self, value: float) -> tuple[float, float]:
        """How far the interval's (low, high) residual bounds move at `value`: as far as the
        band's do from the largest calibrated size, outwards only; nothing within the range."""
        if value <= self.calibrated_max:
            return 0.0, 0.0
        (low_max, high_max), (low, high) = self.band(self.calibrated_max), self.band(value)
        return min(0.0, low - low_max), max(0.0, high - high_max)

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "size"}


SCALE_TRENDS = {name: ScaleTrend(name, **fields)
                for name, fields in load_calibration().get("scale_trends", {}).items()}
SIZE_WORDS = {"gpus": "GPUs", "data_parallel_ranks": "ranks in a data-parallel group"}
BEYOND_CALIBRATION = "more than any calibration run"  # how a size's reason says it (the planner quotes those)
LOWEST_RESIDUAL = -0.9  # a widened low bound stops here: a run at most 10x slower than predicted


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
    residual_low: float = RESIDUAL_LOW  # the interval's residual bounds, widened beyond the calibrated sizes
    residual_high: float = RESIDUAL_HIGH

    @property
    def any(self) -> bool:
        return bool(self.reasons)

    @property
    def reprices(self) -> bool:
        """Whether the pessimistic price differs from the nominal one (a wider interval alone does not)."""
        return self.network_factor != 1.0 or self.compute_factor != 1.0 or bool(self.exposed) \
            or bool(self.unmeasured_ops)


@dataclass(frozen=True)
class PredictionInterval:
    """A predicted step and the interval a measurement is expected in (module docstring)."""

    predicted_s: float
    pessimistic_s: float
    reasons: tuple[str, ...] = ()
    residual_low: float = RESIDUAL_LOW
    residual_high: float = RESIDUAL_HIGH

    @property
    def low_s(self) -> float:
        return self.predicted_s / (1 + self.residual_high)

    @property
    def high_s(self) -> float:
        return self.pessimistic_s / (1 + self.residual_low)

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


def scale_widening(sizes: dict[str, int], trends: dict[str, ScaleTrend] | None = None
                   ) -> tuple[float, float, list[str]]:
    """The interval's residual bounds for a run of these sizes ({"gpus": .., "data_parallel_ranks":
    ..}), each trend's widening taken where it is widest, and a reason per size beyond the
    calibrated range."""
    trends = SCALE_TRENDS if trends is None else trends
    low, high, reasons = RESIDUAL_LOW, RESIDUAL_HIGH, []
    for name, value in sizes.items():
        trend = trends.get(name)
        if trend is None or value <= trend.calibrated_max:
            continue
        down, up = trend.widening(value)
        low, high = max(LOWEST_RESIDUAL, min(low, RESIDUAL_LOW + down)), max(high, RESIDUAL_HIGH + up)
        reasons.append(f"{value:,} {SIZE_WORDS[name]}, {BEYOND_CALIBRATION} ({trend.calibrated_max:,}): "
                       f"the interval widened as the out-of-sample error's trend in {SIZE_WORDS[name]} "
                       f"extrapolates ({RESIDUAL_LOW + down:+.0%}/{RESIDUAL_HIGH + up:+.0%})")
    return low, high, reasons


def extrapolations(cluster: ClusterSpec, widest_nodes: int, all_to_all_nodes: int = 0,
                   techniques: frozenset[str] = frozenset(), data_parallel_ranks: int = 1) -> Extrapolation:
    """The pessimistic factors for a plan whose widest collective group spans `widest_nodes`,
    whose all-to-all group (if any) spans `all_to_all_nodes`, which uses `techniques`
    (`techniques_of`) and whose gradient group holds `data_parallel_ranks`."""
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
    low, high = RESIDUAL_LOW, RESIDUAL_HIGH
    if gpus != ["cpu"]:
        low, high, wider = scale_widening({"gpus": cluster.world_size, "data_parallel_ranks": data_parallel_ranks})
        reasons += wider
    return Extrapolation(network_factor, compute_factor, tuple(reasons), measured, unmeasured, exposed, low, high)


def pessimistic_cluster_key(extrapolation: Extrapolation) -> tuple:
    """What `pessimistic_cluster` reads of an extrapolation: equal keys, equal clusters."""
    network = (extrapolation.measured_nodes, extrapolation.unmeasured_ops) if extrapolation.network_factor != 1.0 \
        else None
    return network, extrapolation.compute_factor, extrapolation.exposed


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

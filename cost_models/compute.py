"""Compute time: a roofline per op, summed per layer and cached for repeated layers.

An op takes max(FLOPs / (peak · efficiency), bytes / (bandwidth · efficiency)) plus a launch
overhead (Williams, Waterman & Patterson 2009, "Roofline"). GEMM and attention are limited by
FLOP/s at their class's efficiency (and by the full memory bandwidth); the other classes by
memory bandwidth at their class's efficiency. FLOPs and bytes in a profile scale linearly with
the micro-batch size, so a layer's time at micro-batch b is
(b / b_profiled) · roofline + launches · overhead.

Layers are priced by their first occurrence (`repeat_of`), once per GPU signature.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from cost_models.hardware import GPUSpec

if TYPE_CHECKING:
    from autopar.profile import ModelProfile

FLOP_BOUND_CLASSES = ("gemm", "attention")


def compute_dtype(precision: str) -> str:
    """Math dtype of a training precision (fp32 training does not enable TF32 in PyTorch)."""
    return precision if precision in ("bf16", "fp16") else "fp32"


def roofline_s(op_class: str, flops: float, moved_bytes: float, gpu: GPUSpec, dtype: str) -> float:
    """Roofline time of work of one op class, without launch overhead."""
    if op_class == "view":
        return 0.0
    efficiency = gpu.efficiency_of(op_class)
    if op_class in FLOP_BOUND_CLASSES:
        return max(flops / (gpu.flops(dtype) * efficiency), moved_bytes / gpu.memory_bandwidth_Bps)
    return max(flops / gpu.flops(dtype), moved_bytes / (gpu.memory_bandwidth_Bps * efficiency))


def op_roofline_s(op: Any, gpu: GPUSpec, dtype: str) -> float:
    """Roofline time of one profiled op, without the launch overhead."""
    return roofline_s(op.op_class, op.flops, op.bytes_read + op.bytes_written, gpu, dtype)


def op_time_s(op: Any, gpu: GPUSpec, dtype: str) -> float:
    """Roofline plus launch overhead (views launch nothing)."""
    return 0.0 if op.op_class == "view" else op_roofline_s(op, gpu, dtype) + gpu.launch_overhead_s


def ops_by_layer(profile: "ModelProfile") -> dict[str, list]:
    """The profile's ops per layer, with backward ops that belong to no module (the gradient sums
    of residual connections and of tensors used twice) moved to the layer whose backward produced
    their latest input: that is the layer whose backward they run inside, so a pipeline stage
    holding it pays for them."""
    layer_of: dict[str, str] = {}
    index = {op.name: i for i, op in enumerate(profile.ops)}
    grouped: dict[str, list] = {}
    for op in profile.ops:
        layer = op.layer
        if op.phase == "backward" and op.module is None:
            producers = [name for name in op.inputs if name in index]
            if producers:
                layer = layer_of[max(producers, key=index.__getitem__)]
        layer_of[op.name] = layer
        grouped.setdefault(layer, []).append(op)
    return grouped


@dataclass(frozen=True)
class LayerCompute:
    """A layer's compute at the profiled micro-batch on one GPU type (no parallelism).

    Attributes:
        forward_s, backward_s: roofline seconds (scale with the micro-batch).
        forward_nongemm_s: the part of forward that selective recomputation runs again (every
            op but GEMMs and attention, whose outputs it keeps).
        *_launches: ops launched (each costs the GPU's launch overhead, independent of size).
        attention_s: the fused attention kernels' share of forward + backward (what ring
            attention overlaps its K/V transfers with).
        attention_forward_s: their forward share (what a recomputed ring attention runs again).
    """

    forward_s: float
    backward_s: float
    forward_nongemm_s: float
    forward_launches: int
    backward_launches: int
    forward_nongemm_launches: int
    attention_s: float = 0.0
    attention_forward_s: float = 0.0

    def time_s(self, scale: float, overhead_s: float, forward_passes: float = 1.0, nongemm_passes: float = 0.0) -> float:
        """Forward(s) + backward (+ selective re-forward) at `scale` x the profiled micro-batch."""
        return (scale * (forward_passes * self.forward_s + self.backward_s + nongemm_passes * self.forward_nongemm_s)
                + overhead_s * (forward_passes * self.forward_launches + self.backward_launches
                                + nongemm_passes * self.forward_nongemm_launches))


def compute_of_ops(forward: Sequence[Any], backward: Sequence[Any],
                   seconds: Callable[[Sequence[Any]], float]) -> LayerCompute:
    """LayerCompute of a layer's forward and backward ops (views left out by the caller),
    ``seconds`` pricing a list of them (a TP split divides the ops it shards)."""
    nongemm = [op for op in forward if op.op_class not in FLOP_BOUND_CLASSES]
    attention_forward = [op for op in forward if op.op_class == "attention"]
    attention_forward_s = seconds(attention_forward)
    return LayerCompute(
        forward_s=seconds(forward), backward_s=seconds(backward), forward_nongemm_s=seconds(nongemm),
        forward_launches=len(forward), backward_launches=len(backward), forward_nongemm_launches=len(nongemm),
        attention_s=attention_forward_s + seconds([op for op in backward if op.op_class == "attention"]),
        attention_forward_s=attention_forward_s)


def price_ops(ops: list, gpu: GPUSpec, dtype: str) -> LayerCompute:
    """LayerCompute of a layer's ops."""
    priced = [op for op in ops if op.op_class != "view"]
    return compute_of_ops([op for op in priced if op.phase == "forward"],
                          [op for op in priced if op.phase == "backward"],
                          lambda selected: sum(op_roofline_s(op, gpu, dtype) for op in selected))


def price_classes(layer: Any, gpu: GPUSpec, dtype: str) -> LayerCompute:
    """LayerCompute from a layer's per-class aggregates, for profiles saved without ops (each
    class priced as one kernel of its summed work, launches counted per op)."""
    def total(by_class: dict, classes=None) -> tuple[float, int]:
        seconds, launches = 0.0, 0
        for op_class, cost in by_class.items():
            if op_class == "view" or (classes is not None and op_class not in classes):
                continue
            seconds += roofline_s(op_class, cost.flops, cost.bytes, gpu, dtype)
            launches += cost.count
        return seconds, launches

    forward, forward_n = total(layer.forward_by_class)
    backward, backward_n = total(layer.backward_by_class)
    nongemm, nongemm_n = total(layer.forward_by_class,
                               [c for c in layer.forward_by_class if c not in FLOP_BOUND_CLASSES])
    attention_forward = total(layer.forward_by_class, ["attention"])[0]
    attention = attention_forward + total(layer.backward_by_class, ["attention"])[0]
    return LayerCompute(forward, backward, nongemm, forward_n, backward_n, nongemm_n, attention, attention_forward)


class ComputeModel:
    """Per-layer compute for one profile, cached per (layer kind, GPU signature)."""

    def __init__(self, profile: "ModelProfile"):
        self.profile = profile
        self.dtype = compute_dtype(profile.precision)
        self.ops_by_layer = ops_by_layer(profile) if profile.ops else {}
        self._layers = {layer.name: layer for layer in profile.layers}
        self._kinds = {layer.name: layer.repeat_of or layer.name for layer in profile.layers}
        self._cache: dict[tuple, LayerCompute] = {}

    def kind(self, layer_name: str) -> str:
        """Repeated layers share their first occurrence's costs."""
        return self._kinds[layer_name]

    def layer(self, layer_name: str, gpu: GPUSpec) -> LayerCompute:
        kind = self.kind(layer_name)
        key = (kind, gpu.signature)
        if key not in self._cache:
            if self.profile.ops:
                self._cache[key] = price_ops(self.ops_by_layer.get(kind, []), gpu, self.dtype)
            else:
                self._cache[key] = price_classes(self._layers[kind], gpu, self.dtype)
        return self._cache[key]

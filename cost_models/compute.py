"""Compute time: a roofline per op, summed per layer and cached for repeated layers.

An op takes max(FLOPs / (peak · efficiency), bytes / (bandwidth · efficiency)) plus a launch
overhead (Williams, Waterman & Patterson 2009, "Roofline"); GEMM and attention are limited by
FLOP/s at their class's efficiency, the rest by memory bandwidth at theirs. FLOPs and bytes in
a profile scale linearly with the micro-batch size, so a layer's time at micro-batch b is
(b / b_profiled) · roofline + launches · overhead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cost_models.hardware import GPUSpec

if TYPE_CHECKING:
    from autopar.profile import ModelProfile

FLOP_BOUND_CLASSES = ("gemm", "attention")


def compute_dtype(precision: str) -> str:
    return "bf16" if precision in ("bf16", "fp16") else "fp32"


def op_roofline_s(op: Any, gpu: GPUSpec, dtype: str) -> float:
    """Roofline time of one profiled op, without the launch overhead."""
    if op.op_class == "view":
        return 0.0
    efficiency = gpu.efficiency.get(op.op_class, gpu.efficiency.get("other", 0.5))
    moved = op.bytes_read + op.bytes_written
    if op.op_class in FLOP_BOUND_CLASSES:
        return max(op.flops / (gpu.flops(dtype) * efficiency), moved / gpu.memory_bandwidth_Bps)
    return max(op.flops / gpu.flops(dtype), moved / (gpu.memory_bandwidth_Bps * efficiency))


def op_time_s(op: Any, gpu: GPUSpec, dtype: str) -> float:
    """Roofline plus launch overhead (views launch nothing)."""
    return 0.0 if op.op_class == "view" else op_roofline_s(op, gpu, dtype) + gpu.launch_overhead_s


@dataclass(frozen=True)
class LayerCompute:
    """A layer's compute at the profiled micro-batch on one GPU type (no parallelism)."""

    forward_s: float  # roofline part, scales with the micro-batch
    backward_s: float
    forward_nongemm_s: float  # what selective recomputation re-runs
    forward_launches: int
    backward_launches: int
    forward_nongemm_launches: int

    def time_s(self, scale: float, overhead_s: float, forward_passes: float = 1.0, nongemm_passes: float = 0.0) -> float:
        return (scale * (forward_passes * self.forward_s + self.backward_s + nongemm_passes * self.forward_nongemm_s)
                + overhead_s * (forward_passes * self.forward_launches + self.backward_launches
                                + nongemm_passes * self.forward_nongemm_launches))


class ComputeModel:
    """Per-layer compute for one profile, cached per (layer kind, GPU type)."""

    def __init__(self, profile: "ModelProfile"):
        self.profile = profile
        self.dtype = compute_dtype(profile.precision)
        self._ops_by_layer: dict[str, list] = {}
        for op in profile.ops:
            self._ops_by_layer.setdefault(op.layer, []).append(op)
        self._cache: dict[tuple[str, str], LayerCompute] = {}
        self._kinds = {layer.name: layer.repeat_of or layer.name for layer in profile.layers}

    def kind(self, layer_name: str) -> str:
        """Repeated layers share their first occurrence's costs."""
        return self._kinds[layer_name]

    def layer(self, layer_name: str, gpu: GPUSpec) -> LayerCompute:
        key = (self.kind(layer_name), gpu.name)
        if key not in self._cache:
            self._cache[key] = self._price(self._ops_by_layer.get(key[0], []), gpu)
        return self._cache[key]

    def _price(self, ops: list, gpu: GPUSpec) -> LayerCompute:
        forward = [op for op in ops if op.phase == "forward" and op.op_class != "view"]
        backward = [op for op in ops if op.phase == "backward" and op.op_class != "view"]
        nongemm = [op for op in forward if op.op_class not in FLOP_BOUND_CLASSES]
        return LayerCompute(
            forward_s=sum(op_roofline_s(op, gpu, self.dtype) for op in forward),
            backward_s=sum(op_roofline_s(op, gpu, self.dtype) for op in backward),
            forward_nongemm_s=sum(op_roofline_s(op, gpu, self.dtype) for op in nongemm),
            forward_launches=len(forward), backward_launches=len(backward),
            forward_nongemm_launches=len(nongemm))

"""Compute time: a roofline per op, summed per layer and cached for repeated layers.

An op takes max(FLOPs / (peak · efficiency), bytes / (bandwidth · efficiency)) plus a launch
overhead (Williams, Waterman & Patterson 2009, "Roofline"). GEMM and attention are limited by
FLOP/s at their class's efficiency (and by the full memory bandwidth); the other classes by
memory bandwidth at their class's efficiency. FLOPs and bytes in a profile scale linearly with
the micro-batch size, so a layer's time at micro-batch b is
(b / b_profiled) · roofline + launches · overhead.

Layers are priced by their first occurrence (`repeat_of`), once per GPU signature.

GEMM efficiency depends on shape (`gemm_shape_efficiency`): the catalogue's GEMM efficiency is
what large matmuls reach; a GEMM's output is computed in tiles spread over the GPU's SMs in
waves, so a shape that leaves tiles partly empty (tile quantisation) or a last wave partly idle
(wave quantisation) reaches that share of it (NVIDIA, "Matrix Multiplication Background User's
Guide", Deep Learning Performance docs). Small hidden sizes and small micro-batches are where
this bites. The shape is the profiled one (micro-batch `b_profiled`), a pessimistic estimate for
larger micro-batches, whose time is scaled linearly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, AbstractSet, Any, Callable, Sequence

from cost_models.weights import selective_reruns
from cost_models.hardware import GPUSpec

if TYPE_CHECKING:
    from autopar.model_profile import ModelProfile

FLOP_BOUND_CLASSES = ("gemm", "attention")


def compute_dtype(precision: str) -> str:
    """Math dtype of a training precision (fp32 training does not enable TF32 in PyTorch)."""
    return precision if precision in ("bf16", "fp16") else "fp32"


# Output tile shapes a GEMM library chooses between (CUTLASS / cuBLAS thread-block tiles for
# 16-bit tensor-core GEMMs); the best fit for the shape is taken, as their heuristics do.
GEMM_TILES = ((256, 128), (128, 256), (128, 128))
_GEMM_TARGETS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm")


SPLIT_K_MIN_DEPTH = 256  # a split-K slice keeps at least this much of the reduction dimension


def gemm_shape_efficiency(batch: int, m: int, n: int, k: int, sm_count: int) -> float:
    """Share of large-GEMM efficiency an (m x k)·(k x n) product (times `batch`) reaches: tile
    quantisation m·n / (tiles · tile area) times wave quantisation tiles / (waves · SMs), for the
    best of GEMM_TILES and of splitting k into up to 16 slices when the tiles alone cannot fill
    the SMs (split-K, as GEMM libraries do for skinny products). 1.0 when the SM count is unknown."""
    if sm_count <= 0 or min(batch, m, n, k) <= 0:
        return 1.0
    best = 0.0
    for tile_m, tile_n in GEMM_TILES:
        tiles = batch * math.ceil(m / tile_m) * math.ceil(n / tile_n)
        tile_share = batch * m * n / (tiles * tile_m * tile_n)
        for split in (1, 2, 4, 8, 16):
            if split > 1 and (k < split * SPLIT_K_MIN_DEPTH or tiles * split > 2 * sm_count):
                break
            work = tiles * split
            best = max(best, tile_share * work / (math.ceil(work / sm_count) * sm_count))
    return best


def gemm_dims(op: Any) -> tuple[int, int, int, int] | None:
    """(batch, m, n, k) of a matmul op, from its input shapes (None if not a plain GEMM)."""
    target = getattr(op, "target", "")
    if not target.startswith(_GEMM_TARGETS):
        return None
    shapes = list(getattr(op, "input_shapes", None) or [])
    if target.startswith(("aten.addmm", "aten.baddbmm")):
        shapes = shapes[1:]
    if len(shapes) < 2 or len(shapes[0]) != len(shapes[1]) or len(shapes[0]) not in (2, 3):
        return None
    a, b = shapes[0], shapes[1]
    return (a[0] if len(a) == 3 else 1), a[-2], b[-1], a[-1]


def roofline_s(op_class: str, flops: float, moved_bytes: float, gpu: GPUSpec, dtype: str,
               shape_efficiency: float = 1.0) -> float:
    """Roofline time of work of one op class, without launch overhead (`shape_efficiency`: the
    share of the class's efficiency this op's shape reaches, GEMMs only)."""
    if op_class == "view":
        return 0.0
    efficiency = gpu.efficiency_of(op_class) * (shape_efficiency if op_class == "gemm" else 1.0)
    if op_class in FLOP_BOUND_CLASSES:
        return max(flops / (gpu.sustained_flops(dtype) * efficiency), moved_bytes / gpu.memory_bandwidth_Bps)
    return max(flops / gpu.sustained_flops(dtype), moved_bytes / (gpu.memory_bandwidth_Bps * efficiency))


ATTENTION_BLOCK = 128  # query rows (and key rows) a fused attention kernel takes per tile


def attention_work_share(op: Any) -> float:
    """Share of an attention op's counted FLOPs (every query against every key, as torch's flop
    counter counts them) that a fused kernel computes: with a causal mask, query block i of n
    reads only key blocks 0..i, n(n+1)/2 of the n^2."""
    if not getattr(op, "causal", False) or not op.input_shapes or len(op.input_shapes[0]) < 2:
        return 1.0
    blocks = max(1, math.ceil(op.input_shapes[0][-2] / ATTENTION_BLOCK))
    return (blocks + 1) / (2 * blocks)


def attention_tail_s(op: Any, gpu: GPUSpec, dtype: str) -> float:
    """The time an attention kernel's last tiles add past an even spread of its work over the SMs:
    a tile (one query block of one head) runs on one SM, and the longest reads all n key blocks;
    tiles of sizes up to that finish at different times, about half the longest one apart."""
    if not gpu.sm_count or not op.input_shapes or len(op.input_shapes[0]) < 3:
        return 0.0
    shape = op.input_shapes[0]
    tiles = math.prod(shape[:-2]) * max(1, math.ceil(shape[-2] / ATTENTION_BLOCK))
    per_sm = gpu.sustained_flops(dtype) * gpu.efficiency_of("attention") / gpu.sm_count
    return 0.5 * op.flops / tiles / per_sm


def op_roofline_s(op: Any, gpu: GPUSpec, dtype: str) -> float:
    """Roofline time of one profiled op, without the launch overhead (an attention op: the work
    its kernel computes, and its tail, `attention_work_share` and `attention_tail_s`)."""
    moved = op.bytes_read + op.bytes_written
    if op.op_class == "attention":
        return roofline_s("attention", op.flops * attention_work_share(op), moved, gpu, dtype) \
            + attention_tail_s(op, gpu, dtype)
    shape = 1.0
    if op.op_class == "gemm" and gpu.sm_count:
        dims = gemm_dims(op)
        shape = gemm_shape_efficiency(*dims, gpu.sm_count) if dims else 1.0
    return roofline_s(op.op_class, op.flops, moved, gpu, dtype, shape)


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
        selective_rerun_s: the part of forward that selective recomputation runs again (every
            op but attention and the products with a weight, whose outputs it keeps: products of
            two activations, an attention written out, are run again).
        *_launches: ops launched (each costs the GPU's launch overhead, independent of size).
        attention_s: the fused attention kernels' share of forward + backward (what ring
            attention overlaps its K/V transfers with).
        attention_forward_s: their forward share (what a recomputed ring attention runs again).
    """

    forward_s: float
    backward_s: float
    selective_rerun_s: float
    forward_launches: int
    backward_launches: int
    selective_rerun_launches: int
    attention_s: float = 0.0
    attention_forward_s: float = 0.0

    def time_s(self, scale: float, overhead_s: float, forward_passes: float = 1.0,
               rerun_passes: float = 0.0) -> float:
        """Forward(s) + backward (+ selective re-forward) at `scale` x the profiled micro-batch."""
        return (scale * (forward_passes * self.forward_s + self.backward_s + rerun_passes * self.selective_rerun_s)
                + overhead_s * (forward_passes * self.forward_launches + self.backward_launches
                                + rerun_passes * self.selective_rerun_launches))


def compute_of_ops(forward: Sequence[Any], backward: Sequence[Any], seconds: Callable[[Sequence[Any]], float],
                   rerun_products: AbstractSet[str] = frozenset()) -> LayerCompute:
    """LayerCompute of a layer's forward and backward ops (views left out by the caller),
    ``seconds`` pricing a list of them (a TP split divides the ops it shards);
    ``rerun_products``: the products selective recomputation runs again
    (`cost_models.weights.selective_reruns`)."""
    rerun = [op for op in forward if op.op_class not in FLOP_BOUND_CLASSES or op.name in rerun_products]
    attention_forward = [op for op in forward if op.op_class == "attention"]
    attention_forward_s = seconds(attention_forward)
    return LayerCompute(
        forward_s=seconds(forward), backward_s=seconds(backward), selective_rerun_s=seconds(rerun),
        forward_launches=len(forward), backward_launches=len(backward), selective_rerun_launches=len(rerun),
        attention_s=attention_forward_s + seconds([op for op in backward if op.op_class == "attention"]),
        attention_forward_s=attention_forward_s)


def price_ops(ops: list, gpu: GPUSpec, dtype: str, rerun_products: AbstractSet[str] = frozenset()
              ) -> LayerCompute:
    """LayerCompute of a layer's ops."""
    priced = [op for op in ops if op.op_class != "view"]
    return compute_of_ops([op for op in priced if op.phase == "forward"],
                          [op for op in priced if op.phase == "backward"],
                          lambda selected: sum(op_roofline_s(op, gpu, dtype) for op in selected), rerun_products)


def price_classes(layer: Any, gpu: GPUSpec, dtype: str) -> LayerCompute:
    """LayerCompute from a layer's per-class aggregates, for profiles saved without ops (each
    class priced as one kernel of its summed work, launches counted per op; every GEMM counted
    as kept by selective recomputation, which these aggregates cannot tell apart)."""
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
    rerun, rerun_n = total(layer.forward_by_class,
                           [c for c in layer.forward_by_class if c not in FLOP_BOUND_CLASSES])
    attention_forward = total(layer.forward_by_class, ["attention"])[0]
    attention = attention_forward + total(layer.backward_by_class, ["attention"])[0]
    return LayerCompute(forward, backward, rerun, forward_n, backward_n, rerun_n, attention, attention_forward)


class ComputeModel:
    """Per-layer compute for one profile, cached per (layer kind, GPU signature)."""

    def __init__(self, profile: "ModelProfile", selective_runtime: str = "autopar"):
        self.profile = profile
        self.selective_runtime = selective_runtime
        self.dtype = compute_dtype(profile.precision)
        self.ops_by_layer = ops_by_layer(profile) if profile.ops else {}
        self.rerun_products = selective_reruns(profile, selective_runtime) if profile.ops else frozenset()
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
                self._cache[key] = price_ops(self.ops_by_layer.get(kind, []), gpu, self.dtype,
                                                self.rerun_products)
            else:
                self._cache[key] = price_classes(self._layers[kind], gpu, self.dtype)
        return self._cache[key]

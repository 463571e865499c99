"""The cost model against `benchmarks.gpu_efficiency_check` measurements, class by class.

Each GEMM is priced as the cost model prices a profiled one (roofline at the catalogue's GEMM
efficiency times its shape's tile and wave share, plus a launch); each causal attention as a
profiled SDPA (the flop counter's full-square FLOPs at the attention efficiency); each example
layer from its own profile (traced on meta tensors, as `autopar plan` does), by op class. The
result says which class the model gets wrong, by how much, and where.
tests/unit/test_cost_vs_gpu.py holds the cost model to these prices and
benchmarks/bench_gpu_efficiency.py tabulates them.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from benchmarks.gpu_efficiency_check import HEAD_DIM
from cost_models.compute import gemm_shape_efficiency, roofline_s
from cost_models.hardware import GPUSpec, get_gpu

DEVICE_GPUS = {"NVIDIA H200": "H200", "NVIDIA H100 80GB HBM3": "H100-SXM"}
BF16 = 2


@dataclass(frozen=True)
class Priced:
    """One measured piece of work beside its price."""

    label: str
    measured_s: float
    predicted_s: float

    @property
    def error(self) -> float:
        """Signed relative error (negative: the model predicts it faster than it ran)."""
        return self.predicted_s / self.measured_s - 1


def price_gemm(m: int, n: int, k: int, gpu: GPUSpec) -> float:
    moved = BF16 * (m * k + k * n + m * n)
    shape = gemm_shape_efficiency(1, m, n, k, gpu.sm_count)
    return roofline_s("gemm", 2 * m * n * k, moved, gpu, "bf16", shape) + gpu.launch_overhead_s


def price_attention(record: dict, gpu: GPUSpec, causal: bool = True) -> tuple[float, float]:
    """(forward, forward + backward) seconds of one causal SDPA as a profile holds it: torch's flop
    counter counts the full square (4·b·h·s²·d forward, 2.5x that backward), the op is marked
    causal, and `op_time_s` prices the work its kernel computes (``causal=False``: the whole square,
    as if the profile had not seen the mask). A record without `head_dim` (the attention grid of
    `benchmarks.gpu_power_check`) was measured at HEAD_DIM."""
    from types import SimpleNamespace

    from cost_models.compute import op_time_s

    shape = [record["batch"], record["heads"], record["seq"], record.get("head_dim", HEAD_DIM)]
    batch, heads, seq, head_dim = shape
    forward_flops = 4 * batch * heads * seq**2 * head_dim
    moved = 4 * BF16 * math.prod(shape)
    forward, backward = (SimpleNamespace(op_class="attention", flops=flops, bytes_read=moved, bytes_written=moved // 4,
                                         input_shapes=[shape], causal=causal)
                         for flops in (forward_flops, 2.5 * forward_flops))
    forward_s = op_time_s(forward, gpu, "bf16")
    return forward_s, forward_s + op_time_s(backward, gpu, "bf16")


def block_ops(shape: dict) -> list:
    """The profiled ops (`autopar.model_profile.OpProfile`) of one block of the example at the run's
    sizes, forward and backward, traced on meta tensors as `autopar plan` traces (once per process
    and shape: every GPU prices the same trace)."""
    return _block_ops(tuple(sorted(shape.items())))


@functools.cache
def _block_ops(shape_items: tuple) -> list:
    from autopar.model_file import load_model_file
    from autopar.profile import profile_model
    from cost_models.compute import ops_by_layer

    shape = dict(shape_items)
    example = "llama_hf.py" if shape["gated"] else "gpt.py"
    sizes = {"layers": 2, "hidden": shape["hidden"], "heads": shape["heads"], "seq_len": shape["seq_len"],
             "vocab": shape["vocab"]}
    if shape["gated"]:
        sizes.update(kv_heads=shape["kv_heads"], ffn=shape["ffn"])
    model_file = load_model_file(Path(__file__).resolve().parent.parent / "examples" / example)
    profile = profile_model(model_file, sizes, micro_batch_size=shape["micro_batch"], precision="bf16")
    block = next(layer for layer in profile.layers if layer.is_block)
    return ops_by_layer(profile)[block.name]


def layer_prediction(run: str, shape: dict, gpu: GPUSpec) -> dict[str, float]:
    """Predicted forward + backward seconds of one block of the example at the run's sizes, by op
    class (launch overhead counted in each class), from a profile traced on meta tensors."""
    from cost_models.compute import op_time_s

    by_class: dict[str, float] = {}
    for op in block_ops(shape):
        kind = op.op_class if op.op_class in ("gemm", "attention") else "other"
        by_class[kind] = by_class.get(kind, 0.0) + op_time_s(op, gpu, "bf16")
    return by_class


def full_square_attention_s(shape: dict, gpu: GPUSpec) -> float:
    """The block's attention ops priced as if none were causal: the flop counter's whole square, what
    the cost model prices where the profile does not see the causal mask."""
    from cost_models.compute import op_time_s

    return sum(op_time_s(dataclasses.replace(op, causal=False), gpu, "bf16")
               for op in block_ops(shape) if op.op_class == "attention")


def measured_layer(records: list[dict], run: str) -> tuple[float, dict[str, float]]:
    """Per-layer wall seconds and kernel-busy seconds by class: the difference between the two
    layer counts measured, divided by the layers between them."""
    low, high = sorted((r for r in records if r["kind"] == "layer" and r["run"] == run), key=lambda r: r["layers"])
    layers = high["layers"] - low["layers"]
    busy = {kind: (high["busy_s"].get(kind, 0.0) - low["busy_s"].get(kind, 0.0)) / layers for kind in high["busy_s"]}
    return (high["wall_s"] - low["wall_s"]) / layers, busy


def error_spread(priced: list[Priced]) -> tuple[float, float, float]:
    """(median, smallest, largest) signed relative error of the priced pieces."""
    errors = [p.error for p in priced]
    return statistics.median(errors), min(errors), max(errors)


def _summary(name: str, priced: list[Priced]) -> str:
    median, low, high = error_spread(priced)
    return (f"{name}: {len(priced)} measured, median error {100 * median:+.1f}%, "
            f"range {100 * low:+.1f}..{100 * high:+.1f}%")


def read_records(path: Path) -> tuple[list[dict], GPUSpec]:
    """A measurement file's records and the catalogue GPU they were measured on."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    device = next(r for r in records if r["kind"] == "device")["device"]
    return records, get_gpu(DEVICE_GPUS[device])


def priced_gemms(records: list[dict], gpu: GPUSpec) -> list[Priced]:
    return [Priced(f'{r["run"]} {r["name"]} {r["pass"]} {r["m"]}x{r["n"]}x{r["k"]}', r["seconds"],
                   price_gemm(r["m"], r["n"], r["k"], gpu)) for r in records if r["kind"] == "gemm"]


def priced_attention(records: list[dict], gpu: GPUSpec) -> list[Priced]:
    return [Priced(f'{r["run"]} attention forward+backward', r["forward_backward_s"], price_attention(r, gpu)[1])
            for r in records if r["kind"] == "attention"]


def layer_comparison(records: list[dict], run: str, gpu: GPUSpec) -> dict:
    """Measured per-layer wall and kernel seconds by class beside the predicted ones."""
    wall, busy = measured_layer(records, run)
    shape = next(r["shape"] for r in records if r.get("run") == run and "shape" in r)
    return {"wall_s": wall, "busy_s": busy, "predicted_s": layer_prediction(run, shape, gpu)}


def layer_runs(records: list[dict]) -> list[str]:
    return sorted({r["run"] for r in records if r["kind"] == "layer"})


def compare(path: Path) -> None:
    records, gpu = read_records(path)
    print(f"measured on {records[0]['device']}, priced as {gpu.name}")
    print(_summary("GEMMs alone", priced_gemms(records, gpu)))
    print(_summary("causal attention alone", priced_attention(records, gpu)))
    for run in layer_runs(records):
        layer = layer_comparison(records, run, gpu)
        busy, predicted = layer["busy_s"], layer["predicted_s"]
        print(f"{run} per layer: wall {layer['wall_s'] * 1e3:.2f} ms, kernels " + ", ".join(
            f"{kind} {busy.get(kind, 0) * 1e3:.2f} (predicted {predicted.get(kind, 0) * 1e3:.2f})"
            for kind in ("gemm", "attention", "other")) + f" ms; predicted {sum(predicted.values()) * 1e3:.2f} ms")

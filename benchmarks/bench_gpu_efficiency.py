"""Hopper compute by cause beside today's cost model: the kernels and decoder layers measured on an
H100 SXM and an H200 (benchmarks/measured/h100_efficiency.jsonl, h200_efficiency.jsonl:
`benchmarks.gpu_efficiency_check`), the causal attention grid (h100_power.jsonl, h200_power.jsonl:
`benchmarks.gpu_power_check`) and two recomputation policies (h100_recompute.jsonl:
`benchmarks.gpu_recompute_check`), each priced as benchmarks/gpu_efficiency_compare.py prices it.

    python -m benchmarks.run gpu_efficiency

Rows, by `work`:

* GEMMs: every GEMM of one layer of a published run (forward, input and weight gradients), each
  timed alone; `error_pct` is the median, `min_error_pct` and `max_error_pct` the extremes.
* attention alone: causal SDPA forward + backward at a run's per-rank shape; `full_square_ms` prices
  the whole square the flop counter counts (the profile blind to the mask); `pct_of_peak` and
  `forward_pct_of_peak` are the measured TFLOP/s on the causal half of the square over the bf16
  peak. The attention grid: the same over batch x heads x sequence, and by sequence length.
* attention in the layer and decoder layer: per-layer kernel time of attention and per-layer wall
  time, from two layer counts, against the block's meta-tensor profile priced; `busy_pct` is the
  share of the wall the kernels were busy.
* recomputation: step time and peak memory a layer over no recomputation (`saved_gb`: 1e9 bytes).

Errors are signed: negative where the cost model prices less than ran. Only the priced columns and
the errors move when the cost model changes. The smoke run prices one GEMM.
"""
from __future__ import annotations

from benchmarks import cases, smoke
from benchmarks.gpu_efficiency_compare import (Priced, error_spread, full_square_attention_s, layer_comparison,
                                               layer_runs, price_attention, priced_gemms, read_records)
from benchmarks.gpu_plan_compare import MEASURED
from cost_models.hardware import GPUSpec

GPU_PREFIXES = ("h100", "h200")
COLUMNS = ("gpu", "work", "case", "count", "measured_ms", "priced_ms", "error_pct", "min_error_pct", "max_error_pct",
           "full_square_ms", "busy_pct", "pct_of_peak", "forward_pct_of_peak", "saved_gb")
D7_LAYERS = 32  # Llama-3.1-8B's decoder layers, torchtitan's D7 runs


def _row(**fields: str | int) -> dict[str, str | int]:
    """A row with every column, blank where the kind of work has no such figure."""
    return {column: fields.get(column, "") for column in COLUMNS}


def _ms(seconds: float) -> str:
    """Milliseconds to three significant figures (0.584, 7.82, 50.2), whole ones from 100 on."""
    ms = 1e3 * seconds
    return f"{ms:.0f}" if abs(ms) >= 100 else f"{ms:.3g}"


def _pct(share: float) -> str:
    return f"{100 * share:+.1f}"


def _of_peak(tflops: float, gpu: GPUSpec) -> str:
    return f"{100 * tflops * 1e12 / gpu.flops('bf16'):.1f}"


def gemm_rows(records: list[dict], gpu: GPUSpec) -> list[dict]:
    """Per run, and over all runs: how many GEMMs and the median and extreme errors of their prices."""
    rows = []
    groups = [(run, [r for r in records if r["run"] == run]) for run in dict.fromkeys(r["run"] for r in records)]
    for case, group in [*groups, ("all runs", records)]:
        priced = priced_gemms(group, gpu)
        median, low, high = error_spread(priced)
        rows.append(_row(gpu=gpu.name, work="GEMMs, each alone", case=case, count=len(priced), error_pct=_pct(median),
                         min_error_pct=_pct(low), max_error_pct=_pct(high)))
    return rows


def attention_rows(records: list[dict], gpu: GPUSpec) -> list[dict]:
    """Causal SDPA forward + backward at each run's per-rank shape, timed alone."""
    rows = []
    for record in (r for r in records if r["kind"] == "attention"):
        priced = Priced(record["run"], record["forward_backward_s"], price_attention(record, gpu)[1])
        rows.append(_row(gpu=gpu.name, work="attention alone", case=record["run"], measured_ms=_ms(priced.measured_s),
                         priced_ms=_ms(priced.predicted_s), error_pct=_pct(priced.error),
                         full_square_ms=_ms(price_attention(record, gpu, causal=False)[1]),
                         pct_of_peak=_of_peak(record["forward_backward_tflops"], gpu),
                         forward_pct_of_peak=_of_peak(record["forward_tflops"], gpu)))
    return rows


def grid_rows(records: list[dict], gpu: GPUSpec) -> list[dict]:
    """The attention grid point by point, then by sequence length; first the efficiency priced."""
    rows = [_row(gpu=gpu.name, work="attention efficiency priced (catalogue)",
                 pct_of_peak=f"{100 * gpu.efficiency_of('attention'):.1f}")]
    by_seq: dict[int, list[Priced]] = {}
    for record in (r for r in records if r["kind"] == "attention_grid"):
        case = f"{record['batch']} x {record['heads']} heads x {record['seq']} tokens"
        priced = Priced(case, record["forward_backward_s"], price_attention(record, gpu)[1])
        by_seq.setdefault(record["seq"], []).append(priced)
        rows.append(_row(gpu=gpu.name, work="attention grid", case=case, measured_ms=_ms(priced.measured_s),
                         priced_ms=_ms(priced.predicted_s), error_pct=_pct(priced.error),
                         pct_of_peak=_of_peak(record["causal_tflops"], gpu)))
    for seq, calls in by_seq.items():
        median, low, high = error_spread(calls)
        rows.append(_row(gpu=gpu.name, work="attention grid, by sequence length", case=f"{seq} tokens",
                         count=len(calls), error_pct=_pct(median), min_error_pct=_pct(low), max_error_pct=_pct(high)))
    return rows


def layer_rows(records: list[dict], gpu: GPUSpec) -> list[dict]:
    """Per run measured in layers: attention's kernels inside the layer, then the layer's wall time."""
    rows = []
    for run in layer_runs(records):
        layer = layer_comparison(records, run, gpu)
        shape = next(r["shape"] for r in records if r.get("run") == run and "shape" in r)
        attention = Priced(run, layer["busy_s"]["attention"], layer["predicted_s"]["attention"])
        rows.append(_row(gpu=gpu.name, work="attention in the layer", case=run, measured_ms=_ms(attention.measured_s),
                         priced_ms=_ms(attention.predicted_s), error_pct=_pct(attention.error),
                         full_square_ms=_ms(full_square_attention_s(shape, gpu))))
        whole = Priced(run, layer["wall_s"], sum(layer["predicted_s"].values()))
        busy = sum(layer["busy_s"].values()) / layer["wall_s"]
        rows.append(_row(gpu=gpu.name, work="decoder layer, forward + backward", case=run,
                         measured_ms=_ms(whole.measured_s), priced_ms=_ms(whole.predicted_s),
                         error_pct=_pct(whole.error), busy_pct=f"{100 * busy:.1f}"))
    return rows


def recompute_rows() -> list[dict]:
    """Each recomputation policy's time and memory a layer over none; then torchtitan's against
    autopar's over D7's layers (measurements alone: the cost model prices autopar's policy)."""
    records, gpu = read_records(MEASURED / "h100_recompute.jsonl")
    runs = {r["how"]: r for r in records if r["kind"] == "recompute"}
    none = runs.pop("none")

    def over_none(run: dict) -> tuple[float, float]:
        layers = run["layers"]
        return ((run["step_s"] - none["step_s"]) / layers,
                (none["peak_above_weights_bytes"] - run["peak_above_weights_bytes"]) / layers)

    rows = []
    for how, run in runs.items():
        seconds, saved = over_none(run)
        rows.append(_row(gpu=gpu.name, work="recomputation a layer, over none", case=how, measured_ms=_ms(seconds),
                         saved_gb=f"{saved / 1e9:.2f}"))
    ours_s, ours_saved = over_none(runs["keep_every_matmul"])  # autopar's selective
    theirs_s, theirs_saved = over_none(runs["every_other_matmul"])  # torchtitan's op-level policy
    rows.append(_row(gpu=gpu.name, work=f"recomputation over D7's {D7_LAYERS} layers",
                     case="every_other_matmul over keep_every_matmul", measured_ms=_ms(D7_LAYERS * (theirs_s - ours_s)),
                     saved_gb=f"{D7_LAYERS * (theirs_saved - ours_saved) / 1e9:.1f}"))
    return rows


def run() -> list[dict]:
    efficiency = [read_records(MEASURED / f"{prefix}_efficiency.jsonl") for prefix in GPU_PREFIXES]
    if smoke():
        records, gpu = efficiency[0]
        return gemm_rows(cases([r for r in records if r["kind"] == "gemm"]), gpu)
    power = [read_records(MEASURED / f"{prefix}_power.jsonl") for prefix in GPU_PREFIXES]
    rows = [row for records, gpu in efficiency for row in gemm_rows([r for r in records if r["kind"] == "gemm"], gpu)]
    rows += [row for records, gpu in efficiency for row in attention_rows(records, gpu)]
    rows += [row for records, gpu in power for row in grid_rows(records, gpu)]
    rows += [row for records, gpu in efficiency for row in layer_rows(records, gpu)]
    return rows + recompute_rows()


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1))

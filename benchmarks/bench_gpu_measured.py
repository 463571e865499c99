"""Compiled plans measured on an H100 and an H200 beside today's cost model: one row per record of
benchmarks/measured/h100_plan_check.jsonl and h200_plan_check.jsonl (`benchmarks.gpu_plan_check`),
its pinned plan priced again as `autopar estimate` prices it (benchmarks/gpu_plan_compare.py).

    python -m benchmarks.run gpu_measured

`measured` says what a row's seconds are: a whole training step on one GPU, or one rank's compute
where that rank of a multi-GPU plan ran with the other ranks faked (collectives return at once),
priced as the estimate's compute, recomputation and optimizer. `generated_peak_gib` is what the
device held at the peak (the allocator's peak plus what it holds outside the allocator, the CUDA
context among it), what the cost model prices; the hand-written baseline (benchmarks/handwritten.py,
H200 records) reports the allocator's peak alone, so compare it with `generated_allocator_peak_gib`.
Errors are signed: negative where the cost model prices less than ran. The measured columns copy
the records; only the priced columns and the errors move when the cost model changes.
`held_out_time_error_pct`: a faked tensor-parallel rank (host-bound: DTensor's dispatch per split
module, cost_models/host.py) priced with that host cost refitted on the other such ranks, out of
sample; the last row gives the cost fitted on all of them. `host_ms_per_module`: what one such rank
alone implies (its seconds less the priced optimizer, per DTensor module and micro-batch).
`vs_handwritten_*_pct`: the generated module against the hand-written loop of the same plan (time,
and allocator peak), and against that loop with autocast kept as the generated module keeps it;
`vs_other_writing`: a model written another way (views by global sizes, fused q/k/v) against the
record of the same plan and GPU whose case name it extends.
"""
from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator, Mapping
from typing import Any

from benchmarks import cases
from benchmarks.gpu_plan_compare import (faked_rank, faked_tp_rank, held_out_host_s, model_path, plan_runs,
                                         predicted_compute_s, price_faked_tp_rank, priced_with_layout, rank_compute_s,
                                         traced)

GIB = 2**30
GPUS = {"NVIDIA H100 80GB HBM3": "H100", "NVIDIA H200": "H200"}


def _model_in_words(run: dict) -> str:
    """The model file, its size and its sequence length, e.g. `llama_hf.py 8.0B, 4096 tokens`."""
    _, cfg, profile = traced(run)
    return f"{model_path(run).name} {profile.param_count / 1e9:.1f}B, {cfg.model.seq_len} tokens"


def _pins_in_words(layout: Any) -> str:
    """The plan's pins that are not the default, e.g. `tp 8, SP, micro-batch 2×4, recompute none`."""
    degrees = [f"{axis} {getattr(layout, axis)}" for axis in ("dp", "tp", "pp", "cp") if getattr(layout, axis) > 1]
    parts = degrees or ["one GPU"]
    if layout.sequence_parallel:
        parts.append("SP")
    if layout.zero_stage:
        parts.append(f"ZeRO-{int(layout.zero_stage)}")
    parts.append(f"micro-batch {layout.micro_batch_size}×{layout.num_micro_batches}")
    options = layout.recompute.values() if isinstance(layout.recompute, Mapping) else [layout.recompute]
    parts.append("recompute " + "/".join(sorted({str(option) for option in options})))
    return ", ".join(parts)


def _error_pct(predicted: float, measured: float) -> float:
    return round(100 * (predicted / measured - 1), 1)


def _change_pct(value: float, base: float) -> str:
    return f"{_error_pct(value, base):+.1f}"


def _measured_s(run: dict) -> float:
    """A record's seconds: a faked rank's compute, or a whole step on one GPU."""
    return run["measured_compute_s"] if faked_rank(run) else run["measured_step_s"]


def _against_handwritten(run: dict, measured_s: float) -> dict:
    """The generated module's time and allocator peak against the hand-written loop's, plain and
    with autocast (where measured): negative where the generated module is faster or smaller."""
    if "handwritten_step_s" not in run:
        return {}
    peak = run["memory_detail"]["allocated_peak"]
    found = {"vs_handwritten_time_pct": _change_pct(measured_s, run["handwritten_step_s"]),
             "vs_handwritten_memory_pct": _change_pct(peak, run["handwritten_peak_bytes"])}
    autocast = run.get("handwritten_autocast")
    if autocast:
        found["vs_handwritten_autocast_time_pct"] = _change_pct(measured_s, autocast["handwritten_step_s"])
        found["vs_handwritten_autocast_peak_kib"] = f"{(peak - autocast['handwritten_peak_bytes']) / 1024:+.0f}"
    return found


def _against_other_writing(run: dict, records: list[dict], measured_s: float) -> str:
    """``run``'s time against the record whose case name it extends where that record ran the
    same plan on the same GPU with the model written another way (another model file), e.g.
    `h200_gpt1.3b_tp4 +14.5%`; empty where there is none."""
    bases = [other for other in records if run["case"].startswith(other["case"] + "_")
             and other["overrides"] == run["overrides"] and other["device"] == run["device"]
             and other["model"] != run["model"]]
    if not bases:
        return ""
    base = max(bases, key=lambda other: len(other["case"]))
    return f"{base['case']} {_change_pct(measured_s, _measured_s(base))}%"


def _host_ms_per_module(run: dict) -> str:
    """What one faked TP rank alone implies the host costs per DTensor module and micro-batch."""
    if not faked_tp_rank(run):
        return ""
    measured_s, optimizer_s, module_passes = price_faked_tp_rank(run)
    return f"{(measured_s - optimizer_s) / module_passes * 1e3:.2f}"


def _handwritten(run: dict) -> tuple[str, str]:
    """(step seconds, allocator peak GiB) of the hand-written baseline: the error's type where it
    failed, empty where the record has none."""
    if "handwritten_error" in run:
        return f"failed ({run['handwritten_error'].split(':')[0]})", ""
    if "handwritten_step_s" not in run:
        return "", ""
    return f"{run['handwritten_step_s']:.3f}", f"{run['handwritten_peak_bytes'] / GIB:.1f}"


@contextlib.contextmanager
def _host_cost(per_module_s: float) -> Iterator[None]:
    """Price with the host's per-module DTensor cost set to ``per_module_s`` (cost_models.host)."""
    import cost_models.host as host

    kept = host.DTENSOR_MODULE_HOST_S
    host.DTENSOR_MODULE_HOST_S = per_module_s
    try:
        yield
    finally:
        host.DTENSOR_MODULE_HOST_S = kept


def _held_out_error(run: dict, tp_runs: list[dict]) -> str:
    """A faked TP rank's error with the host's per-module cost refitted without it: out of sample."""
    if not faked_tp_rank(run) or len(tp_runs) < 2:
        return ""
    with _host_cost(held_out_host_s(run, tp_runs)):
        return f"{_error_pct(predicted_compute_s(run), run['measured_compute_s']):+.1f}"


def row(run: dict, tp_runs: list[dict], records: list[dict]) -> dict:
    """One record beside today's price of its pinned plan."""
    layout, estimate = priced_with_layout(run)
    rank = faked_rank(run)
    measured_s = _measured_s(run)
    priced_s = rank_compute_s(estimate) if rank else estimate.step_time_s
    handwritten_s, handwritten_peak = _handwritten(run)
    return {
        "gpu": GPUS.get(run["device"], run["device"]), "case": run["case"], "model": _model_in_words(run),
        "plan": _pins_in_words(layout),
        "measured": "rank compute, other ranks faked" if rank else "whole step, one GPU",
        "generated_s": f"{measured_s:.3f}", "generated_peak_gib": f"{run['measured_peak_bytes'] / GIB:.1f}",
        "generated_allocator_peak_gib": f"{run['memory_detail']['allocated_peak'] / GIB:.1f}",
        "handwritten_s": handwritten_s, "handwritten_allocator_peak_gib": handwritten_peak,
        "priced_s": f"{priced_s:.3f}", "priced_peak_gib": f"{estimate.peak_memory_bytes / GIB:.1f}",
        "time_error_pct": f"{_error_pct(priced_s, measured_s):+.1f}",
        "memory_error_pct": f"{_error_pct(estimate.peak_memory_bytes, run['measured_peak_bytes']):+.1f}",
        "held_out_time_error_pct": _held_out_error(run, tp_runs), "host_ms_per_module": _host_ms_per_module(run),
        **_against_handwritten(run, measured_s), "vs_other_writing": _against_other_writing(run, records, measured_s),
    }


def run() -> list[dict]:
    from cost_models.host import fit_per_module_s

    records = cases(plan_runs())
    tp_runs = [record for record in records if faked_tp_rank(record)]
    rows = [row(record, tp_runs, records) for record in records]
    if tp_runs:
        fitted = fit_per_module_s(price_faked_tp_rank(record) for record in tp_runs)
        held_out = [abs(float(r["held_out_time_error_pct"])) for r in rows if r["held_out_time_error_pct"]]
        rows.append({"gpu": "host cost per DTensor module and micro-batch, fitted on the faked TP ranks",
                     "case": f"{fitted * 1e3:.2f} ms", "model": f"{len(tp_runs)} runs",
                     "held_out_time_error_pct": f"median absolute error {statistics.median(held_out):.1f}%"})
    return rows


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1))

"""How fast one plan is priced: GPT-3 175B on 1024 A100-80GB (the planner prices thousands).

Target (cost-model issue): under 50 ms per estimate. The profile is traced once (~15 s); the
first estimate of a (profile, cluster) also solves the planner's tensor-parallel split of each
layer kind (autopar.solver.tp_split.ILPSplitter) and prices it once; every later estimate, of
any layout, reuses those.

    python -m benchmarks.bench_estimate
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from benchmarks import sized

REPO = Path(__file__).resolve().parent.parent
GPT3_175B = {"layers": 96, "hidden": 12288, "heads": 96, "seq_len": 2048, "vocab": 50257}
GLOBAL_BATCH = 1536


def layouts():
    """A spread of 1024-GPU plans: TP 8 inside a node, PP 8 or 16, ZeRO, recompute, schedules."""
    from cost_models import ParallelLayout

    result = []
    for pp in (8, 16):
        dp = 1024 // (8 * pp)
        for b in (1, 2):
            m = GLOBAL_BATCH // (dp * b)
            for zero in (0, 1):
                for recompute in ("none", "selective", "full"):
                    for schedule, chunks in (("1f1b", 1), ("interleaved_1f1b", 2), ("gpipe", 1)):
                        result.append(ParallelLayout(dp=dp, tp=8, pp=pp, micro_batch_size=b, num_micro_batches=m,
                                                     zero_stage=zero, recompute=recompute, schedule=schedule,
                                                     chunks=chunks, sequence_parallel=True))
    return result


def run() -> dict:
    from autopar.model_file import load_model_file
    from autopar.profile import profile_model
    from autopar.solver.tp_split import ILPSplitter
    from cost_models import ClusterConfig, ClusterSpec, TrainSpec, estimate

    start = time.perf_counter()
    profile = profile_model(load_model_file(REPO / "examples" / "gpt.py"), GPT3_175B, micro_batch_size=1,
                            precision="bf16")
    trace_s = time.perf_counter() - start
    cluster = ClusterSpec.from_config(ClusterConfig(name="dgx_a100_80g", gpu="A100-80GB", nodes=128, gpus_per_node=8,
                                                    inter_node_bandwidth_GBps=25, inter_node_latency_us=8))
    train = TrainSpec(global_batch_size=GLOBAL_BATCH, precision="bf16")
    plans = layouts()[:sized(len(layouts()), 2)]
    splitter = ILPSplitter(profile)
    start = time.perf_counter()
    first = estimate(profile, cluster, plans[0], train, splitter)
    first_s = time.perf_counter() - start
    times, results = [], []
    for layout in plans[1:]:
        start = time.perf_counter()
        results.append(estimate(profile, cluster, layout, train, splitter))
        times.append(time.perf_counter() - start)
    best = max(results + [first], key=lambda e: e.mfu if e.fits else 0.0)
    return {"case": "GPT-3 175B (96 layers), 1024 x A100-80GB, tp8 x pp8/16 x dp",
            "trace_s": round(trace_s, 1), "plans": len(plans), "first_estimate_ms": round(first_s * 1e3, 1),
            "median_estimate_ms": round(statistics.median(times) * 1e3, 2),
            "max_estimate_ms": round(max(times) * 1e3, 2), "target_ms": 50, "met": max(times) < 0.05,
            "first_plan_step_s": round(first.step_time_s, 2), "first_plan_mfu": round(first.mfu, 3),
            "best_fitting_mfu": round(best.mfu, 3)}


def markdown_row(result: dict) -> str:
    keys = ("case", "plans", "first_estimate_ms", "median_estimate_ms", "max_estimate_ms", "target_ms", "met",
            "first_plan_mfu", "best_fitting_mfu")
    return "| " + " | ".join(keys) + " |\n|" + "---|" * len(keys) + "\n| " + \
        " | ".join(str(result[k]) for k in keys) + " |"


if __name__ == "__main__":
    print(markdown_row(run()))

"""How fast one plan is priced: GPT-3 175B on 1024 A100-80GB (the planner prices thousands).

Target (cost-model issue): under 50 ms per estimate. The profile is traced once; the first
estimate also solves the operator-wise TP split of each layer kind (cached), so the steady
state is what the planner sees.

    python -m benchmarks.bench_estimate
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run() -> dict:
    from autopar.config import compose_config
    from autopar.driver import build_cluster, run_profile, train_spec
    from autopar.solver.tp_split import ILPSplitter
    from cost_models.step import ParallelLayout, PlanPricer

    cfg = compose_config(["model.layers=96", "model.hidden=12288", "model.heads=96", "model.seq_len=2048",
                          "model.vocab=50257", "cluster=dgx_a100_80g", "cluster.nodes=128",
                          "train.global_batch_size=1536"])
    profile = run_profile(REPO / "examples" / "gpt.py", cfg)
    pricer = PlanPricer(profile, build_cluster(cfg), train_spec(cfg), ILPSplitter(profile))
    layouts = [ParallelLayout(dp=16, tp=8, pp=8, micro_batch_size=b, num_micro_batches=1536 // (16 * b),
                              zero_stage=z, recompute=r, schedule="interleaved_1f1b", chunks=2)
               for b in (1, 2) for z in (0, 1) for r in ("none", "full")]
    start = time.perf_counter()
    first = pricer.estimate(layouts[0])
    first_s = time.perf_counter() - start
    times = []
    for layout in layouts[1:]:
        start = time.perf_counter()
        pricer.estimate(layout)
        times.append(time.perf_counter() - start)
    return {"case": "GPT-3 175B, 1024 A100-80GB, tp8 pp8 dp16 interleaved", "first_estimate_ms": round(first_s * 1e3, 1),
            "median_estimate_ms": round(statistics.median(times) * 1e3, 1), "max_estimate_ms": round(max(times) * 1e3, 1),
            "step_s": round(first.step_time_s, 2), "mfu": round(first.mfu, 3), "target": "< 50 ms",
            "met": max(times) < 0.05}


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))

"""Planner wall time end to end (trace + profile + search), on this machine.

Targets (planner issue): GPT-3 175B on 1024 A100-80GB (128 DGX nodes), global batch 1536, and
Llama-3-70B (seq 8192) on 512 H100 (64 nodes), each under 60 s with solver status OPTIMAL.

    python -m benchmarks.bench_planner
"""
from __future__ import annotations

import json
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CASES = [
    ("GPT-3 175B on 1024 A100-80GB", "gpt.py",
     ["model.layers=96", "model.hidden=12288", "model.heads=96", "model.seq_len=2048", "model.vocab=50257",
      "cluster=dgx_a100_80g", "cluster.nodes=128", "train.global_batch_size=1536"]),
    ("Llama-3-70B (seq 8192) on 512 H100", "llama_hf.py",
     ["model.layers=80", "model.hidden=8192", "model.heads=64", "model.kv_heads=8", "model.ffn=28672",
      "model.vocab=128256", "model.seq_len=8192", "cluster=dgx_h100", "cluster.nodes=64",
      "train.global_batch_size=512"]),
]


def run() -> list[dict]:
    from autopar.config import compose_config
    from autopar.driver import run_plan

    rows = []
    for name, example, overrides in CASES:
        start = time.perf_counter()
        result = run_plan(REPO / "examples" / example, compose_config(overrides))
        wall_s = time.perf_counter() - start
        plan = result.plan
        rows.append({"case": name, "wall_s": round(wall_s, 1), "solver_s": plan.solver.seconds,
                     "status": plan.solver.status, "candidates": plan.solver.candidates,
                     "plan": plan.summary(), "step_s": round(plan.predicted.step_time_s, 2),
                     "mfu": round(plan.predicted.mfu, 3),
                     "peak_GiB": round(plan.predicted.peak_memory_bytes / 2**30, 1),
                     "met": wall_s < 60 and plan.solver.status == "OPTIMAL"})
    return rows


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))

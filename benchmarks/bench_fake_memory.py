"""Per-rank memory of large plans: the cost model's prediction against one rank of the compiled
module measured on this CPU with fake tensors (autopar.runtime.fake_memory: torch's fake process
group for the other ranks, FakeTensorMode, FSDPMemTracker). Target: within 10% on the total.

Each case is planned and compiled (`autopar compile`) for its cluster, then rank 0 is measured:
the whole training step when the plan has one pipeline stage, else a micro-batch per stage
scaled by the schedule's in-flight micro-batches (see fake_memory's docstring). The CUDA context
(0.75 GiB in the prediction, no tensors) is left out of both totals.

    python -m benchmarks.bench_fake_memory          # prints a markdown table
    python -m benchmarks.run fake_memory             # the same, into benchmarks/results/latest.md
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

from benchmarks import smoke

REPO = Path(__file__).resolve().parent.parent
GiB = 2**30

LLAMA3_70B = ["model.layers=80", "model.hidden=8192", "model.heads=64", "model.kv_heads=8", "model.ffn=28672",
              "model.vocab=128256", "model.seq_len=8192"]
GPT3_175B = ["model.layers=96", "model.hidden=12288", "model.heads=96", "model.seq_len=2048", "model.vocab=50257"]
LLAMA3_8B = ["model.layers=32", "model.hidden=4096", "model.heads=32", "model.kv_heads=8", "model.ffn=14336",
             "model.vocab=128256", "model.seq_len=8192"]
CASES = [
    ("Llama-3-70B (seq 8192) on 512 H100", "llama_hf.py",
     [*LLAMA3_70B, "cluster=dgx_h100", "cluster.nodes=64", "train.global_batch_size=512"]),
    ("GPT-3 175B on 1024 A100-80GB", "gpt.py",
     [*GPT3_175B, "cluster=dgx_a100_80g", "cluster.nodes=128", "train.global_batch_size=1536"]),
    ("Llama-3-8B (seq 8192) on 64 H100", "llama_hf.py",
     [*LLAMA3_8B, "cluster=dgx_h100", "cluster.nodes=8", "train.global_batch_size=512"]),
]
# The smoke run's case (benchmarks/__init__.py): the 8B shape cut to 2 blocks on one node.
SMOKE_CASE = ("Llama-3-8B shape, 2 blocks, on 8 H100", "llama_hf.py",
              [*(item for item in LLAMA3_8B if not item.startswith("model.layers=")), "model.layers=2",
               "cluster=dgx_h100", "cluster.nodes=1", "train.global_batch_size=16"])
RANK = 0


def gib(nbytes: float) -> float:
    return round(nbytes / GiB, 2)


def measure_case(name: str, example: str, overrides: list[str], folder: Path) -> dict:
    """Compile one case into ``folder`` and check rank 0 against its prediction."""
    from autopar.config import compose_config
    from autopar.driver import run_compile
    from autopar.runtime.fake_memory import check_rank

    start = time.perf_counter()
    plan, _, _ = run_compile(REPO / "examples" / example, compose_config(overrides), folder)
    compiled_s = time.perf_counter() - start
    result = check_rank(folder, RANK)
    measured_s = time.perf_counter() - start - compiled_s
    worst = max((key for key in ("params", "grads", "optimizer", "activations", "buffers")
                 if result.error_pct[key] is not None),
                key=lambda key: abs(result.predicted[key] - result.measured[key]))
    return {"case": name, "plan": plan.summary(), "rank": RANK, "pp_rank": result.pp_rank,
            "predicted_GiB": gib(result.predicted["total"]), "measured_GiB": gib(result.measured["total"]),
            "error_pct": result.error_pct["total"], "within_10pct": abs(result.error_pct["total"]) <= 10,
            "activations_pred_meas_GiB": f"{gib(result.predicted['activations'])} / "
                                         f"{gib(result.measured['activations'])}",
            "states_pred_meas_GiB": " / ".join(str(gib(sum(r[k] for k in ("params", "grads", "optimizer"))))
                                               for r in (result.predicted, result.measured)),
            "buffers_pred_meas_GiB": f"{gib(result.predicted['buffers'])} / {gib(result.measured['buffers'])}",
            "largest_gap": worst, "measured": "whole step" if result.pp_rank == 0 and not result.in_flight
            else "stage micro-batch x in-flight", "compile_s": round(compiled_s, 1), "measure_s": round(measured_s, 1)}


def run() -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for index, (name, example, overrides) in enumerate([SMOKE_CASE] if smoke() else CASES):
            rows.append(measure_case(name, example, overrides, Path(scratch) / f"case{index}"))
    return rows


if __name__ == "__main__":
    from benchmarks.run import markdown_table

    print(markdown_table(run()))

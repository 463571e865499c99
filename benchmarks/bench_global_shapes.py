"""Step time of tensor parallelism on a GPT that views by global sizes (its regions keep DTensor
activations: autopar.solver.tp_global_shapes), and on one that also fuses q, k and v into one
projection cut by ``split`` (examples/gpt_fused.py: split as its parts, autopar.solver.tp_fused),
vs the same GPT written for shares (``view(b, s, -1, d)``: local tensors), tp=2 on 2 gloo CPU ranks.

Both plans are generated at the same size and run in the same 2 processes, one after the other,
each for STEPS steps; the median step time past the first WARMUP steps is compared. Where
today's local-tensor TP applies nothing changes (its generated module is the same as before
DTensor regions existed); this measures what the DTensor path costs where it is needed.

    python -m benchmarks.bench_global_shapes
"""
from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import torch

from autopar.codegen import generate
from autopar.runtime import read_records
from autopar.runtime.generated import import_generated
from benchmarks import sized
from tests.dist.equivalence import OPTIMIZER
from tests.dist.harness import run_ranks
from tests.dist.plans import REPO, TinyModel, make_planner

SIZE = dict(layers=2, hidden=256, heads=8, seq_len=128, vocab=1024)
STEPS, WARMUP = sized(12, 3), sized(2, 1)


def _model(name: str, path: Path) -> TinyModel:
    return TinyModel(name=name, path=path, kwargs=SIZE, prologue=["wte", "wpe"], container="blocks", blocks=2,
                     epilogue=["ln_f", "lm_head"])


def _run(rank: int, world_size: int, jobs: list[tuple[str, str]]) -> None:
    torch.set_num_threads(1)
    for name, (script, log_file) in jobs:
        module = import_generated(script, f"bench_{name}")
        module.main(["--steps", str(STEPS), "--seed", "0", "--log-file", log_file])


def run() -> list[dict]:
    """Median step time of each layout at tp=2 on 2 gloo ranks, and its ratio to local views."""
    models = {"local_views": _model("gpt", REPO / "examples" / "gpt.py"),
              "global_views": _model("gpt_global_shapes", REPO / "tests" / "dist" / "models" / "gpt_global_shapes.py"),
              "fused_global_views": _model("gpt_fused", REPO / "examples" / "gpt_fused.py")}
    rows = []
    with tempfile.TemporaryDirectory() as root:
        jobs = []
        for name, model in models.items():
            plan = make_planner(model, tp=2).run().plan
            files = generate(plan, model.path, Path(root) / name, optimizer=OPTIMIZER)
            rows.append({"layout": name, "dtensor_regions": len(plan.tp_dtensor_regions), "fused": len(plan.tp_fused),
                         "split_modules": f"{sum(s != 'replicate' for s in plan.tp_styles.values())} of "
                                          f"{len(plan.tp_styles)}"})
            jobs.append((name, (str(files.script), str(Path(root) / name / "run.jsonl"))))
        run_ranks(_run, 2, jobs, timeout_s=900)
        medians = {name: statistics.median(r["step_time_s"] for r in read_records(log)[WARMUP:])
                   for name, (_, log) in jobs}
    for row in rows:
        row["median_step_ms"] = round(medians[row["layout"]] * 1e3, 1)
        row["vs_local_views"] = round(medians[row["layout"]] / medians["local_views"], 3)
    return rows


def main() -> int:
    for row in run():
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())

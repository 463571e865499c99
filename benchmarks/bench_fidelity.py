"""Predicted vs measured step time of compiled plans on local gloo ranks, before and after the
cost model is refitted to the measurements (`autopar validate` + `autopar calibrate --from`).

Small GPT and Llama models are compiled with pinned degrees for 1, 2 and 4 ranks on the cpu_gloo
cluster (so the plans differ), each is validated (median of warm steps, profiler split of compute
and communication), and the cost model's correction factors are fitted per rank count (ranks
share this machine's cores, so a rank's compute speed depends on how many run). Reported per plan:
the catalogue prediction, the refitted one (fitted on all runs of its rank count) and a
leave-one-out one (fitted without that run: what a new plan would see); then the median absolute
error and the Spearman rank correlation of predicted vs measured step times.

    python -m benchmarks.bench_fidelity
"""
from __future__ import annotations

import json
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

from benchmarks import cases, sized

REPO = Path(__file__).resolve().parent.parent
GPT = ["model.layers=4", "model.hidden=256", "model.heads=4", "model.seq_len=128", "model.vocab=1024"]
LLAMA = ["model.layers=4", "model.hidden=256", "model.heads=4", "model.kv_heads=2", "model.ffn=688",
         "model.vocab=1024", "model.seq_len=128"]
# check=off: compile's numerical check (what the dist tests hold) is not what this measures, and
# it ran every plan a second time on these ranks before its validation run.
COMMON = ["cluster=cpu_gloo", "train.global_batch_size=8", "train.precision=fp32", "check=off"]
PLANS = [  # (name, model file, model overrides, ranks, pins)
    ("gpt mb8", "gpt.py", GPT, 1, ["plan.micro_batch_size=8"]),
    ("gpt mb2x4", "gpt.py", GPT, 1, ["plan.micro_batch_size=2"]),
    ("llama mb4x2", "llama_hf.py", LLAMA, 1, ["plan.micro_batch_size=4"]),
    ("gpt dp2", "gpt.py", GPT, 2, ["plan.dp=2", "plan.zero_stage=0", "plan.micro_batch_size=4"]),
    ("gpt tp2", "gpt.py", GPT, 2, ["plan.tp=2", "plan.micro_batch_size=8", "plan.sequence_parallel=false"]),
    ("gpt pp2", "gpt.py", GPT, 2, ["plan.pp=2", "plan.micro_batch_size=2", "plan.schedule=1f1b"]),
    ("llama dp2", "llama_hf.py", LLAMA, 2, ["plan.dp=2", "plan.zero_stage=0", "plan.micro_batch_size=4"]),
    ("llama tp2", "llama_hf.py", LLAMA, 2, ["plan.tp=2", "plan.micro_batch_size=4", "plan.sequence_parallel=false"]),
    ("gpt dp4", "gpt.py", GPT, 4, ["plan.dp=4", "plan.zero_stage=0", "plan.micro_batch_size=2"]),
    ("gpt zero3 dp4", "gpt.py", GPT, 4, ["plan.dp=4", "plan.zero_stage=3", "plan.micro_batch_size=2"]),
    ("gpt tp4", "gpt.py", GPT, 4, ["plan.tp=4", "plan.micro_batch_size=8", "plan.sequence_parallel=false"]),
    ("gpt dp2 tp2", "gpt.py", GPT, 4, ["plan.dp=2", "plan.tp=2", "plan.zero_stage=0", "plan.micro_batch_size=4",
                                       "plan.sequence_parallel=false"]),
    ("llama dp4", "llama_hf.py", LLAMA, 4, ["plan.dp=4", "plan.zero_stage=0", "plan.micro_batch_size=2"]),
    ("llama dp2 tp2", "llama_hf.py", LLAMA, 4, ["plan.dp=2", "plan.tp=2", "plan.zero_stage=0",
                                                "plan.micro_batch_size=4", "plan.sequence_parallel=false"]),
]
STEPS = sized(6, 3)


def repriced_step_s(plan, model_path: Path, profile: Path) -> float:
    """The plan priced again with the refitted hardware profile."""
    from autopar.report.rebuild import rebuild_report

    made_for = plan.provenance
    config = {**made_for.cluster_config, "hardware_profile": str(profile)}
    again = plan.with_updates(provenance=replace(made_for, cluster_config=config))
    return rebuild_report(again, model_path).estimate["step_time_s"]


def run() -> list[dict]:
    from autopar.config import compose_config
    from autopar.driver import run_compile
    from autopar.runtime.validate import validate
    from cost_models.feedback import fit_time_scale, spearman, write_profile

    work = Path(tempfile.mkdtemp(prefix="fidelity-"))
    runs = []
    for name, model, overrides, ranks, pins in cases(PLANS):
        cfg = compose_config([*COMMON, f"cluster.gpus_per_node={ranks}", *overrides, *pins])
        out = work / name.replace(" ", "_")
        plan, _, _ = run_compile(REPO / "examples" / model, cfg, out)
        result = json.loads(validate(out, steps=STEPS).to_json())
        runs.append({"name": name, "ranks": ranks, "plan": plan, "model": REPO / "examples" / model,
                     "validation": result})
    rows = []
    for entry in runs:
        same = [r for r in runs if r["ranks"] == entry["ranks"]]
        fitted = work / f"fit_{entry['ranks']}.yaml"
        write_profile(fit_time_scale([r["validation"] for r in same]), fitted)
        others = [r["validation"] for r in same if r is not entry]
        loo = work / f"loo_{entry['name'].replace(' ', '_')}.yaml"
        write_profile(fit_time_scale(others) if others else {}, loo)
        measured = entry["validation"]["summary"]["measured_step_time_s"]
        rows.append({"plan": entry["name"], "ranks": entry["ranks"], "measured_ms": measured * 1e3,
                     "catalogue_ms": entry["plan"].predicted.step_time_s * 1e3,
                     "refitted_ms": repriced_step_s(entry["plan"], entry["model"], fitted) * 1e3,
                     "leave_one_out_ms": repriced_step_s(entry["plan"], entry["model"], loo) * 1e3})
    for row in rows:
        for key in ("catalogue", "refitted", "leave_one_out"):
            row[f"{key}_err_pct"] = round(100 * (row[f"{key}_ms"] - row["measured_ms"]) / row["measured_ms"], 1)
        for key in ("measured_ms", "catalogue_ms", "refitted_ms", "leave_one_out_ms"):
            row[key] = round(row[key], 1)
    measured = [row["measured_ms"] for row in rows]
    summary = {"plan": "ALL", "ranks": "1/2/4"}
    for key in ("catalogue", "refitted", "leave_one_out"):
        summary[f"{key}_err_pct"] = round(statistics.median(abs(row[f"{key}_err_pct"]) for row in rows), 1)
        summary[f"{key}_ms"] = f"spearman {spearman([row[f'{key}_ms'] for row in rows], measured):.3f}"
    return rows + [summary]


if __name__ == "__main__":
    from benchmarks.run import markdown_table

    print(markdown_table(run()))

"""Compiled plans against a real GPU: step time and peak memory, predicted vs measured.

Two kinds of case, each a fully pinned plan (so the cost model prices exactly what runs):

* one-GPU plans (H100 preset, one GPU): `autopar validate` trains the generated module for a few
  steps and compares the median warm step and the device's peak memory with the prediction;
* one rank of an 8-GPU plan (pp = 1): rank 0 of the generated module runs on this GPU with
  torch's fake process group standing in for the other seven ranks (collectives return at once),
  so its peak memory is the real CUDA allocator's for that rank's shards and activations and its
  step time is the compute part alone.

Plans are compiled on any machine (`compile`, no GPU needed) and measured where the GPU is
(`measure`, which needs only this repository, torch, hydra-core and ortools). Each measured case
is one JSON line; benchmarks/measured/h100_plan_check.jsonl holds an H100's, and
tests/unit/test_cost_vs_gpu.py prices the same pins again and holds the cost model to them.

    python -m benchmarks.gpu_plan_check compile PLANS_DIR
    python -m benchmarks.gpu_plan_check measure PLANS_DIR > h100_plan_check.jsonl
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

ONE_H100 = ["cluster=dgx_h100", "cluster.nodes=1", "cluster.gpus_per_node=1", "plan.dp=1", "plan.tp=1", "plan.pp=1",
            "plan.cp=1", "plan.zero_stage=0"]
EIGHT_H100 = ["cluster=dgx_h100", "cluster.nodes=1", "plan.pp=1", "plan.cp=1"]
GPT_1_3B = ["model.layers=24", "model.hidden=2048", "model.heads=16", "model.seq_len=2048", "model.vocab=50304"]
GPT_6_7B = ["model.layers=32", "model.hidden=4096", "model.heads=32", "model.seq_len=2048", "model.vocab=50304"]
LLAMA_1B = ["model.layers=16", "model.hidden=2048", "model.heads=16", "model.kv_heads=4", "model.ffn=5632",
            "model.vocab=32000", "model.seq_len=2048"]
LLAMA3_8B = ["model.layers=32", "model.hidden=4096", "model.heads=32", "model.kv_heads=8", "model.ffn=14336",
             "model.vocab=128256", "model.seq_len=4096"]


def _one_gpu(micro: int, recompute: str) -> list[str]:
    return [*ONE_H100, "train.global_batch_size=16", f"plan.micro_batch_size={micro}", f"plan.recompute={recompute}"]


CASES = {  # name: (model file, overrides); every decision pinned
    "gpt1.3b_mb1": ("gpt.py", [*GPT_1_3B, *_one_gpu(1, "none")]),
    "gpt1.3b_mb2": ("gpt.py", [*GPT_1_3B, *_one_gpu(2, "none")]),
    "gpt1.3b_mb4": ("gpt.py", [*GPT_1_3B, *_one_gpu(4, "none")]),
    "gpt1.3b_mb8": ("gpt.py", [*GPT_1_3B, *_one_gpu(8, "none")]),
    "gpt1.3b_mb8_full": ("gpt.py", [*GPT_1_3B, *_one_gpu(8, "full")]),
    "gpt1.3b_mb16_selective": ("gpt.py", [*GPT_1_3B, *_one_gpu(16, "selective")]),
    "llama1b_mb4": ("llama_hf.py", [*LLAMA_1B, *_one_gpu(4, "none")]),
    "llama1b_mb8_full": ("llama_hf.py", [*LLAMA_1B, *_one_gpu(8, "full")]),
    "llama3_8b_tp8_sp": ("llama_hf.py", [*LLAMA3_8B, *EIGHT_H100, "train.global_batch_size=16", "plan.dp=1",
                                         "plan.tp=8", "plan.sequence_parallel=true", "plan.micro_batch_size=2",
                                         "plan.recompute=none"]),
    "llama3_8b_zero3_dp8": ("llama_hf.py", [*LLAMA3_8B, *EIGHT_H100, "train.global_batch_size=16", "plan.dp=8",
                                            "plan.tp=1", "plan.zero_stage=3", "plan.micro_batch_size=1",
                                            "plan.recompute=selective"]),
    "gpt6.7b_dp2_tp4_sp_zero1": ("gpt.py", [*GPT_6_7B, *EIGHT_H100, "train.global_batch_size=16", "plan.dp=2",
                                            "plan.tp=4", "plan.sequence_parallel=true", "plan.zero_stage=1",
                                            "plan.micro_batch_size=2", "plan.recompute=none"]),
}

# Plans measured beside the same plan written by hand (benchmarks/handwritten.py), on an H200 with
# its own preset; the tp=4 GPT three ways (heads viewed by shares, by global sizes through DTensor
# regions, and q/k/v fused then split) to show what TP on models as people write them costs.
ONE_H200 = ["cluster=hgx_h200", *ONE_H100[1:]]


def _faked_h200(gpus: int, tp: int, global_batch: int, micro: int) -> list[str]:
    return ["cluster=hgx_h200", "cluster.nodes=1", f"cluster.gpus_per_node={gpus}", "plan.pp=1", "plan.cp=1",
            f"plan.dp={gpus // tp}", f"plan.tp={tp}", "plan.sequence_parallel=false", "plan.zero_stage=0",
            f"train.global_batch_size={global_batch}", f"plan.micro_batch_size={micro}", "plan.recompute=none"]


GPT_TP4 = [*GPT_1_3B, *_faked_h200(4, 4, 16, 4)]
BASELINE_CASES = {
    "h200_gpt1.3b_mb4": ("examples/gpt.py", [*GPT_1_3B, *ONE_H200, "train.global_batch_size=16",
                                             "plan.micro_batch_size=4", "plan.recompute=none"]),
    "h200_llama1b_mb4": ("examples/llama_hf.py", [*LLAMA_1B, *ONE_H200, "train.global_batch_size=16",
                                                  "plan.micro_batch_size=4", "plan.recompute=none"]),
    "h200_gpt1.3b_tp4": ("examples/gpt.py", GPT_TP4),
    "h200_gpt1.3b_tp4_global_views": ("tests/dist/models/gpt_global_shapes.py", GPT_TP4),
    "h200_gpt1.3b_tp4_fused_qkv": ("examples/gpt_fused.py", GPT_TP4),
    "h200_llama3_8b_tp8": ("examples/llama_hf.py", [*LLAMA3_8B, *_faked_h200(8, 8, 8, 2)]),
    "h200_llama1b_tp8_kv_groups": ("examples/llama_hf.py", [*LLAMA_1B, *_faked_h200(8, 8, 16, 4)]),
    # torchtitan's Llama-3.1-8B FSDP run (runs.yaml D7-8B-fsdp8) as one of its eight ranks
    "h200_llama3.1_8b_d7_fsdp8": ("examples/llama_hf.py", [
        *LLAMA3_8B[:-1], "model.seq_len=8192",
        *[pin for pin in _faked_h200(8, 1, 16, 2) if not pin.startswith(("plan.zero_stage", "plan.recompute"))],
        "plan.zero_stage=3", "plan.recompute=selective"]),
}
STEPS = 5


def _case(name: str) -> tuple[Path, list[str]]:
    """A case's model file and overrides (CASES name files in examples/, BASELINE_CASES by repository path)."""
    if name in CASES:
        return REPO / "examples" / CASES[name][0], CASES[name][1]
    return REPO / BASELINE_CASES[name][0], BASELINE_CASES[name][1]


def compile_cases(folder: Path, names: list[str]) -> None:
    from autopar.config import compose_config
    from autopar.driver import run_compile

    for name in names or CASES:
        path, overrides = _case(name)
        if (folder / name / "plan.json").exists():
            continue
        plan, _, _ = run_compile(path, compose_config(overrides), folder / name)
        print(f"{name}: {plan.summary()}  predicted {plan.predicted.step_time_s * 1e3:.1f} ms, "
              f"{plan.predicted.peak_memory_bytes / 2**30:.2f} GiB", flush=True)


def predicted_compute_s(plan: dict) -> float:
    """The parts of a step a faked rank still runs (its collectives return at once)."""
    return sum(plan["predicted"]["time_breakdown"].get(part, 0.0) for part in ("compute", "recompute", "optimizer"))


def measure_one_gpu(folder: Path) -> dict:
    from autopar.runtime.validate import validate

    result = validate(folder, steps=STEPS)
    rank = result.ranks[0]
    return {"measured_step_s": rank.measured["step_time_s"], "measured_peak_bytes": rank.measured["peak_memory_bytes"],
            "predicted_step_s": rank.predicted["step_time_s"],
            "predicted_peak_bytes": rank.predicted["peak_memory_bytes"],
            "memory_detail": json.loads((folder / "measure" / "rank_0.json").read_text())["memory_breakdown"]}


def train_faked_rank(folder: Path, steps: int) -> list[dict]:
    """Rank 0 of ``folder``'s plan trained on this GPU for ``steps`` steps, the other ranks faked."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopar.runtime.generated import command_line, import_generated

    plan = json.loads((folder / "plan.json").read_text())
    world_size = plan["dp"] * plan["tp"] * plan["pp"] * plan["cp"]
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        generated = import_generated(next(folder.glob("parallel_*.py")), f"faked_{folder.name.replace('.', '_')}")
        return generated.train(generated.train_config(generated.PLAN, command_line(generated, steps=steps)),
                               generated.parallel_config(generated.PLAN), generated.tp_plan)
    finally:
        dist.destroy_process_group()


def profile_faked_rank(folder: Path, names: list[str]) -> None:
    """Where a faked rank's step goes, for the generated module and for the same plan by hand:
    GPU kernel time vs wall time (a host-bound step shows a GPU idle most of the time), and the
    ops costing most GPU time (which casts and copies)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks import handwritten

    runs = {"generated": lambda path: train_faked_rank(path, 3),
            "handwritten": lambda path: handwritten.measure(path, 3)}
    for name in names:
        for how, run in runs.items():
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run(folder / name)
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            gpu_s = sum(e.device_time for e in kernels) / 1e6
            print(json.dumps({"case": name, "how": how, "gpu_kernel_s_3_steps": round(gpu_s, 3),
                              "kernels": len(kernels)}),
                  flush=True)
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=40),
                  flush=True)
            torch.cuda.empty_cache()


def measure_faked_rank(folder: Path) -> dict:
    """Rank 0 of an N-GPU plan on this GPU, the other ranks faked."""
    import torch

    from autopar.runtime.measure import cuda_peak

    plan = json.loads((folder / "plan.json").read_text())
    records = train_faked_rank(folder, STEPS)
    memory = cuda_peak(torch.device("cuda", torch.cuda.current_device()))
    warm = [record["step_time_s"] for record in records[2:]]
    return {"measured_compute_s": statistics.median(warm), "predicted_compute_s": predicted_compute_s(plan),
            "measured_peak_bytes": memory["peak_memory_bytes"],
            "predicted_peak_bytes": plan["predicted"]["peak_memory_bytes"],
            "memory_detail": memory["memory_breakdown"]}


def measure_cases(folder: Path, names: list[str]) -> None:
    import gc

    import torch

    from benchmarks import handwritten

    for name in names or CASES:
        plan = json.loads((folder / name / "plan.json").read_text())
        path, overrides = _case(name)
        record = {"case": name, "model": path.name, "overrides": overrides, "device": torch.cuda.get_device_name(),
                  "torch": torch.__version__}
        try:
            faked = plan["dp"] * plan["tp"] * plan["pp"] * plan["cp"] > 1
            record.update(measure_faked_rank(folder / name) if faked else measure_one_gpu(folder / name))
            record["memory_error_pct"] = round(
                100 * (record["predicted_peak_bytes"] / record["measured_peak_bytes"] - 1), 1)
            time_key = "compute_s" if faked else "step_s"
            record["time_error_pct"] = round(
                100 * (record[f"predicted_{time_key}"] / record[f"measured_{time_key}"] - 1), 1)
        except Exception as err:  # one failing case must not hide the others' numbers
            record["error"] = f"{type(err).__name__}: {err}"[:2000]
        gc.collect()
        torch.cuda.empty_cache()
        if name in BASELINE_CASES:
            try:
                record.update(handwritten.measure(folder / name, STEPS))
            except Exception as err:
                record["handwritten_error"] = f"{type(err).__name__}: {err}"[:2000]
        print(json.dumps(record), flush=True)
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    verb, target, *chosen = sys.argv[1:]
    {"compile": compile_cases, "measure": measure_cases, "profile": profile_faked_rank}[verb](Path(target), chosen)

"""The compute model against real H100 measurements committed in benchmarks/measured/.

Those runs (benchmarks/gpu_profile_check.py on one H100) timed forward + backward of GPT and
Hugging Face Llama configurations; the cost model, from the datasheet peak, its default
efficiencies and the per-op launch cost, must predict each within 15%.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cost_models.compute import ComputeModel
from cost_models.hardware import get_gpu
from tests.profiles import traced

MEASURED = Path(__file__).resolve().parents[2] / "benchmarks" / "measured" / "h100_profile_check.jsonl"
RUNS = [row for row in map(json.loads, MEASURED.read_text().splitlines()) if "model" in row]


@pytest.mark.parametrize("run", RUNS, ids=[f"{r['model']}-b{r['micro_batch']}-h{r['kwargs']['hidden']}" for r in RUNS])
def test_forward_backward_time_within_15_percent_of_h100(run):
    profile = traced(run["model"], "bf16", run["micro_batch"], **run["kwargs"])
    gpu = get_gpu("H100-SXM")
    compute = ComputeModel(profile)
    predicted = sum(compute.layer(layer.name, gpu).time_s(1.0, gpu.launch_overhead_s) for layer in profile.layers)
    assert predicted == pytest.approx(run["fwd_bwd_s"], rel=0.15)


@pytest.mark.parametrize("run", [r for r in RUNS if r["model"] == "gpt.py"],
                         ids=lambda r: f"b{r['micro_batch']}-h{r['kwargs']['hidden']}")
def test_saved_activation_bytes_match_cuda_allocator(run):
    """What the profile says autograd saves equals what CUDA's allocator held (within 0.1%)."""
    # The same trace as the timing test's for this run (traced once per session).
    profile = traced(run["model"], "bf16", run["micro_batch"], **run["kwargs"])
    assert profile.activation_bytes == pytest.approx(run["measured_activation_bytes"], rel=1e-3)


# Compiled plans measured on an H100 (benchmarks/gpu_plan_check.py): every decision pinned, so the
# cost model prices exactly what ran. One-GPU plans trained for real; 8-GPU plans as rank 0 with
# the other ranks faked (their step time is compute alone, so only their memory is held here).
PLAN_RUNS = [json.loads(line) for line in (MEASURED.parent / "h100_plan_check.jsonl").read_text().splitlines()]


# Profiles by what `autopar.driver.run_profile` traces from (model file, its settings, micro-batch,
# precision, pinned blocks): the runs of one model differ only in plan.* pins, which the trace
# does not see, so each 1-8B model is traced once per session instead of once per run.
_PROFILES: dict[tuple, object] = {}


def _priced(examples_dir, run):
    from omegaconf import OmegaConf

    from autopar.config import compose_config
    from autopar.driver import model_kwargs, run_estimate, run_profile

    path, cfg = examples_dir / run["model"], compose_config(run["overrides"])
    key = (path, tuple(sorted(model_kwargs(cfg).items())), cfg.train.micro_batch_size, cfg.train.precision,
           str(OmegaConf.select(cfg, "plan.blocks", default=None)))
    if key not in _PROFILES:
        _PROFILES[key] = run_profile(path, cfg)
    return run_estimate(path, cfg, profile=_PROFILES[key])[2]


# Plans whose precision the profile sees as it runs: FSDP's bf16 weights, and a loss the model
# computes in fp32 itself (Llama's logits.float()). GPT's F.cross_entropy on bf16 logits runs in
# fp32 under CUDA's autocast, which a CPU trace cannot see (the cost model is 6-20% low there).
FSDP_FP32_LOSS = ["llama1b_mb4", "llama1b_mb8_full", "llama3_8b_tp8_sp", "llama3_8b_zero3_dp8"]


@pytest.mark.parametrize("case", FSDP_FP32_LOSS)
def test_plan_peak_memory_within_7_percent_of_h100(examples_dir, case):
    run = next(r for r in PLAN_RUNS if r["case"] == case)
    assert _priced(examples_dir, run).peak_memory_bytes == pytest.approx(run["measured_peak_bytes"], rel=0.07)


@pytest.mark.parametrize("model", ["gpt.py", "llama_hf.py"])
def test_one_gpu_plans_ordered_as_an_h100_ran_them(examples_dir, model):
    """Among one model's micro-batch / recomputation choices on one GPU, the plan the cost model
    prices fastest is the one that ran fastest, and the order agrees (Spearman >= 0.8)."""
    from cost_models.feedback import spearman

    runs = [r for r in PLAN_RUNS if r["model"] == model and "measured_step_s" in r]
    predicted = [_priced(examples_dir, run).step_time_s for run in runs]
    measured = [run["measured_step_s"] for run in runs]
    assert predicted.index(min(predicted)) == measured.index(min(measured))
    assert spearman(predicted, measured) >= 0.8

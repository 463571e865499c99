"""The compute model against real H100 measurements committed in benchmarks/measured/.

Those runs (benchmarks/gpu_profile_check.py on one H100) timed forward + backward of GPT and
Hugging Face Llama configurations; the cost model, from the datasheet peak, its default
efficiencies and the per-op launch cost, must predict each within 15%.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopar.model_file import load_model_file
from autopar.profile import profile_model
from cost_models.compute import ComputeModel
from cost_models.hardware import get_gpu

MEASURED = Path(__file__).resolve().parents[2] / "benchmarks" / "measured" / "h100_profile_check.jsonl"
RUNS = [row for row in map(json.loads, MEASURED.read_text().splitlines()) if "model" in row]


@pytest.mark.parametrize("run", RUNS, ids=[f"{r['model']}-b{r['micro_batch']}-h{r['kwargs']['hidden']}" for r in RUNS])
def test_forward_backward_time_within_15_percent_of_h100(examples_dir, run):
    profile = profile_model(load_model_file(examples_dir / run["model"]), run["kwargs"], run["micro_batch"], "bf16")
    gpu = get_gpu("H100-SXM")
    compute = ComputeModel(profile)
    predicted = sum(compute.layer(layer.name, gpu).time_s(1.0, gpu.launch_overhead_s) for layer in profile.layers)
    assert predicted == pytest.approx(run["fwd_bwd_s"], rel=0.15)


@pytest.mark.parametrize("run", [r for r in RUNS if r["model"] == "gpt.py"],
                         ids=lambda r: f"b{r['micro_batch']}-h{r['kwargs']['hidden']}")
def test_saved_activation_bytes_match_cuda_allocator(examples_dir, run):
    """What the profile says autograd saves equals what CUDA's allocator held (within 0.1%)."""
    profile = profile_model(load_model_file(examples_dir / run["model"]), run["kwargs"], run["micro_batch"], "bf16")
    assert profile.activation_bytes == pytest.approx(run["measured_activation_bytes"], rel=1e-3)

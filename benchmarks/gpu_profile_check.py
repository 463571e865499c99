"""Profile predictions against a real GPU: saved-activation bytes and achieved FLOP/s.

For each configuration the model is profiled on fake tensors (CPU, as autopar plans) and then
trained for real on the GPU in bf16: the memory held between the end of forward and the start
of backward is what autograd saved (the profile's `activation_bytes`), and FLOPs / measured
forward+backward time is the achieved throughput the cost model's efficiency factors describe.
Needs a CUDA GPU; prints one JSON record per configuration.

    python -m benchmarks.gpu_profile_check
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from autopar.model_file import call_model, compute_loss, load_model_file  # noqa: E402
from autopar.profile import profile_model  # noqa: E402

CONFIGS = [
    ("gpt.py", {"layers": 4, "hidden": 2048, "heads": 16, "seq_len": 2048, "vocab": 50304}, 1),
    ("gpt.py", {"layers": 4, "hidden": 2048, "heads": 16, "seq_len": 2048, "vocab": 50304}, 4),
    ("gpt.py", {"layers": 8, "hidden": 4096, "heads": 32, "seq_len": 2048, "vocab": 50304}, 2),
    ("llama_hf.py", {"layers": 4, "hidden": 2048, "heads": 16, "kv_heads": 4, "ffn": 5632, "vocab": 32000,
                     "seq_len": 2048}, 1),
    ("llama_hf.py", {"layers": 4, "hidden": 2048, "heads": 16, "kv_heads": 4, "ffn": 5632, "vocab": 32000,
                     "seq_len": 2048}, 4),
]


def measure(example: str, kwargs: dict, batch_size: int, steps: int = 5) -> dict:
    model_file = load_model_file(REPO / "examples" / example)
    profile = profile_model(model_file, kwargs, micro_batch_size=batch_size, precision="bf16")
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = model_file.build_model(**kwargs)
        batch = model_file.example_batch(batch_size, **{k: kwargs[k] for k in ("seq_len", "vocab") if k in kwargs})
    torch.set_default_dtype(previous)
    batch = {k: v.cuda() for k, v in batch.items()} if isinstance(batch, dict) else batch
    saved, times = [], []
    for step in range(steps):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        loss = compute_loss(model_file, call_model(model, batch), batch)
        torch.cuda.synchronize()
        saved.append(torch.cuda.memory_allocated() - before)
        loss.backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    warm = sorted(times[1:])
    step_s = warm[len(warm) // 2]
    measured_saved = min(saved[1:])
    return {"model": example, "kwargs": kwargs, "micro_batch": batch_size,
            "predicted_activation_bytes": profile.activation_bytes, "measured_activation_bytes": measured_saved,
            "activation_error": round(profile.activation_bytes / measured_saved - 1, 4),
            "flops": profile.flops_total, "fwd_bwd_s": round(step_s, 5),
            "achieved_tflops": round(profile.flops_total / step_s / 1e12, 1)}


def matmul_tflops(n: int = 8192, repeats: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


if __name__ == "__main__":
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "matmul_bf16_tflops_8192": round(matmul_tflops(), 1)}), flush=True)
    for example, kwargs, batch_size in CONFIGS:
        print(json.dumps(measure(example, kwargs, batch_size)), flush=True)

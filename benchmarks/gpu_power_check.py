"""What a Hopper GPU draws and how fast it clocks under training work, and how fused attention's
speed depends on the work it is given: readings for the cost model's account of power-capped
GPUs and of attention efficiency. Reads the GPU's sensors through nvidia-smi and changes no
setting.

* ``power``: board power and SM clock sampled while the GPU idles, runs a dense bf16 GEMM, streams
  memory, and trains a Llama-3.1-8B decoder stack (examples/llama_hf.py, 2 x 8192 tokens) back to
  back for a few seconds each;
* ``attention``: causal SDPA forward + backward over a grid of batch x heads and sequence lengths.

    python -m benchmarks.gpu_power_check > h200_power.jsonl
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
QUERY = "power.draw,clocks.sm,clocks.mem,temperature.gpu"


class Sensors:
    """nvidia-smi readings every ``period`` seconds on a thread, while a block of work runs."""

    def __init__(self, period: float = 0.25):
        self.period, self.samples, self._stop = period, [], threading.Event()

    def _read(self) -> None:
        while not self._stop.is_set():
            text = subprocess.run(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True).stdout.split("\n")[0]
            try:
                self.samples.append([float(value) for value in text.split(",")])
            except ValueError:
                pass
            time.sleep(self.period)

    def __enter__(self) -> "Sensors":
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        steady = self.samples[len(self.samples) // 3:] or self.samples  # past the first third: settled
        columns = zip(*steady) if steady else [[], [], [], []]
        names = ("power_W", "sm_MHz", "mem_MHz", "temperature_C")
        return {name: round(statistics.median(values), 1) for name, values in zip(names, columns) if values}


def _for_seconds(work, seconds: float) -> int:
    import torch

    done, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        work()
        done += 1
        if done % 4 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return done


def _sustained(work, seconds: float) -> tuple[dict, float]:
    """Sensor medians while ``work`` runs back to back for ``seconds`` (after a second's warm-up),
    and the runs per second."""
    _for_seconds(work, 1.0)
    with Sensors() as sensors:
        start = time.perf_counter()
        count = _for_seconds(work, seconds)
        rate = count / (time.perf_counter() - start)
    return sensors.summary(), rate


def _gemm(seconds: float) -> dict:
    import torch

    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sensors, rate = _sustained(lambda: a @ b, seconds)
    return {"kind": "power", "work": "gemm_bf16_8192", "tflops": 2 * 8192**3 * rate / 1e12, **sensors}


def _copy(seconds: float) -> dict:
    import torch

    source = torch.empty(2**30, device="cuda", dtype=torch.uint8)
    target = torch.empty_like(source)
    sensors, rate = _sustained(lambda: target.copy_(source), seconds)
    return {"kind": "power", "work": "copy_1GiB", "GBps": 2 * 2**30 * rate / 1e9, **sensors}


def _train(seconds: float) -> dict:
    import torch

    from benchmarks.gpu_efficiency_check import RUNS, _model_case

    shape = next(run for run in RUNS if run.run == "D7-8B")
    module, model, batch = _model_case(shape, 3, torch.device("cuda"))
    model = model.to(torch.bfloat16)
    batch = {key: value.cuda() for key, value in batch.items()}
    inputs = {key: value for key, value in batch.items() if key not in ("labels", "targets")}

    def step():
        module.loss_fn(model(**inputs), batch).backward()
        model.zero_grad(set_to_none=True)

    sensors, rate = _sustained(step, seconds)
    return {"kind": "power", "work": "llama3.1_8b_3_layers_train", "step_s": 1 / rate, **sensors}


def power_records(seconds: float) -> list[dict]:
    import torch

    with Sensors() as idle:
        time.sleep(2.0)
    records = [{"kind": "power", "work": "idle", **idle.summary()}]
    for measure in (_gemm, _copy, _train):
        records.append(measure(seconds))
        torch.cuda.empty_cache()
    return records


def attention_records() -> list[dict]:
    import torch
    import torch.nn.functional as F

    from benchmarks.gpu_efficiency_check import HEAD_DIM, Timer

    timer, records = Timer(torch.device("cuda")), []
    for seq in (2048, 4096, 8192):
        for batch, heads in ((1, 8), (1, 16), (1, 32), (2, 32), (4, 32)):
            q, k, v = (torch.randn(batch, heads, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            grad = torch.randn_like(q)
            seconds = timer(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad))
            causal_flops = 3.5 * 4 * batch * heads * seq**2 * HEAD_DIM / 2
            records.append({"kind": "attention_grid", "batch": batch, "heads": heads, "seq": seq,
                            "forward_backward_s": seconds, "causal_tflops": causal_flops / seconds / 1e12})
    return records


if __name__ == "__main__":
    import torch

    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 8.0
    header = {"kind": "device", "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    print(json.dumps(header), flush=True)
    for record in [*attention_records(), *power_records(seconds)]:
        print(json.dumps(record), flush=True)

"""Predicted vs measured step time of data-parallel GPT training on local gloo ranks.

Calibrates this machine (`autopar calibrate`), prices plans with the calibrated cpu_gloo
cluster, then trains the same configurations for real with torch DDP (one thread per rank, as
calibrated) and reports both side by side with the error.

    python -m benchmarks.bench_cpu_fidelity
"""
from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
GPT = {"layers": 4, "hidden": 256, "heads": 4, "seq_len": 128, "vocab": 1024}
GLOBAL_BATCH = 8
PLANS = [  # (ranks, ZeRO stage)
    (1, 0), (2, 0), (4, 0),
]
STEPS = 6


def _train(rank: int, ranks: int, port: int, queue) -> None:
    try:
        _train_steps(rank, ranks, port, queue)
    except Exception as err:  # noqa: BLE001 - reported to the parent instead of hanging it
        queue.put(f"rank {rank}: {type(err).__name__}: {err}")


def _train_steps(rank: int, ranks: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from autopar.model_file import call_model, compute_loss, load_model_file

    model_file = load_model_file(REPO / "examples" / "gpt.py")
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    torch.manual_seed(0)
    model = model_file.build_model(**GPT)
    if ranks > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = model_file.example_batch(GLOBAL_BATCH // ranks, seq_len=GPT["seq_len"], vocab=GPT["vocab"])
    times = []
    for _ in range(STEPS):
        dist.barrier()
        start = time.perf_counter()
        loss = compute_loss(model_file, call_model(model, batch), batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    if rank == 0:
        queue.put(statistics.median(times[1:]))
    dist.destroy_process_group()


def measure(ranks: int) -> float:
    context = mp.get_context("spawn")
    queue = context.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    workers = [context.Process(target=_train, args=(rank, ranks, port, queue)) for rank in range(ranks)]
    for worker in workers:
        worker.start()
    seconds = queue.get(timeout=300)
    for worker in workers:
        worker.join(timeout=60)
    if isinstance(seconds, str):
        raise RuntimeError(seconds)
    return seconds


def run() -> list[dict]:
    from autopar.config import compose_config
    from autopar.driver import run_estimate
    from cost_models.calibrate import calibrate

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hw = Path(tmp) / "hw.yaml"
        calibrate(hw, ranks=2, ranks_per_node=2)  # one thread per rank on this 2-core host
        for ranks, zero in PLANS:
            overrides = [f"model.{k}={v}" for k, v in GPT.items()] + [
                "cluster=calibrated", f"cluster.hardware_profile={hw}", f"cluster.gpus_per_node={ranks}",
                "train.precision=fp32", f"train.global_batch_size={GLOBAL_BATCH}", f"train.micro_batch_size={GLOBAL_BATCH // ranks}",
                f"plan.dp={ranks}", f"plan.zero_stage={zero}", f"plan.micro_batch_size={GLOBAL_BATCH // ranks}"]
            _, _, estimate = run_estimate(REPO / "examples" / "gpt.py", compose_config(overrides))
            measured = measure(ranks)
            rows.append({"plan": f"DP {ranks} (ZeRO-{zero}), GPT 4x256, batch {GLOBAL_BATCH}",
                         "predicted_s": round(estimate.step_time_s, 4), "measured_s": round(measured, 4),
                         "error": f"{estimate.step_time_s / measured - 1:+.0%}"})
    return rows


if __name__ == "__main__":
    from benchmarks.run import markdown_table

    print(markdown_table(run()))

"""Measure this machine into a hardware profile the cost model loads.

GEMM throughput (fp32 on CPU, bf16 on CUDA) sets the GPU entry's peak and efficiency; an
all-reduce timed at several sizes over 2 local ranks (gloo on CPU, NCCL on GPUs) is fitted to
t = α_fit + S / B_fit (`fit_all_reduce`), and converted to the ring model's per-message latency
α = α_fit / (2(n-1)) and link bandwidth B = B_fit · 2(n-1)/n (nccl-tests' busbw). The result
is a YAML file for `cluster.hardware_profile` (the `calibrated` cluster preset).

    autopar calibrate --out hw.yaml
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

SIZES_BYTES = (2**12, 2**16, 2**20, 2**22, 2**24)


@dataclass(frozen=True)
class LinkFit:
    """Ring all-reduce parameters fitted from measurements."""

    latency_s: float
    bandwidth_Bps: float


def measure_gemm_flops(n: int = 1024, repeats: int = 5, device: str = "cpu") -> float:
    """Achieved FLOP/s of an n×n×n matrix product (median of repeats after a warm-up)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * n**3 / sorted(times)[len(times) // 2]


def fit_all_reduce(samples: list[tuple[float, float]], ranks: int) -> LinkFit:
    """t = a + S·c: the slope from the two largest messages (bandwidth-dominated), the
    intercept from the smallest (latency-dominated), then the ring model's α and B. An
    unweighted least-squares fit would let the large messages' noise swamp the latency."""
    ordered = sorted(samples)
    (s1, t1), (s2, t2) = ordered[-2], ordered[-1]
    slope = max((t2 - t1) / (s2 - s1), 1e-30)
    intercept = max(0.0, ordered[0][1] - slope * ordered[0][0])
    factor = 2 * (ranks - 1) / ranks
    return LinkFit(latency_s=intercept / (2 * (ranks - 1)), bandwidth_Bps=factor / slope)


def measure_all_reduce(ranks: int = 2, sizes: tuple[int, ...] = SIZES_BYTES, repeats: int = 5) -> list[tuple[float, float]]:
    """(bytes, median seconds) of all-reduce over `ranks` local processes."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    workers = [context.Process(target=_all_reduce_worker, args=(rank, ranks, port, sizes, repeats, queue))
               for rank in range(ranks)]
    for worker in workers:
        worker.start()
    result = queue.get(timeout=300)
    for worker in workers:
        worker.join(timeout=60)
    if isinstance(result, str):
        raise RuntimeError(f"all-reduce measurement failed: {result}")
    return result


def _all_reduce_worker(rank: int, ranks: int, port: int, sizes, repeats: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        cuda = torch.cuda.is_available() and torch.cuda.device_count() >= ranks
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=ranks)
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        samples = []
        for size in sizes:
            tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
            dist.all_reduce(tensor)
            times = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(tensor)
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            samples.append((float(size), sorted(times)[len(times) // 2]))
        if rank == 0:
            queue.put(samples)
        dist.destroy_process_group()
    except Exception as err:  # noqa: BLE001 - reported to the parent
        queue.put(f"rank {rank}: {type(err).__name__}: {err}")


def measure_copy_bandwidth(nbytes: int = 2**27, repeats: int = 5, device: str = "cpu") -> float:
    """Memory bandwidth counting bytes read and written, from a tensor copy."""
    source = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    target = torch.empty_like(source)
    target.copy_(source)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        target.copy_(source)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * nbytes / sorted(times)[len(times) // 2]


def calibrate(out: str | Path, gpu_name: str = "cpu", ranks: int = 2, ranks_per_node: int = 1) -> dict:
    """Measure GEMM, memory bandwidth and all-reduce, write the hardware profile YAML.

    On a CPU host `ranks_per_node` processes share the cores, so GEMM throughput is measured
    with each rank's share of the threads, as the training ranks will run."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, ranks_per_node)))
    try:
        flops = measure_gemm_flops(1024 if device == "cpu" else 8192, device=device)
        bandwidth = measure_copy_bandwidth(device=device)
    finally:
        torch.set_num_threads(threads)
    samples = measure_all_reduce(ranks)
    link = fit_all_reduce(samples, ranks)
    dtype = "bf16" if device == "cuda" else "fp32"
    profile = {
        "measured_on": {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                        "torch": str(torch.__version__), "ranks": ranks, "ranks_per_node": ranks_per_node},
        "gpus": {gpu_name: {"peak_flops": {dtype: flops, **({"bf16": flops} if dtype == "fp32" else {})},
                            "efficiency": {"gemm": 1.0}, "memory_bandwidth_Bps": bandwidth}},
        "links": {"intra": {"bandwidth_Bps": link.bandwidth_Bps, "latency_s": link.latency_s}},
        "all_reduce_samples": [{"bytes": s, "seconds": t} for s, t in samples],
    }
    Path(out).write_text(yaml.safe_dump(profile, sort_keys=False))
    return profile

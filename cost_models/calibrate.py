"""Measure this machine into a hardware profile the cost model loads.

    autopar calibrate --out hw.yaml          # then: cluster=calibrated cluster.hardware_profile=hw.yaml

Compute, on one rank with its share of the cores (CPU: float32; CUDA: bfloat16):
  * GEMM throughput at a few sizes; the best is the device's achievable peak (efficiency 1.0);
  * memory bandwidth from a large copy (bytes read + written);
  * per-class efficiencies: an element-wise op (tanh GELU), a layer norm and fused attention,
    each as its roofline share (bytes/s over the copy bandwidth, FLOP/s over the GEMM peak);
  * the per-op overhead of small eager ops (dispatch + launch).
Communication, over `ranks` local processes (gloo on CPU, NCCL when each rank has a GPU):
  all-reduce, all-gather, reduce-scatter, all-to-all and send/recv timed at several sizes; each
  fitted to t = A + S·c (`fit_line`, relative least squares) and converted to the alpha-beta
  model of collectives.py for its ring algorithm (`to_link`), e.g. all-reduce
  t = 2(n-1)·a + 2(n-1)/n·S/B gives a = A / (2(n-1)) and B = 2(n-1)/n / c.
The YAML holds `gpus.<name>` (peak_flops, efficiency, memory_bandwidth_Bps, launch_overhead_s)
and `links.intra` (the all-reduce alpha/beta plus one entry per collective), read by
`ClusterSpec.from_config` through `ClusterConfig.hardware_profile`. A full run takes 20-40 s on
two CPU cores.

The measuring ranks listen on 127.0.0.1 only: their rendezvous store is hosted by the calling
process on a loopback socket (`loopback_store`) and gloo's pairs bind to ``lo``.
"""
from __future__ import annotations

import os
import socket
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import yaml

SIZES_BYTES = (2**12, 2**16, 2**20, 2**22, 2**24)
QUICK_SIZES_BYTES = (2**12, 2**18, 2**21)
GEMM_SIZES = {"cpu": (256, 512, 1024), "cuda": (2048, 4096, 8192)}
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


@dataclass(frozen=True)
class LinkFit:
    """Alpha-beta parameters of one collective's ring model, fitted from measurements."""

    latency_s: float
    bandwidth_Bps: float


def fit_line(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares of t = A + S·c minimising relative errors (weights 1/t²), so the small
    messages (latency) count as much as the large ones (bandwidth). Returns (A ≥ 0, c > 0)."""
    if len(samples) < 2:
        raise ValueError("fitting a line needs at least two (bytes, seconds) samples")
    w = [1.0 / t**2 for _, t in samples]
    sw = sum(w)
    sx = sum(wi * s for wi, (s, _) in zip(w, samples))
    sy = sum(wi * t for wi, (_, t) in zip(w, samples))
    sxx = sum(wi * s * s for wi, (s, _) in zip(w, samples))
    sxy = sum(wi * s * t for wi, (s, t) in zip(w, samples))
    det = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / det if det else 0.0
    slope = max(slope, 1e-30)
    intercept = max(0.0, (sy - slope * sx) / sw)
    return intercept, slope


def to_link(op: str, intercept_s: float, slope_s_per_byte: float, ranks: int) -> LinkFit:
    """Convert a fitted line to per-message latency and link bandwidth of op's ring model
    (collectives.flat_time_s); busbw factors from nccl-tests."""
    n = ranks
    steps, factor = {"all_reduce": (2 * (n - 1), 2 * (n - 1) / n), "all_gather": (n - 1, (n - 1) / n),
                     "reduce_scatter": (n - 1, (n - 1) / n), "all_to_all": (n - 1, (n - 1) / n),
                     "send_recv": (1, 1.0)}[op]
    return LinkFit(latency_s=intercept_s / steps, bandwidth_Bps=factor / slope_s_per_byte)


def fit_all_reduce(samples: list[tuple[float, float]], ranks: int) -> LinkFit:
    """Ring all-reduce alpha and beta from (bytes, seconds) samples."""
    return to_link("all_reduce", *fit_line(samples), ranks)


# -- compute --------------------------------------------------------------------------------------

def _timed(fn: Callable[[], object], device: str, repeats: int) -> float:
    """Median seconds of fn after a warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure_gemm_flops(n: int = 1024, repeats: int = 5, device: str = "cpu") -> float:
    """Achieved FLOP/s of an n×n×n matrix product (2n³ FLOPs)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _timed(lambda: a @ b, device, repeats)


def measure_copy_bandwidth(nbytes: int = 2**27, repeats: int = 5, device: str = "cpu") -> float:
    """Memory bandwidth counting bytes read and written, from a tensor copy."""
    source = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    target = torch.empty_like(source)
    return 2 * nbytes / _timed(lambda: target.copy_(source), device, repeats)


def measure_launch_overhead(repeats: int = 200, device: str = "cpu") -> float:
    """Seconds per tiny eager op (dispatch + launch), amortised over a burst."""
    x = torch.ones(16, device=device)

    def burst():
        y = x
        for _ in range(repeats):
            y = y + 1.0
        return y

    return _timed(burst, device, 5) / repeats


def measure_efficiencies(peak_flops: float, bandwidth_Bps: float, device: str = "cpu") -> dict[str, float]:
    """Roofline share reached by an element-wise op, a layer norm and fused attention."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    itemsize = torch.finfo(dtype).bits // 8
    x = torch.randn(2**22 if device == "cpu" else 2**26, device=device, dtype=dtype)
    gelu_s = _timed(lambda: F.gelu(x, approximate="tanh"), device, 5)
    rows = x.view(-1, 1024)
    norm_s = _timed(lambda: F.layer_norm(rows, (1024,)), device, 5)
    b, h, s, d = (1, 8, 512, 64) if device == "cpu" else (4, 16, 2048, 128)
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype) for _ in range(3))
    attention_s = _timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device, 5)
    moved = 2 * x.numel() * itemsize
    attention_flops = 4 * b * h * s * s * d / 2  # QK^T and PV, causal half
    return {"elementwise": min(1.0, moved / gelu_s / bandwidth_Bps),
            "norm": min(1.0, moved / norm_s / bandwidth_Bps),
            "attention": min(1.0, attention_flops / attention_s / peak_flops)}


# -- collectives ------------------------------------------------------------------------------------

def measure_collectives(ranks: int = 2, sizes: tuple[int, ...] = SIZES_BYTES, repeats: int = 5,
                        ops: tuple[str, ...] = COLLECTIVES) -> dict[str, list[tuple[float, float]]]:
    """{op: [(bytes, median seconds)]} over `ranks` local processes (nccl-tests' S per op)."""
    if ranks < 2:
        raise ValueError("measuring collectives needs at least 2 ranks")
    context = mp.get_context("spawn")
    queue = context.Queue()
    store, port = loopback_store()
    workers = [context.Process(target=_collective_worker, args=(rank, ranks, port, sizes, repeats, ops, queue))
               for rank in range(ranks)]
    try:
        for worker in workers:
            worker.start()
        result = queue.get(timeout=300)
    finally:
        for worker in workers:
            if worker.pid is None:
                continue
            worker.join(timeout=60)
            if worker.is_alive():
                worker.terminate()
        del store
    if isinstance(result, str):
        raise RuntimeError(f"collective measurement failed: {result}")
    return result


def measure_all_reduce(ranks: int = 2, sizes: tuple[int, ...] = SIZES_BYTES, repeats: int = 5
                       ) -> list[tuple[float, float]]:
    """(bytes, median seconds) of all-reduce over `ranks` local processes."""
    return measure_collectives(ranks, sizes, repeats, ("all_reduce",))["all_reduce"]


def loopback_store() -> tuple[dist.TCPStore, int]:
    """A rendezvous store hosted by this process on 127.0.0.1 at a free port, and the port (the
    socket is bound before the ranks start, so no other program can take the port meanwhile;
    torch's own store, made by rank 0 from MASTER_ADDR, would listen on every interface)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    # The store takes over the listening descriptor (detach: Python must not close it).
    store = dist.TCPStore("127.0.0.1", port, is_master=True, master_listen_fd=listener.detach(),
                          wait_for_workers=False, timeout=timedelta(seconds=300))
    return store, port


def _collective_worker(rank: int, ranks: int, port: int, sizes, repeats: int, ops, queue) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pairs on loopback too
    try:
        torch.set_num_threads(1)
        cuda = torch.cuda.is_available() and torch.cuda.device_count() >= ranks
        if cuda:
            torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=ranks)
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        warm = torch.ones(1024, device=device)
        for _ in range(5):  # first collectives set up connections: keep them out of the samples
            dist.all_reduce(warm)
        results = {}
        for op in ops:
            samples = []
            for size in sizes:
                run = _collective_call(op, size, ranks, rank, device)
                run()
                times = []
                # Small messages are cheap to repeat and the most exposed to scheduling noise.
                for _ in range(repeats if size > 2**16 else 4 * repeats):
                    dist.barrier()
                    start = time.perf_counter()
                    run()
                    if cuda:
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
                samples.append((float(size), sorted(times)[len(times) // 2]))
            results[op] = samples
        if rank == 0:
            queue.put(results)
        dist.barrier()
        dist.destroy_process_group()
    except Exception as err:  # noqa: BLE001 - reported to the parent instead of hanging it
        queue.put(f"rank {rank}: {type(err).__name__}: {err}")


def _collective_call(op: str, size: int, ranks: int, rank: int, device) -> Callable[[], object]:
    """One collective with nccl-tests' buffer size S = size bytes."""
    count = max(ranks, size // 4 // ranks * ranks)
    full = torch.ones(count, dtype=torch.float32, device=device)
    shard = torch.ones(count // ranks, dtype=torch.float32, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, shard)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(shard, full)
    if op == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full)
    if op == "send_recv":  # rank 0 -> 1 and back (one round trip = two messages)
        def ping():
            if rank == 0:
                dist.send(full, 1)
                dist.recv(full, 1)
            elif rank == 1:
                dist.recv(full, 0)
                dist.send(full, 0)
        return ping
    raise ValueError(f"unknown collective '{op}'")


# -- the profile ---------------------------------------------------------------------------------

def calibrate(out: str | Path, gpu_name: str = "cpu", ranks: int = 2, ranks_per_node: int = 1,
              quick: bool = False) -> dict:
    """Measure compute and collectives, write the hardware profile YAML, and return it.

    Args:
        out: where to write the YAML.
        gpu_name: catalogue entry the measurements replace (e.g. "cpu", "H100-SXM").
        ranks: local processes for the collectives (2-4).
        ranks_per_node: training ranks that will share this host's cores (CPU): compute is
            measured with each one's share of the threads, as the ranks will run, and scaled
            down when the ranks outnumber the cores.
        quick: fewer sizes and repeats (a smoke test, ~10 s).
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    threads = torch.get_num_threads()
    cores = os.cpu_count() or 1
    per_rank = max(1, cores // max(1, ranks_per_node))
    # More ranks than cores time-share them: each keeps cores / (ranks x threads) of its speed.
    share = min(1.0, cores / (max(1, ranks_per_node) * per_rank)) if device == "cpu" else 1.0
    if device == "cpu":
        torch.set_num_threads(per_rank)
    try:
        gemm = {n: share * measure_gemm_flops(n, device=device) for n in GEMM_SIZES[device][-1 if quick else 0:]}
        flops = max(gemm.values())
        bandwidth = share * measure_copy_bandwidth(2**25 if quick else 2**27, device=device)
        efficiency = {"gemm": 1.0, **measure_efficiencies(flops / share, bandwidth / share, device)}
        overhead = measure_launch_overhead(device=device) / share
    finally:
        torch.set_num_threads(threads)
    sizes = QUICK_SIZES_BYTES if quick else SIZES_BYTES
    samples = measure_collectives(ranks, sizes, 3 if quick else 5)
    fits = {op: to_link(op, *fit_line(points), ranks if op != "send_recv" else 2) for op, points in samples.items()}
    # send_recv is timed as a round trip: two messages.
    round_trip = fits["send_recv"]
    fits["send_recv"] = LinkFit(round_trip.latency_s / 2, round_trip.bandwidth_Bps * 2)
    dtype = "bf16" if device == "cuda" else "fp32"
    peaks = {dtype: flops}
    if device == "cpu":
        peaks.update(bf16=flops, fp16=flops)  # 16-bit training on a CPU host: priced at the measured rate
    profile = {
        "measured_on": {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                        "torch": str(torch.__version__), "ranks": ranks, "ranks_per_node": ranks_per_node,
                        **({"host_cores": cores, "threads_per_rank": per_rank, "core_share": share}
                           if device == "cpu" else {})},
        "gpus": {gpu_name: {"peak_flops": peaks, "efficiency": efficiency, "memory_bandwidth_Bps": bandwidth,
                            "launch_overhead_s": overhead}},
        "links": {"intra": {"bandwidth_Bps": fits["all_reduce"].bandwidth_Bps,
                            "latency_s": fits["all_reduce"].latency_s,
                            "collectives": {op: {"latency_s": fit.latency_s, "bandwidth_Bps": fit.bandwidth_Bps}
                                            for op, fit in fits.items()}}},
        "gemm_samples": [{"n": n, "flops_per_s": f} for n, f in gemm.items()],
        "collective_samples": {op: [{"bytes": s, "seconds": t} for s, t in points] for op, points in samples.items()},
    }
    write_yaml(out, profile)
    return profile


def write_yaml(out: str | Path, data: dict) -> None:
    """Write ``data`` to ``out`` whole or not at all (a temporary file in the same folder, then
    renamed), creating the folder if needed, as the other verbs' ``--out`` do."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(yaml.safe_dump(data, sort_keys=False))
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

"""Measurement for validation runs: per-rank step times, compute vs communication, peak memory.

`autopar validate` starts the compiled module's ranks through this module
(``torchrun -m autopar.runtime.measure parallel_<model>.py --measure-dir DIR [module options]``),
so the generated file carries no measurement code. After the module's timed steps, every rank
runs one warm step under torch.profiler to split its time into communication (time inside
collectives and point-to-point calls, which on a blocking backend is time waiting for peers) and
the rest, measures its peak memory on one more step (the CUDA allocator's peak on GPUs; on CPUs
PyTorch's MemTracker, which counts tensor bytes rather than the process's resident set), and
writes DIR/rank_<r>.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

COMM_MARKERS = ("gloo:", "nccl:", "c10d::", "record_param_comms", "all_reduce", "allreduce", "all_gather",
                "allgather", "reduce_scatter", "_reduce_scatter", "all_to_all", "alltoall", "broadcast", "send",
                "recv", "barrier")


def is_communication(name: str) -> bool:
    lowered = name.lower()
    return any(marker in lowered for marker in COMM_MARKERS)


def host_events(prof: Any) -> list[tuple[str, float, float]]:
    """(name, start, end) in microseconds of every host event a finished torch profiler holds,
    read from its raw results: building `prof.events()` (each event's parents, children and
    memory) takes a second for a small model's step on this machine, and nothing here reads them."""
    raw = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if raw is None:  # a torch that keeps them elsewhere: the slower, public way
        return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()]
    return [(e.name(), e.start_ns() / 1e3, e.end_ns() / 1e3) for e in raw.events()
            if e.device_type() == torch.autograd.DeviceType.CPU]


def profiled_split(run_step: Callable[[], float]) -> dict[str, float]:
    """Run one step under the profiler: wall seconds and the seconds spent in communication
    calls (outermost ones only, so nested records are not counted twice)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = run_step()
    intervals = sorted((start, end) for name, start, end in host_events(prof)
                       if is_communication(name) and end > start)
    comm_us, covered_until = 0.0, float("-inf")
    for start, end in intervals:  # union of intervals: nested and overlapping calls count once
        if end <= covered_until:
            continue
        comm_us += end - max(start, covered_until)
        covered_until = end
    comm = min(wall, comm_us / 1e6)
    return {"step_time_s": wall, "comm_s": comm, "compute_s": wall - comm}


def cuda_peak(device: torch.device) -> dict[str, Any]:
    """The allocator's peak since its last reset plus what the device holds outside the allocator
    (CUDA context, NCCL buffers): what the cost model predicts, CUDA context included. The
    allocator's reserved peak is kept beside it: the gap is fragmentation, which the plan's
    headroom must cover."""
    allocated = int(torch.cuda.max_memory_allocated(device))
    free, total = torch.cuda.mem_get_info(device)
    outside = max(0, total - free - int(torch.cuda.memory_reserved(device)))
    return {"peak_memory_bytes": allocated + outside,
            "memory_breakdown": {"allocated_peak": allocated,
                                 "reserved_peak": int(torch.cuda.max_memory_reserved(device)),
                                 "outside_allocator": outside}}


def tracked_peak(run_step: Callable[[], float], device: torch.device, modules: list, optimizer: Any) -> dict[str, Any]:
    """Peak memory of one step and its breakdown by PyTorch's own accounting."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        run_step()
        return cuda_peak(device)
    from torch.distributed._tools.mem_tracker import MemTracker

    roots = {id(module) for module in modules}

    class StepTracker(MemTracker):
        """MemTracker over a step of several micro-batches: it refuses a root module's second
        forward (it assumes one per iteration), so module stats restart there; the peak of the
        whole step is kept."""

        def _pre_fw_hook(self, module, inputs) -> None:
            if id(module) in roots and module in self.memory_tracking and not self._mod_tracker.is_bw:
                self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)

    tracker = StepTracker()
    tracker.track_external(*modules, *([optimizer] if isinstance(optimizer, torch.optim.Optimizer) else []))
    with tracker:
        run_step()
    peaks = tracker.get_tracker_snapshot("peak").get(device, {})
    breakdown = {str(getattr(key, "value", key)): int(value) for key, value in peaks.items() if key != "Total"}
    return {"peak_memory_bytes": int(peaks.get("Total", sum(breakdown.values()))), "memory_breakdown": breakdown}


def write_measurements(folder: str | Path, step_times_s: list[float], split: dict[str, float],
                       memory: dict[str, Any], warmup: int) -> None:
    warm = step_times_s[warmup:] or step_times_s
    record = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "step_times_s": step_times_s,
              "median_step_time_s": statistics.median(warm), **{f"profiled_{k}": v for k, v in split.items()},
              **memory}
    path = Path(folder) / f"rank_{dist.get_rank()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))


def measure_after(generated: Any, folder: str | Path) -> Callable[..., None]:
    """The ``after_steps`` hook of a generated module's ``main``: two more steps after the timed
    ones, one under the profiler, one under memory tracking; then this rank's file in ``folder``."""
    def after_steps(parallel: Any, training: Any, config: Any, model_module: Any, records: list[dict]) -> None:
        def step(index: int) -> Callable[[], float]:
            return lambda: generated.timed_step(parallel, training, config, model_module, index)["step_time_s"]

        split = profiled_split(step(training.steps))
        memory = tracked_peak(step(training.steps + 1), parallel.device, parallel.modules, parallel.optimizer)
        times = [record["step_time_s"] for record in records]
        write_measurements(folder, times, split, memory, warmup=min(2, max(0, len(times) - 1)))

    return after_steps


def main(argv: list[str] | None = None) -> None:
    """One rank: import the generated module, train with its own options, then measure."""
    from autopar.runtime.generated import import_generated

    parser = argparse.ArgumentParser(description="Run a generated module's rank and measure it (autopar validate).")
    parser.add_argument("script", help="the generated parallel_<model>.py")
    parser.add_argument("--measure-dir", required=True, help="each rank writes rank_<r>.json here")
    args, rest = parser.parse_known_args(argv)
    generated = import_generated(args.script, "__autopar_measured__")
    generated.main(rest, after_steps=measure_after(generated, args.measure_dir))


if __name__ == "__main__":
    from autopar.runtime.lifeline import end_process

    main(sys.argv[1:])
    end_process(0)

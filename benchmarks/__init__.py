"""Benchmarks: speed and memory targets, measured and written as markdown tables (`make bench`).

`python -m benchmarks.run --smoke` (CI's `make bench-smoke`) runs every benchmark at its smallest
size: one case of each, few steps. It shows the benchmarks still run against today's code; its
numbers are not the targets' (those come from `make bench`).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence, TypeVar

SMOKE_ENV = "AUTOPAR_BENCH_SMOKE"
T = TypeVar("T")


def smoke() -> bool:
    """Whether this run is the smoke run (smallest sizes)."""
    return os.environ.get(SMOKE_ENV) == "1"


def cases(items: Sequence[T], smallest: int = 0) -> list[T]:
    """Every case, or in the smoke run the one at index ``smallest``."""
    return [items[smallest]] if smoke() else list(items)


def sized(full: int, small: int) -> int:
    """A count (steps, repetitions) at full size, or in the smoke run ``small``."""
    return small if smoke() else full


def timed_autopar(arguments: Sequence[str], cwd: Path, exit_code: int = 0) -> float:
    """Wall seconds of one `autopar` command run as a user runs it (a fresh process in ``cwd``);
    raises with its output when it exits otherwise than ``exit_code``."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "autopar.cli", *arguments], cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != exit_code:
        raise RuntimeError(f"autopar {' '.join(arguments[:1])}: exit {done.returncode}, not {exit_code}:\n"
                           f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return seconds


REFERENCE_ITERATIONS = 3_000_000


def machine_reference_s(repeats: int = 3) -> float:
    """Seconds of a fixed pure-Python workload (dict and arithmetic work, as planning does), the
    fastest of ``repeats``: wall-time targets are absolute, but the machines these benchmarks run
    on differ by 2x from one run to the next, so each timing table carries this to read it by."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        table: dict[int, int] = {}
        for i in range(REFERENCE_ITERATIONS):
            table[i & 1023] = table.get((i * 7) & 1023, 0) + i
        best = min(best, time.perf_counter() - start)
    return round(best, 3)

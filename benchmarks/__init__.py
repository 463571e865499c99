"""Benchmarks: speed and memory targets, measured and written as markdown tables (`make bench`).

`python -m benchmarks.run --smoke` (CI's `make bench-smoke`) runs every benchmark at its smallest
size: one case of each, few steps. It shows the benchmarks still run against today's code; its
numbers are not the targets' (those come from `make bench`).
"""
from __future__ import annotations

import os
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

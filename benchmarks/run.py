"""Run every benchmark (modules `benchmarks/bench_*.py` with a `run() -> dict`) and print one
markdown table per benchmark; the same text goes to benchmarks/results/latest.md, and each
benchmark's table to benchmarks/results/<benchmark>.md, which the docs cite for their figures
(tests/unit/test_docs_figures.py holds a paragraph citing one to the numbers it holds).

    make bench                         # all of them
    python -m benchmarks.run profile   # only those whose name contains "profile"
    python -m benchmarks.run --smoke   # each at its smallest size (make bench-smoke, CI): results/smoke.md
    python -m benchmarks.run chaos     # fault injection (1-3 min a run, 50 runs; needs root): only when named
"""
from __future__ import annotations

import importlib
import multiprocessing
import os
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from benchmarks import SMOKE_ENV

HERE = Path(__file__).resolve().parent
ONLY_WHEN_NAMED = ("bench_chaos",)  # long: run only when asked for by name
GENERATED_BY = "Written by `python -m benchmarks.run"


def markdown_table(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(row.get(key, "")) for key in keys) + " |" for row in rows]
    return "\n".join(lines)


@dataclass(frozen=True)
class Outcome:
    """One benchmark's run: its rows, or the traceback that stopped it."""

    name: str
    rows: list[dict] | None
    error: str | None
    seconds: float


def run_one(name: str, smoke: bool) -> Outcome:
    """Import and run benchmark ``name`` here (in a pool worker for the smoke run)."""
    if smoke:
        os.environ[SMOKE_ENV] = "1"
    start = time.perf_counter()
    try:
        result = importlib.import_module(f"benchmarks.{name}").run()
    except Exception:  # noqa: BLE001 - one broken benchmark must not hide the others
        if not smoke:
            raise
        return Outcome(name, None, traceback.format_exc(), time.perf_counter() - start)
    rows = result if isinstance(result, list) else [result]
    return Outcome(name, rows, None, time.perf_counter() - start)


def outcomes(names: list[str], smoke: bool) -> Iterator[Outcome]:
    """Each benchmark's outcome, in ``names``' order. The smoke run spreads them over SMOKE_JOBS
    processes (most are one busy core: on two cores 110 s one at a time, ~70 s two at a time); a
    full run goes one at a time, so that none times its work beside another."""
    jobs = int(os.environ.get("SMOKE_JOBS", "2")) if smoke else 1
    if jobs <= 1:
        for name in names:
            print(f"running {name} ...", flush=True)
            yield run_one(name, smoke)
        return
    print(f"running {len(names)} benchmarks, {jobs} at a time ...", flush=True)
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for future in [pool.submit(run_one, name, smoke) for name in names]:
            yield future.result()


def main(filters: list[str]) -> int:
    """Run the benchmarks ``filters`` name (all but ONLY_WHEN_NAMED without any); ``--smoke`` runs
    each at its smallest size and exits 1 when one fails (the others still run)."""
    smoke = "--smoke" in filters
    filters = [word for word in filters if word != "--smoke"]
    names = [path.stem for path in sorted(HERE.glob("bench_*.py"))
             if (any(word in path.stem for word in filters) if filters else path.stem not in ONLY_WHEN_NAMED)]
    sections, failed = [], []
    for outcome in outcomes(names, smoke):
        if outcome.rows is None:
            failed.append(outcome.name)
            sections.append(f"## {outcome.name}\n\nFAILED:\n\n```\n{outcome.error}```\n")
            print(sections[-1], flush=True)
            continue
        took = f" ({outcome.seconds:.0f} s)" if smoke else ""
        sections.append(f"## {outcome.name}{took}\n\n{markdown_table(outcome.rows)}\n")
        print(sections[-1], flush=True)
        if not smoke:
            (HERE / "results").mkdir(exist_ok=True)
            (HERE / "results" / f"{outcome.name}.md").write_text(
                f"{GENERATED_BY} {outcome.name.removeprefix('bench_')}`\n\n" + sections[-1])
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / ("smoke.md" if smoke else "latest.md")).write_text("\n".join(sections))
    if failed:
        print(f"benchmarks that failed at their smallest size: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

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
import os
import sys
import time
import traceback
from pathlib import Path

from benchmarks import SMOKE_ENV

HERE = Path(__file__).resolve().parent
ONLY_WHEN_NAMED = ("bench_chaos",)  # long: run only when asked for by name
GENERATED_BY = "Written by `python -m benchmarks.run"


def markdown_table(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(row.get(key, "")) for key in keys) + " |" for row in rows]
    return "\n".join(lines)


def main(filters: list[str]) -> int:
    """Run the benchmarks ``filters`` name (all but ONLY_WHEN_NAMED without any); ``--smoke`` runs
    each at its smallest size and exits 1 when one fails (the others still run)."""
    smoke = "--smoke" in filters
    filters = [word for word in filters if word != "--smoke"]
    if smoke:
        os.environ[SMOKE_ENV] = "1"
    sections, failed = [], []
    for path in sorted(HERE.glob("bench_*.py")):
        if filters and not any(word in path.stem for word in filters):
            continue
        if not filters and path.stem in ONLY_WHEN_NAMED:
            continue
        print(f"running {path.stem} ...", flush=True)
        start = time.perf_counter()
        try:
            result = importlib.import_module(f"benchmarks.{path.stem}").run()
        except Exception:  # noqa: BLE001 - one broken benchmark must not hide the others
            if not smoke:
                raise
            failed.append(path.stem)
            sections.append(f"## {path.stem}\n\nFAILED:\n\n```\n{traceback.format_exc()}```\n")
            print(sections[-1], flush=True)
            continue
        rows = result if isinstance(result, list) else [result]
        took = f" ({time.perf_counter() - start:.0f} s)" if smoke else ""
        sections.append(f"## {path.stem}{took}\n\n{markdown_table(rows)}\n")
        print(sections[-1], flush=True)
        if not smoke:
            (HERE / "results").mkdir(exist_ok=True)
            (HERE / "results" / f"{path.stem}.md").write_text(f"{GENERATED_BY} {path.stem.removeprefix('bench_')}`\n\n"
                                                             + sections[-1])
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / ("smoke.md" if smoke else "latest.md")).write_text("\n".join(sections))
    if failed:
        print(f"benchmarks that failed at their smallest size: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

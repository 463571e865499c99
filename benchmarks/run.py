"""Run every benchmark (modules `benchmarks/bench_*.py` with a `run() -> dict`) and print one
markdown table per benchmark; the same text goes to benchmarks/results/latest.md.

    make bench                         # all of them
    python -m benchmarks.run profile   # only those whose name contains "profile"
    python -m benchmarks.run chaos     # fault injection (1-3 min a run, 50 runs; needs root): only when named
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ONLY_WHEN_NAMED = ("bench_chaos",)  # long: run only when asked for by name


def markdown_table(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(row.get(key, "")) for key in keys) + " |" for row in rows]
    return "\n".join(lines)


def main(filters: list[str]) -> int:
    sections = []
    for path in sorted(HERE.glob("bench_*.py")):
        if filters and not any(word in path.stem for word in filters):
            continue
        if not filters and path.stem in ONLY_WHEN_NAMED:
            continue
        module = importlib.import_module(f"benchmarks.{path.stem}")
        print(f"running {path.stem} ...", flush=True)
        result = module.run()
        rows = result if isinstance(result, list) else [result]
        sections.append(f"## {path.stem}\n\n{markdown_table(rows)}\n")
        print(sections[-1], flush=True)
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "latest.md").write_text("\n".join(sections))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

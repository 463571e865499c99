"""Run zoo cases and print the outcome table (markdown), e.g.

    python -m tests.zoo.table                        # every model under every 2-rank pin
    python -m tests.zoo.table --models nanogpt hf_llama --pins dp2 tp2
"""
from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter
from pathlib import Path

from tests.zoo.harness import MODELS, PINS, run_zoo

TWO_RANK_PINS = ["dp2", "zero3", "tp2", "pp2", "cp2"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--pins", nargs="*", default=TWO_RANK_PINS)
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        cases = [(m, p) for m in args.models for p in args.pins if p in PINS]
        outcomes = run_zoo(cases, Path(root))
    lines = ["| model | " + " | ".join(args.pins) + " |", "|---" * (len(args.pins) + 1) + "|"]
    for model in args.models:
        cells = [outcomes[f"{model}-{pin}"].kind for pin in args.pins]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    counts = Counter(o.kind for o in outcomes.values())
    lines += ["", ", ".join(f"{kind}: {n}" for kind, n in sorted(counts.items()))
              + f" of {len(outcomes)} cases in {time.perf_counter() - start:.0f} s", ""]
    lines += [f"- {o.case}: {o.kind}: {o.detail}" for o in outcomes.values() if o.kind != "trains"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

"""What `autopar compile` costs: a tiny GPT (examples/gpt.py, 4 layers of 128) for 4 gloo ranks,
with compile's proof at full scale on fake tensors only (``check=off``) and with its numerical
check on 4 local gloo ranks against one process as well (``check=on``), each compiled into a
fresh folder in its own process (what a user's first command pays, importing torch included).

    python -m benchmarks.run compile

The machine's load average is recorded beside each time: on a shared 2-core machine the check's
4 ranks and the reference compete with whatever else runs.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import cases, sized

REPO = Path(__file__).resolve().parent.parent
OVERRIDES = ["cluster=cpu_gloo", "cluster.gpus_per_node=4", "model.layers=4", "model.hidden=128", "model.heads=4",
             "model.seq_len=64", "model.vocab=512", "train.global_batch_size=16", "train.precision=fp32"]
REPEATS = sized(3, 1)


def _compile_s(check: str) -> tuple[float, float]:
    """(seconds, load average over the last minute when it ended) of one compile."""
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "autopar.cli", "compile", str(REPO / "examples" / "gpt.py"), *OVERRIDES,
                   f"check={check}", "--out-dir", str(Path(folder) / "out")]
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True, cwd=folder)
        return time.perf_counter() - start, os.getloadavg()[0]


def run() -> list[dict]:
    rows = []
    for check in cases(["off", "on"]):
        runs = [_compile_s(check) for _ in range(REPEATS)]
        seconds = [s for s, _ in runs]
        rows.append({"model": "examples/gpt.py 4 x 128, 4 gloo ranks", "check": check, "runs": len(runs),
                     "median_s": round(statistics.median(seconds), 1), "min_s": round(min(seconds), 1),
                     "max_s": round(max(seconds), 1),
                     "load_average": " / ".join(f"{load:.1f}" for _, load in runs)})
    return rows

"""What `autopar compile` costs: a tiny GPT (examples/gpt.py, 4 layers of 128) for 4 gloo ranks,
with compile's proof at full scale on fake tensors only (``check=off``) and with its numerical
check on 4 local gloo ranks against one process as well (``check=on``), each compiled into a
fresh folder in its own process (what a user's first command pays, importing torch included);
then the command of docs/reports.md's Llama-3-70B report (64 H100s, compile's default proof), and
how soon a misspelt setting (`cluster.nodez=2`) ends in its one-line error (before torch loads).

    python -m benchmarks.run compile

The machine's load average is recorded beside each time: on a shared 2-core machine the check's
4 ranks and the reference compete with whatever else runs.
"""
from __future__ import annotations

import os
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks import cases, sized, timed_autopar

REPO = Path(__file__).resolve().parent.parent
OVERRIDES = ["cluster=cpu_gloo", "cluster.gpus_per_node=4", "model.layers=4", "model.hidden=128", "model.heads=4",
             "model.seq_len=64", "model.vocab=512", "train.global_batch_size=16", "train.precision=fp32"]
# docs/reports.md's report: Llama-3-70B sizes on 8 DGX H100 nodes.
LLAMA_70B = ["cluster=dgx_h100", "cluster.nodes=8", "model.layers=80", "model.hidden=8192", "model.heads=64",
             "model.kv_heads=8", "model.ffn=28672", "model.vocab=128256", "model.seq_len=4096",
             "train.global_batch_size=256"]
REPEATS = sized(3, 1)


@dataclass(frozen=True)
class Command:
    """One timed command: what the row calls it, its arguments after `autopar`, its exit code."""

    name: str
    check: str
    arguments: tuple[str, ...]
    exit_code: int = 0
    repeats: int = 1


COMMANDS = [
    Command("examples/gpt.py 4 x 128, 4 gloo ranks", "off",
            ("compile", str(REPO / "examples" / "gpt.py"), *OVERRIDES, "check=off"), repeats=REPEATS),
    Command("examples/gpt.py 4 x 128, 4 gloo ranks", "on",
            ("compile", str(REPO / "examples" / "gpt.py"), *OVERRIDES, "check=on"), repeats=REPEATS),
    Command("examples/llama_hf.py Llama-3-70B sizes, 64 H100 (docs/reports.md)", "default",
            ("compile", str(REPO / "examples" / "llama_hf.py"), *LLAMA_70B)),
    Command("a misspelt setting: autopar plan examples/gpt.py cluster.nodez=2 (exit 1)", "",
            ("plan", str(REPO / "examples" / "gpt.py"), "cluster.nodez=2"), exit_code=1),
]


def _seconds(command: Command) -> tuple[float, float]:
    """(seconds, load average over the last minute when it ended) of one run, in a fresh folder."""
    with tempfile.TemporaryDirectory() as folder:
        out = ("--out-dir", str(Path(folder) / "out")) if command.arguments[0] == "compile" else ()
        seconds = timed_autopar([*command.arguments, *out], Path(folder), command.exit_code)
        return seconds, os.getloadavg()[0]


def run() -> list[dict]:
    rows = []
    for command in cases(COMMANDS):
        runs = [_seconds(command) for _ in range(command.repeats)]
        seconds = [s for s, _ in runs]
        rows.append({"model": command.name, "check": command.check, "runs": len(runs),
                     "median_s": round(statistics.median(seconds), 1), "min_s": round(min(seconds), 1),
                     "max_s": round(max(seconds), 1),
                     "load_average": " / ".join(f"{load:.1f}" for _, load in runs)})
    return rows

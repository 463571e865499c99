"""Run a generated module on local ranks with torchrun (gloo on CPU, NCCL on GPUs).

The generated module does the training and the logging; this launches it, collects the records
it appended to ``run.jsonl``, and when a rank fails, finds that rank's error in torchrun's
report (the module's ``main`` is wrapped in torch's ``record``, so the traceback is kept).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from autopar.codegen.launch import STORE_PER_ATTEMPT_ENV
from autopar.errors import UserError
from autopar.plan import Plan

LOG_NAME = "run.jsonl"


@dataclass
class RunResult:
    """What a local run did.

    Attributes:
        returncode: torchrun's exit status (0 when every rank succeeded).
        records: the per-step records this run appended to run.jsonl.
        failed_rank: the first rank that failed, if any.
        error: that rank's error (exception and traceback as torchrun reported it), else "".
        output: everything the ranks and torchrun printed.
    """

    returncode: int
    records: list[dict] = field(default_factory=list)
    failed_rank: int | None = None
    error: str = ""
    output: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def find_script(out_dir: Path) -> Path:
    scripts = sorted(out_dir.glob("parallel_*.py"))
    if len(scripts) != 1:
        raise UserError(f"{out_dir} holds {len(scripts)} generated modules (parallel_*.py), expected one.",
                        "pass the folder `autopar compile` wrote.")
    return scripts[0]


def read_records(path: str | Path) -> list[dict]:
    """The JSON records of a run.jsonl (missing file: none)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_local(out_dir: str | Path, nproc: int | None = None, steps: int | None = None, *,
              extra_args: Sequence[str] = (), echo: bool = False, timeout_s: float | None = None,
              env: dict[str, str] | None = None, max_restarts: int = 0,
              runner: Sequence[str] = ()) -> RunResult:
    """Launch ``out_dir``'s generated module on ``nproc`` local ranks and wait for it.

    Args:
        out_dir: folder with parallel_<model>.py (and plan.json) as `generate` wrote it.
        nproc: ranks to start; default the plan's world size.
        steps: training steps; default the module's own default.
        extra_args: more arguments for the module (``--lr``, ``--seed``, ``--save-final``).
        echo: also print the ranks' output as it comes.
        timeout_s: kill the run after this long (returncode 124).
        env: environment for the ranks (default: this process's).
        max_restarts: times torchrun restarts all ranks after one fails (they resume from the
            latest checkpoint when the module checkpoints).
        runner: torchrun options that start the module through another program, which gets the
            module's path first (validation: ``("-m", "autopar.runtime.measure")``).
    """
    out_dir = Path(out_dir).resolve()  # the ranks run inside it
    script = find_script(out_dir)
    if nproc is None:
        nproc = Plan.load(out_dir / "plan.json").world_size
    log = out_dir / LOG_NAME
    before = len(read_records(log))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               f"--max-restarts={max_restarts}", *runner, str(script), "--log-file", str(log)]
    if steps is not None:
        command += ["--steps", str(steps)]
    command += list(extra_args)
    lines: list[str] = []
    env = {**STORE_PER_ATTEMPT_ENV, **(env if env is not None else os.environ)}  # restarts need it (see launch.py)
    process = subprocess.Popen(command, cwd=out_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=env)
    try:
        for line in process.stdout:
            lines.append(line)
            if echo:
                print(line, end="", flush=True)
        returncode = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        returncode = 124
    output = "".join(lines)
    result = RunResult(returncode=returncode, records=read_records(log)[before:], output=output)
    if returncode != 0:
        result.failed_rank, result.error = failing_rank(output)
    return result


_BLOCK = re.compile(r"^\[\d+\]:\n(.*?)(?=^\[\d+\]:\n|^-{10,}|^={10,}|\Z)", re.S | re.M)
_RANK = re.compile(r"rank\s*:\s*(\d+)")
_FATAL = "Fatal Python error"  # how faulthandler starts the stack of a rank killed by a signal
# A rank that dies takes its peers' collectives down with it; their errors are consequences.
_CONSEQUENCES = ("Connection closed by peer", "remote worker crashing", "Connection reset by peer",
                 "Signal 15 (SIGTERM)")


def failing_rank(output: str) -> tuple[int | None, str]:
    """(rank, error text) of the failure that caused the others, or the output's tail.

    torchrun names the earliest failure its root cause, but when one rank raises, its peers
    often fail first, inside a collective the dead rank no longer answers; so a failure that
    is only such a consequence is passed over while another rank has a cause of its own."""
    report = output[output.find("Failures:"):] if "Failures:" in output else output
    blocks = [block.strip() for block in _BLOCK.findall(report) if _RANK.search(block)]
    if blocks:
        causes = [b for b in blocks if not any(symptom in b for symptom in _CONSEQUENCES)]
        block = (causes or blocks)[0]
        if "Signal" in block and _FATAL in output:  # died in C++: add the stack its faulthandler printed
            stack = output[output.find(_FATAL):]
            block += "\n" + "\n".join(stack.splitlines()[:40])
        return int(_RANK.search(block).group(1)), block
    ranked = re.findall(r"^\[rank(\d+)\]:.*$", output, re.M)
    tail = "\n".join(output.strip().splitlines()[-40:])
    return (int(ranked[0]) if ranked else None), tail

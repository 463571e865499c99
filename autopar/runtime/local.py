"""Run a generated module on local ranks with torchrun (gloo on CPU, NCCL on GPUs).

The generated module does the training and the logging; this launches it, collects the records
it appended to ``run.jsonl``, and when a rank fails, finds that rank's error in torchrun's
report (the module's ``main`` is wrapped in torch's ``record``, so the traceback is kept).

One run per folder at a time: the run holds an flock on ``DIR/.autopar-run.lock`` (the OS
releases it when the run's processes end, crashed or not; torchrun, and with it the ranks, ends
with the CLI that started it: lifeline.py). Every socket the run listens on is
bound to 127.0.0.1 (torchrun's rendezvous store: loopback.py; rank 0's store: the generated
module; gloo's pairs: GLOO_SOCKET_IFNAME=lo), and torchrun's logs go to a temporary folder
removed after the run.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from autopar.sections.markers import FINISHED_MARKER
from autopar.errors import UserError
from autopar.output_dir import open_no_follow, refuse_link
from autopar.runtime.generated import find_script
from autopar.launch_env import STORE_PER_ATTEMPT_ENV, torchrun_arguments
from autopar.runtime.progress import PEER_GONE

LOG_NAME = "run.jsonl"
LOCK_NAME = ".autopar-run.lock"
# Local ranks reach each other over the loopback interface only (gloo binds its pairs there).
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo"}


@dataclass
class RunResult:
    """What a local run did.

    Attributes:
        returncode: torchrun's exit status (0 when every rank succeeded).
        records: the per-step records this run appended to run.jsonl.
        failed_rank: the first rank that failed, if any.
        error: that rank's error (exception and traceback as torchrun reported it), else "".
        output: everything the ranks and torchrun printed.
        warnings: the ranks' ``warning:`` lines (the model file changed since planning, ...).
        teardown_failure: every rank said it finished (all written) but one died afterwards, in
            the process group's teardown; ``returncode`` is then 0 and this holds torchrun's exit.
    """

    returncode: int
    records: list[dict] = field(default_factory=list)
    failed_rank: int | None = None
    error: str = ""
    output: str = ""
    warnings: list[str] = field(default_factory=list)
    teardown_failure: int | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def read_records(path: str | Path) -> list[dict]:
    """The JSON records of a run.jsonl (missing file: none); a line that is not a JSON object (a
    run killed while writing it) is skipped (`unreadable_lines` names them)."""
    return [record for _, record in _numbered_lines(path) if isinstance(record, dict)]


def unreadable_lines(path: str | Path) -> list[int]:
    """Line numbers (from 1) of run.jsonl that hold no JSON object."""
    return [number for number, record in _numbered_lines(path) if not isinstance(record, dict)]


def _numbered_lines(path: str | Path) -> list[tuple[int, Any]]:
    """(line number, parsed JSON or None) for each non-blank line of a run.jsonl."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            lines.append((number, json.loads(line)))
        except (ValueError, RecursionError):  # not JSON, or nested deeper than the parser goes
            lines.append((number, None))
    return lines


def skipped_lines_note(path: Path) -> str | None:
    """One line for `autopar run`'s output when run.jsonl holds lines that are not records."""
    broken = unreadable_lines(path)
    if not broken:
        return None
    shown = ", ".join(map(str, broken[:5])) + (f" and {len(broken) - 5} more" if len(broken) > 5 else "")
    return (f"note: {path.name} line{'s' if len(broken) > 1 else ''} {shown} {'are' if len(broken) > 1 else 'is'} "
            "not a JSON record (a run killed while writing it?); skipped")


@contextlib.contextmanager
def folder_lock(out_dir: Path):
    """Hold ``out_dir``'s run lock, or refuse at once naming the process that holds it. The
    lock's file descriptor is yielded so the launched processes can hold it too: a run whose
    CLI was killed keeps the folder until its ranks are gone (they end with it, lifeline.py).
    A lock file nobody holds (its run ended) is taken over and gets this process's pid."""
    path = out_dir / LOCK_NAME
    fd = open_no_follow(path, os.O_RDWR | os.O_CREAT)  # a link there is refused, never truncated
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise UserError(f"{out_dir} is being run by another `autopar run` (pid {holder}); two runs of one "
                            "folder would interleave run.jsonl and overwrite each other's checkpoints.",
                            f"wait for it to end (or stop it: kill {holder}), or run a copy of the folder.") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield fd
    finally:
        os.close(fd)


def run_local(out_dir: str | Path, nproc: int | None = None, steps: int | None = None, *,
              extra_args: Sequence[str] = (), echo: bool = False, timeout_s: float | None = None,
              env: dict[str, str] | None = None, max_restarts: int = 0,
              runner: Sequence[str] = (), init_from: str | Path | None = None,
              export: str | Path | None = None, on_line: Callable[[str], None] | None = None) -> RunResult:
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
        init_from: weights to start from (the module's ``--init-from``: a .safetensors file, a
            Hugging Face model folder, a torch state dict file).
        export: where the module writes the trained weights (its ``--export``: a file, or a
            folder for a path without suffix).
        on_line: called with each line of the ranks' output as it comes (a progress display).

    Raises:
        UserError: another run holds the folder.
    """
    out_dir = Path(out_dir).resolve()  # the ranks run inside it
    script = find_script(out_dir)
    if nproc is None:
        from autopar.runtime.run_settings import launch_plan

        nproc = launch_plan(out_dir).world_size
    log = out_dir / LOG_NAME
    # What the run writes into the folder, never through a link (the module refuses them too, but
    # only once its ranks have started).
    for written in (log, out_dir / LOCK_NAME, out_dir / "checkpoints", out_dir / "tensorboard"):
        refuse_link(written)
    with folder_lock(out_dir) as lock_fd:
        # torchrun's own logs and error files, otherwise left in /tmp/torchelastic_* after every run
        logs = Path(tempfile.mkdtemp(prefix="autopar-torchrun-"))
        try:
            before = len(read_records(log))
            # torchrun with its rendezvous store on 127.0.0.1 at a free port (a taken port cannot hang the run)
            command = [sys.executable, "-m", "autopar.runtime.loopback", *torchrun_arguments(nproc),
                       f"--log-dir={logs}", f"--max-restarts={max_restarts}", *runner, str(script),
                       "--log-file", str(log)]
            if steps is not None:
                command += ["--steps", str(steps)]
            # Absolute: the ranks run inside out_dir, a relative path names the caller's folder.
            command += [item for option, path in (("--init-from", init_from), ("--export", export)) if path is not None
                        for item in (option, str(Path(path).resolve()))]
            command += list(extra_args)
            base = env if env is not None else os.environ
            # A fresh store per restart (see launch.py), loopback only; a caller's setting wins.
            environment = {**STORE_PER_ATTEMPT_ENV, **LOOPBACK_ENV, **base}
            output, returncode = _launch(command, out_dir, environment, echo, timeout_s, lock_fd, on_line)
        finally:
            shutil.rmtree(logs, ignore_errors=True)
    result = RunResult(returncode=returncode, records=read_records(log)[before:], output=output,
                       warnings=re.findall(r"^(?:\[rank\d+\]:)?(warning: .*)$", output, re.M))
    note = skipped_lines_note(log)
    if note is not None:
        result.warnings.append(note)
    if returncode != 0 and returncode != 124 and finished_everywhere(output, nproc):
        result.teardown_failure, result.returncode = returncode, 0
    elif returncode != 0:
        result.failed_rank, result.error = failing_rank(output)
    return result


def _launch(command: list[str], cwd: Path, env: dict[str, str], echo: bool, timeout_s: float | None,
            lock_fd: int, on_line: Callable[[str], None] | None = None) -> tuple[str, int]:
    """Run torchrun, collecting (and with ``echo`` printing, and to ``on_line`` passing) its
    output; (output, exit status)."""
    lines: list[str] = []
    from autopar.runtime.lifeline import child_environment

    # torchrun dies with this process, even by SIGKILL (lifeline.py), and stops its ranks then.
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=child_environment(env), pass_fds=(lock_fd,))
    assert process.stdout is not None  # stdout=PIPE
    try:
        for line in process.stdout:
            lines.append(line)
            if echo:
                print(line, end="", flush=True)
            if on_line is not None:
                on_line(line)
        returncode = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        returncode = 124
    except BaseException:  # Ctrl-C: stop the ranks before releasing the folder
        process.terminate()
        process.wait()
        raise
    return "".join(lines), returncode


def finished_everywhere(output: str, nproc: int) -> bool:
    """Whether every rank of one attempt said it finished (trained, saved, exported)."""
    done: dict[str, set[int]] = {}
    for rank, world, attempt in re.findall(rf"{re.escape(FINISHED_MARKER)} rank (\d+) of (\d+) attempt (\d+)",
                                           output):
        if int(world) == nproc:
            done.setdefault(attempt, set()).add(int(rank))
    return any(len(ranks) == nproc for ranks in done.values())


_BLOCK = re.compile(r"^\[\d+\]:\n(.*?)(?=^\[\d+\]:\n|^-{10,}|^={10,}|\Z)", re.S | re.M)
_RANK = re.compile(r"rank\s*:\s*(\d+)")
_FATAL = "Fatal Python error"  # how faulthandler starts the stack of a rank killed by a signal


def failing_rank(output: str) -> tuple[int | None, str]:
    """(rank, error text) of the failure that caused the others, or the output's tail.

    torchrun names the earliest failure its root cause, but when one rank raises, its peers
    often fail first, inside a collective the dead rank no longer answers; so a failure that
    is only such a consequence is passed over while another rank has a cause of its own."""
    report = output[output.find("Failures:"):] if "Failures:" in output else output
    blocks = [block.strip() for block in _BLOCK.findall(report) if _RANK.search(block)]
    if blocks:
        causes = [b for b in blocks if not any(symptom in b for symptom in PEER_GONE)]
        block = (causes or blocks)[0]
        if "Signal" in block and _FATAL in output:  # died in C++: add the stack its faulthandler printed
            stack = output[output.find(_FATAL):]
            block += "\n" + "\n".join(stack.splitlines()[:40])
        elif "Traceback" not in block:
            # No traceback recorded (the file failed before `record` could wrap main, e.g. a
            # syntax error): the ranks' last lines hold the cause.
            block += "\nlast lines of the ranks' output:\n" + last_lines(output)
        rank = _RANK.search(block)
        assert rank is not None  # the blocks were chosen by it
        return int(rank.group(1)), block
    ranked = re.findall(r"^\[rank(\d+)\]:.*$", output, re.M)
    return (int(ranked[0]) if ranked else None), last_lines(output)


def last_lines(output: str, count: int = 30) -> str:
    """The last ``count`` lines the ranks printed, before torchrun's own failure report (its
    traceback ending in ChildFailedError, then the table of failures)."""
    end = output.find("ChildFailedError")
    if end < 0:
        end = output.find("Failures:")
    if end >= 0:
        traceback = output.rfind("Traceback (most recent call last):", 0, end)
        end = traceback if traceback >= 0 else end
    ranks = output[:end] if end >= 0 else output
    return "\n".join(ranks.strip().splitlines()[-count:])

"""Interrupted work: what `autopar run` says without --echo when a run changes course, and what
a signal to the CLI leaves behind (nothing: exit 130 on Ctrl-C, 143 on SIGTERM, and torchrun
and its ranks die with a CLI killed by SIGKILL, so the folder's lock is free again).

Each test starts 2 gloo ranks of a tiny GPT, or a compile that does (its proof).
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import autopar.runtime as runtime
from autopar.cli import main as autopar_main
from autopar.codegen import generate
from autopar.runtime.local import LOCK_NAME, LOG_NAME
from tests.dist.plans import GPT, REPO, make_plan
from tests.tiers import EXTENDED, tiered

pytestmark = pytest.mark.slow  # 3 to 4 minutes on a busy 2-core machine


@pytest.fixture(scope="module")
def dp2(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("interrupts") / "dp2"
    generate(make_plan(GPT, dp=2), GPT.path, folder)
    return folder


# A rank killed, torchrun's restart and the resume run by default in test_data_resume.py (held to the
# uninterrupted run's samples and parameters); a checkpoint failing its checksum is skipped by default in
# test_run_safety.py; the lines run prints for those events, test_progress.py.
@EXTENDED
def test_run_says_a_rank_death_its_restart_a_resume_and_a_skipped_checkpoint(dp2, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "dp2"
    shutil.copytree(dp2, folder)
    launch = runtime.run_local

    def failing_at_step_3(*args, **kwargs):  # the module's fault injection: the last rank SIGKILLs itself
        return launch(*args, **{**kwargs, "extra_args": [*kwargs["extra_args"], "--fail-at-step", "3"]})

    monkeypatch.setattr(runtime, "run_local", failing_at_step_3)
    assert autopar_main(["run", str(folder), "--steps", "6", "--checkpoint-every", "2", "--max-restarts", "1"]) == 0
    out = capsys.readouterr().out
    # torchrun names rank 1 (SIGKILL) or, under load, rank 0, whose collective failed first
    # (RunEvents then names rank 1 as the cause): either way the line blames rank 1.
    assert re.search(r"rank 1 died (\(signal SIGKILL\)|without an error of its own .*?); torchrun restarts "
                     r"every rank \(restart 1 of 1\)", out), out
    assert f"resumed from step 2 (checkpoint {folder / 'checkpoints' / 'step_2'})" in out
    monkeypatch.setattr(runtime, "run_local", launch)
    shard = sorted((folder / "checkpoints" / "step_6").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:-7])
    assert autopar_main(["run", str(folder), "--steps", "8", "--checkpoint-every", "2"]) == 0
    out = capsys.readouterr().out
    assert f"skipped checkpoint {folder / 'checkpoints' / 'step_6'}: {shard} does not match its checksum" in out
    assert f"resumed from step 4 (checkpoint {folder / 'checkpoints' / 'step_4'})" in out


def _signal_masks(pid: int) -> str:
    """The signals ``pid`` blocks, ignores and catches, as /proc writes them (for a failure's message)."""
    try:
        return " ".join(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                        if line.startswith(("SigBlk", "SigIgn", "SigCgt")))
    except OSError:
        return "(gone)"


def _session(sid: int) -> list[int]:
    """The processes of session ``sid`` still alive (zombies are dead: they only await their reaping)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields[3]: session id, fields[0]: state
            alive.append(int(entry.name))
    return alive


def _start(command: list[str], tmp_path: Path) -> subprocess.Popen:
    """``python -m autopar.cli ...`` in a session of its own, with a fresh TMPDIR, output to a file."""
    temp = tmp_path / "tmp"
    temp.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(temp)}
    return subprocess.Popen([sys.executable, "-m", "autopar.cli", *command], cwd=tmp_path, env=env,
                            stdout=(tmp_path / "cli.out").open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=_as_from_a_terminal)


def _as_from_a_terminal() -> None:
    """SIGINT with its default action and unblocked, as a shell starts a foreground command: a
    child inherits both from this test process, whose state earlier tests in the same worker may
    have changed (the compile test got neither signal twice in full suite runs, never alone)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _steps_logged(folder: Path) -> int:
    log = folder / LOG_NAME
    return log.read_text().count('"loss"') if log.exists() else 0


def _leftovers(tmp_path: Path) -> list[str]:
    """What a command left in its TMPDIR (torch's compile cache aside)."""
    return sorted(p.name for p in (tmp_path / "tmp").iterdir() if not p.name.startswith("torchinductor"))


@pytest.mark.parametrize("sent", tiered([signal.SIGKILL, signal.SIGTERM], default=[signal.SIGTERM],
                                        ids=["SIGKILL", "SIGTERM"]))
def test_ranks_die_with_the_cli_and_the_folder_is_free_again(dp2, tmp_path, sent):
    """The CLI killed mid-run (SIGKILL: no clean-up of its own; SIGTERM: handled like Ctrl-C,
    exit 143): torchrun and both ranks end within seconds, no restart is spent, and the next run
    of the folder takes the lock."""
    folder = tmp_path / "dp2"
    shutil.copytree(dp2, folder)
    cli = _start(["run", str(folder), "--steps", "100000", "--max-restarts", "2"], tmp_path)
    try:
        _wait_for(lambda: _steps_logged(folder) >= 2, 120, "two steps")
        cli.send_signal(sent)
        _wait_for(lambda: cli.poll() is not None, 60, "the CLI to end")
        _wait_for(lambda: not _session(cli.pid), 30, "torchrun and the ranks to end")
        steps = _steps_logged(folder)
        time.sleep(2)
        assert _steps_logged(folder) == steps  # nobody trains on
        assert '"attempt": 1' not in (folder / LOG_NAME).read_text()  # no restart was spent
        with (folder / LOCK_NAME).open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: raises BlockingIOError while held
        if sent == signal.SIGTERM:
            assert cli.returncode == 143, (tmp_path / "cli.out").read_text()[-3000:]
            assert _leftovers(tmp_path) == []  # torchrun's log folder removed
    finally:
        for pid in _session(cli.pid):
            os.kill(pid, signal.SIGKILL)


TINY = ["cluster=cpu_gloo", "cluster.gpus_per_node=2", "train.global_batch_size=8", "train.precision=fp32",
        "model.layers=2", "model.hidden=64", "model.heads=4", "model.seq_len=32", "model.vocab=128"]


def _proving(tmp_path: Path) -> bool:
    return "proving" in (tmp_path / "cli.out").read_text()


def _checking(tmp_path: Path) -> bool:
    """The numerical check's ranks have started (their logs exist in its folder)."""
    return any(p.name.startswith("autopar-check-") and any(p.glob("rank*.log")) for p in (tmp_path / "tmp").iterdir())


@pytest.mark.parametrize("when, group", tiered([(_proving, False), (_checking, True)], default=[(_checking, True)],
                                                 ids=["fake-step", "gloo-check"], unpack=True))
def test_ctrl_c_during_compile_exits_130_and_leaves_nothing(tmp_path, when, group):
    """Ctrl-C after CP-SAT has solved: during the fake-tensor step (SIGINT to the CLI alone) and
    during the check on gloo ranks (to its whole process group, as a terminal sends it)."""
    cli = _start(["compile", str(REPO / "examples" / "gpt.py"), *TINY, "check=on", "--out-dir", str(tmp_path / "out")],
                 tmp_path)
    try:
        _wait_for(lambda: when(tmp_path) or cli.poll() is not None, 240, when.__name__)
        assert cli.poll() is None, (tmp_path / "cli.out").read_text()[-3000:]
        masks = _signal_masks(cli.pid)
        os.killpg(cli.pid, signal.SIGINT) if group else cli.send_signal(signal.SIGINT)
        _wait_for(lambda: cli.poll() is not None, 120, "the CLI to end")
        assert cli.returncode == 130, f"{masks}\n" + (tmp_path / "cli.out").read_text()[-3000:]
        _wait_for(lambda: not _session(cli.pid), 30, "the proof's processes to end")
        assert not (tmp_path / "out").exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["cli.out", "tmp"]  # no .autopar-staging.*
        assert _leftovers(tmp_path) == []  # no autopar-check-*, autopar-ranks-*
    finally:
        for pid in _session(cli.pid):
            os.kill(pid, signal.SIGKILL)

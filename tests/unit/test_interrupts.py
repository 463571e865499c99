"""Interrupted and concurrent work, without ranks: a compile into a folder another compile holds
is refused, SIGTERM is handled like Ctrl-C (exit 143), a run lock whose holder is gone is taken
over, and calibrate checks the folder of --out before measuring."""
from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autopar.cli import main
from autopar.output_dir import writing_lock
from autopar.runtime.local import LOCK_NAME, folder_lock
from tests.unit.test_bad_input import fails
from tests.unit.test_safety import TINY

REPO = Path(__file__).resolve().parents[2]


def test_a_second_compile_into_a_held_folder_is_refused_before_planning(examples_dir, tmp_path, capsys):
    """Two compiles into one folder: the second is refused (without the lock both passed the
    checks and the one that finished last silently replaced the other's files)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    held = os.open(out, os.O_RDONLY | os.O_DIRECTORY)  # what the first compile holds
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fails(capsys, ["compile", str(examples_dir / "gpt.py"), *TINY, "check=off", "--force", "--out-dir", str(out)],
              f"{out} is being written by another `autopar compile`", "compile into another folder")
    finally:
        os.close(held)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_the_compile_lock_is_released_and_a_folder_it_made_is_removed_while_empty(tmp_path):
    out = tmp_path / "a" / "out"
    with writing_lock(out):
        assert out.is_dir()
    assert not out.exists()  # created for the compile, left empty: gone (its parent is kept)
    with writing_lock(out):
        (out / "plan.json").write_text("{}")
    with writing_lock(out):  # free again after the holder left
        assert (out / "plan.json").is_file()
    assert (out / "plan.json").is_file()  # a folder that existed is never removed


SLEEPER = textwrap.dedent("""
    import sys, time
    from autopar import cli

    def working(args, console):
        print("working", flush=True)
        try:
            time.sleep(60)
        finally:
            print("cleaned up", flush=True)
        return 0

    cli._calibrate = working  # the verb's handler, as build_parser binds it
    sys.exit(cli.main(["calibrate"]))
""")


def test_sigterm_is_handled_like_ctrl_c_and_exits_143(tmp_path):
    """SIGTERM raises where Ctrl-C would (the work's `finally` blocks run) and the CLI exits 143."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    cli = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert cli.stdout.readline() == "working\n"
        cli.send_signal(signal.SIGTERM)
        out, _ = cli.communicate(timeout=30)
    finally:
        cli.kill()
    assert cli.returncode == 143 and out == "cleaned up\n"


def test_a_run_lock_whose_holder_is_gone_is_taken_over_and_names_the_new_holder(tmp_path):
    """A lock file left by a run that ended (its pid inside, nobody holding the flock) is taken,
    and the pid recorded is the new holder's; while held, a second run is refused naming it."""
    (tmp_path / LOCK_NAME).write_text("999999999\n")
    with folder_lock(tmp_path):
        assert (tmp_path / LOCK_NAME).read_text() == f"{os.getpid()}\n"
        with pytest.raises(Exception, match=f"pid {os.getpid()}"):
            with folder_lock(tmp_path):
                pass

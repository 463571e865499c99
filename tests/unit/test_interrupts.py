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
import time
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
    assert not (tmp_path / "a").exists()  # created for the compile, left empty: gone with its parent
    with writing_lock(out):
        (out / "plan.json").write_text("{}")
    with writing_lock(out):  # free again after the holder left
        assert (out / "plan.json").is_file()
    assert (out / "plan.json").is_file()  # a folder that existed is never removed


SLEEPER = textwrap.dedent("""
    import sys, time
    from autopar import cli

    def working(args, console):
        try:
            print("working", flush=True)  # inside: a signal right after it still finds the finally
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


def _fake_measurements(monkeypatch) -> None:
    """Calibration's measurements replaced by fixed numbers (what is tested is where it writes)."""
    import cost_models.calibrate as calibration

    monkeypatch.setattr(calibration, "measure_gemm_flops", lambda n, device="cpu": 1e11)
    monkeypatch.setattr(calibration, "measure_copy_bandwidth", lambda nbytes, device="cpu": 1e10)
    monkeypatch.setattr(calibration, "measure_efficiencies", lambda *a, **k: {"elementwise": 0.5})
    monkeypatch.setattr(calibration, "measure_launch_overhead", lambda device="cpu": 1e-5)
    line = [(2.0**12, 1e-4), (2.0**20, 1e-3), (2.0**24, 1e-2)]
    monkeypatch.setattr(calibration, "measure_collectives",
                        lambda ranks, sizes, repeats: {op: line for op in calibration.COLLECTIVES})


def test_calibrate_writes_into_a_folder_it_creates_and_refuses_one_under_a_file_before_measuring(tmp_path, capsys,
                                                                                              monkeypatch):
    """--out new/hw.yaml: the folder is made (it failed with ENOENT after measuring); --out under a
    file is refused before measuring; the profile is written whole or not at all."""
    _fake_measurements(monkeypatch)
    out = tmp_path / "new" / "deeper" / "hw.yaml"
    assert main(["calibrate", "--out", str(out), "-q"]) == 0
    assert "links" in out.read_text() and sorted(p.name for p in out.parent.iterdir()) == ["hw.yaml"]
    (tmp_path / "file").write_text("mine")
    import cost_models.calibrate as calibration

    monkeypatch.setattr(calibration, "measure_gemm_flops", lambda *a, **k: pytest.fail("measured first"))
    fails(capsys, ["calibrate", "--out", str(tmp_path / "file" / "hw.yaml")], "which is a file")
    assert (tmp_path / "file").read_text() == "mine"


def test_calibrate_from_runs_writes_into_a_folder_it_creates(tmp_path, monkeypatch):
    import cost_models.feedback as feedback

    monkeypatch.setattr(feedback, "fit_time_scale", lambda runs: {"compute": 1.5})
    (tmp_path / "validate.json").write_text("{}")
    out = tmp_path / "new" / "hw.yaml"
    assert main(["calibrate", "--from", str(tmp_path / "validate.json"), "--out", str(out), "-q"]) == 0
    assert "compute: 1.5" in out.read_text()


def _listening_of(pids: set[int]) -> set[str]:
    """Local addresses (hex, as /proc/net writes them) of the TCP sockets ``pids`` listen on."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.add(fields[1].rpartition(":")[0])
    return found


def _children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.add(int(entry.name))
            except OSError:
                continue
    return found


def test_calibration_ranks_listen_on_loopback_only():
    """Every socket calibrate's processes listen on while measuring (the store, gloo's pairs) is
    bound to 127.0.0.1 (torch's default store listened on every interface)."""
    import threading

    from cost_models.calibrate import measure_collectives

    seen: set[str] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.update(_listening_of({os.getpid(), *_children(os.getpid())}))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        # a few sizes: the ranks live long enough for the watcher to see their sockets
        samples = measure_collectives(ranks=2, sizes=(2**12, 2**20, 2**22), repeats=3, ops=("all_reduce",))
    finally:
        done.set()
        watcher.join()
    assert len(samples["all_reduce"]) == 3
    assert seen and seen <= {"0100007F", "0000000000000000FFFF00000100007F"}, seen  # 127.0.0.1 (v4, v4-mapped v6)

"""`autopar run` is safe with the user's folder and machine: checkpoints are verified by checksum
and a bad one is skipped for the one before; one run per folder; options out of range are
refused before any rank starts; the cause of a failure is shown without --echo; a finished run
is not reported failed by a crash in teardown; run.jsonl tells attempts apart and no torchrun
temp folder is left behind.

Most tests need no ranks; one runs a step of 2 ranks (a folder whose model file was edited) and
one starts ranks that die at once (a syntax error). The resume past truncated checkpoints is in
test_checkpoint.py, beside the uninterrupted run it compares with.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import traceback
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from autopar.cli import main as autopar_main
from autopar.codegen import generate
from autopar.sections.checkpoint import (_FAILURES, COMPLETE, UNUSABLE, _save_failed, checkpoint_problem,
                                                 disk_full, file_digests, usable_checkpoint)
from autopar.runtime.generated import import_generated
from autopar.runtime.local import LOCK_NAME, failing_rank, finished_everywhere, folder_lock, run_local
from tests.dist.plans import GPT, make_plan
from tests.sockets import LOOPBACK_HEX, listening_addresses
from tests.tiers import EXTENDED


def _checkpoint(root: Path, step: int) -> Path:
    """A complete checkpoint folder as rank 0 marks it: DCP's files (written in this process),
    then COMPLETE with their sha256."""
    folder = root / f"step_{step}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP saving in one process
        dcp.save({"train.step": torch.tensor(step), "model.w": torch.ones(4 * step)}, checkpoint_id=folder,
                 no_dist=True)
    (folder / COMPLETE).write_text(json.dumps({"step": step, "sha256": file_digests(folder)}))
    return folder


def test_truncated_checkpoint_is_skipped_for_the_previous_complete_one(tmp_path, capsys):
    _checkpoint(tmp_path, 2)
    newest = _checkpoint(tmp_path, 4)
    (newest / "__0_0.distcp").write_bytes(b"b" * 50)
    assert usable_checkpoint(tmp_path) == (2, tmp_path / "step_2")
    assert f"skipping checkpoint {newest}: {newest / '__0_0.distcp'} does not match" in capsys.readouterr().out
    (newest / "__0_0.distcp").unlink()
    assert checkpoint_problem(newest) == f"{newest / '__0_0.distcp'} is missing"


def test_no_usable_checkpoint_fails_with_the_cause_unless_a_fresh_start_is_allowed(tmp_path):
    only = _checkpoint(tmp_path, 2)
    (only / ".metadata").write_bytes(b"x")
    with pytest.raises(RuntimeError, match=r"no usable checkpoint .*step_2/\.metadata does not match.*"
                                           r"--allow-fresh-start"):
        usable_checkpoint(tmp_path)
    assert usable_checkpoint(tmp_path, allow_fresh_start=True) is None
    assert usable_checkpoint(tmp_path / "none") is None  # nothing to resume: a first run, not an error


def test_checkpoint_that_failed_to_load_is_not_tried_again(tmp_path):
    """--max-restarts must not loop on one bad checkpoint: a failed load marks it UNUSABLE."""
    _checkpoint(tmp_path, 2)
    bad = _checkpoint(tmp_path, 4)
    (bad / UNUSABLE).write_text("CheckpointException: size mismatch\n")
    assert usable_checkpoint(tmp_path) == (2, tmp_path / "step_2")


def test_full_disk_while_saving_is_named(tmp_path):
    """DCP reports a rank's ENOSPC inside its CheckpointException (a BaseException: the save must
    catch it explicitly); the error raised instead names ENOSPC and the folder."""
    failure = CheckpointException("write failed", {0: (OSError(errno.ENOSPC, "No space left on device"),
                                                        traceback.StackSummary())})
    assert isinstance(failure, _FAILURES) and not isinstance(failure, Exception)
    assert disk_full(failure) and not disk_full(RuntimeError("size mismatch"))
    error = _save_failed(tmp_path / "step_4", failure)
    assert error.errno == errno.ENOSPC and "ENOSPC" in str(error) and str(tmp_path / "step_4") in str(error)


@pytest.mark.parametrize("option, value, bound", [("--steps", "-1", ">= 1"), ("--checkpoint-every", "0", ">= 1"),
                                                  ("--max-restarts", "-1", ">= 0")])
def test_out_of_range_run_options_are_refused_before_any_rank_starts(tmp_path, capsys, option, value, bound):
    assert autopar_main(["run", str(tmp_path), option, value]) == 1  # no plan.json needed: refused first
    assert f"{option} {value} is out of range: it must be an integer {bound}" in capsys.readouterr().err


@pytest.fixture(scope="module")
def dp2(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("safety") / "dp2"
    generate(make_plan(GPT, dp=2), GPT.path, folder)
    return folder


def test_second_run_of_a_folder_is_refused_naming_the_pid(dp2, capsys):
    with folder_lock(dp2):
        assert autopar_main(["run", str(dp2), "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert "is being run by another `autopar run` (pid" in err and str(os.getpid()) in err
    with folder_lock(dp2):  # released when the holder ends: the next run takes it
        assert (dp2 / LOCK_NAME).is_file()


def test_syntax_error_in_the_generated_file_is_shown_without_echo(dp2, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(dp2, broken)
    script = broken / "parallel_gpt.py"
    script.write_text(script.read_text() + "\ndef oops(:\n")
    assert autopar_main(["run", str(broken), "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert "SyntaxError" in err and "def oops(:" in err


def test_edited_model_file_warns_without_echo_and_records_carry_the_attempt(dp2, tmp_path, capsys,
                                                                          monkeypatch):
    edited = tmp_path / "edited"
    shutil.copytree(dp2, edited)
    (edited / "gpt.py").write_text((edited / "gpt.py").read_text() + "\n# edited after planning\n")
    temp = tmp_path / "temp"  # torchrun's temp folders would go here (other runs use /tmp meanwhile)
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    assert autopar_main(["run", str(edited), "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "changed since the plan was made" in out
    [record] = [json.loads(line) for line in (edited / "run.jsonl").read_text().splitlines()]
    assert record["attempt"] == 0 and record["run_id"]
    assert not list(temp.glob("torchelastic_*"))  # torchrun's logs went to a folder the run removed


def test_finished_run_with_a_rank_killed_in_teardown_counts_as_finished():
    said = "rank-finished: rank {} of 2 attempt {}\n"
    # both ranks finished in attempt 1 (attempt 0 lost rank 1), then one died by SIGABRT
    output = said.format(0, 0) + said.format(0, 1) + said.format(1, 1) + "Signal 6 (SIGABRT) received by PID 7\n"
    assert finished_everywhere(output, 2)
    assert not finished_everywhere(said.format(0, 0) + said.format(1, 1), 2)  # never both in one attempt
    assert not finished_everywhere(said.format(0, 0), 2)


def test_failure_without_a_traceback_shows_the_ranks_last_lines():
    output = ("[rank1]: ValueError: the batch is empty\n"
              "Traceback (most recent call last):\n  File \"torch/distributed/run.py\"\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
              "Failures:\n  <NO_OTHER_FAILURES>\n-----\nRoot Cause (first observed failure):\n[0]:\n"
              "  rank      : 1 (local_rank: 1)\n  traceback : To enable traceback see: https://pytorch.org\n=====\n")
    rank, error = failing_rank(output)
    assert rank == 1 and "ValueError: the batch is empty" in error and "run.py" not in error


def test_launch_script_with_its_port_taken_fails_at_once(dp2):
    """launch.sh on one node, RDZV_PORT given and held by another program: torchrun would wait on
    that program; the script says so and exits 1 before starting anything."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        run = subprocess.run(["bash", "launch.sh", "--steps", "1"], cwd=dp2, capture_output=True, text=True,
                             env=dict(os.environ, RDZV_PORT=str(port)), timeout=60)
    assert run.returncode == 1
    assert f"port {port} on 127.0.0.1 is taken by another program" in run.stderr


def test_rank_zero_store_listens_on_loopback_only(dp2, monkeypatch):
    """The generated module's join: with MASTER_ADDR 127.0.0.1, rank 0's store is bound there (one
    rank in this process: a group of one)."""
    module = import_generated(dp2 / "parallel_gpt.py", "generated_loopback_join")
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    module.join_process_group("gloo")
    try:
        assert listening_addresses(port) == {LOOPBACK_HEX}
    finally:
        dist.destroy_process_group()


@EXTENDED  # its reading of the output runs by default (test_finished_run_with_a_rank_killed_in_teardown_...)
def test_rank_aborting_after_it_finished_does_not_fail_the_run(tmp_path):
    """Two ranks say they finished, then rank 1 dies by SIGABRT (as gloo's teardown sometimes
    does on a loaded CPU): the run is finished, with the abort noted; without the marker it fails."""
    (tmp_path / "parallel_stub.py").write_text(
        "import os, signal\n"
        "rank = int(os.environ['RANK'])\n"
        "if 'SAY_FINISHED' in os.environ:\n"
        "    print(f'rank-finished: rank {rank} of 2 attempt 0', flush=True)\n"
        "if rank == 1:\n"
        "    os.kill(os.getpid(), signal.SIGABRT)\n")
    finished = run_local(tmp_path, nproc=2, env=dict(os.environ, SAY_FINISHED="1"), timeout_s=120)
    assert finished.ok and finished.teardown_failure not in (None, 0)
    failed = run_local(tmp_path, nproc=2, timeout_s=120)
    assert not failed.ok and failed.failed_rank == 1 and "SIGABRT" in failed.error

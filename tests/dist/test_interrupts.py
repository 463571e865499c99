"""Interrupted work: what `autopar run` says without --echo when a run changes course, and what
a signal to the CLI leaves behind (nothing: exit 130 on Ctrl-C, 143 on SIGTERM, and torchrun
and its ranks die with a CLI killed by SIGKILL, so the folder's lock is free again).

Each test starts 2 gloo ranks of a tiny GPT, or a compile that does (its proof).
"""
from __future__ import annotations

import fcntl
import os
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


@pytest.fixture(scope="module")
def dp2(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("interrupts") / "dp2"
    generate(make_plan(GPT, dp=2), GPT.path, folder)
    return folder


def test_run_says_a_rank_death_its_restart_a_resume_and_a_skipped_checkpoint(dp2, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "dp2"
    shutil.copytree(dp2, folder)
    launch = runtime.run_local

    def failing_at_step_3(*args, **kwargs):  # the module's fault injection: the last rank SIGKILLs itself
        return launch(*args, **{**kwargs, "extra_args": [*kwargs["extra_args"], "--fail-at-step", "3"]})

    monkeypatch.setattr(runtime, "run_local", failing_at_step_3)
    assert autopar_main(["run", str(folder), "--steps", "6", "--checkpoint-every", "2", "--max-restarts", "1"]) == 0
    out = capsys.readouterr().out
    assert "rank 1 died (signal SIGKILL); torchrun restarts every rank (restart 1 of 1)" in out
    assert f"resumed from step 2 (checkpoint {folder / 'checkpoints' / 'step_2'})" in out
    monkeypatch.setattr(runtime, "run_local", launch)
    shard = sorted((folder / "checkpoints" / "step_6").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:-7])
    assert autopar_main(["run", str(folder), "--steps", "8", "--checkpoint-every", "2"]) == 0
    out = capsys.readouterr().out
    assert f"skipped checkpoint {folder / 'checkpoints' / 'step_6'}: {shard} does not match its checksum" in out
    assert f"resumed from step 4 (checkpoint {folder / 'checkpoints' / 'step_4'})" in out

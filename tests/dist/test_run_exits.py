"""`autopar run` after a run killed while writing run.jsonl: the half-written last line used to make
every later run of the folder fail with an internal error (exit 2)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopar.cli import main
from autopar.codegen import generate
from tests.dist.plans import GPT, make_plan


@pytest.fixture(scope="module")
def dp2(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("exits") / "dp2"
    generate(make_plan(GPT, dp=2), GPT.path, folder)
    return folder


def test_run_after_a_truncated_record_goes_on_and_says_so(dp2, capsys):
    log = dp2 / "run.jsonl"
    log.write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "lo')
    assert main(["run", str(dp2), "--steps", "1"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "note: run.jsonl line 2 is not a JSON record (a run killed while writing it?); skipped" in out
    assert "appended 1 records" in out
    lines = log.read_text().splitlines()
    assert lines[:2] == ['{"step": 1, "loss": 5.0}', '{"step": 2, "lo']
    [record] = [json.loads(line) for line in lines[2:]]
    assert record["step"] == 0 and isinstance(record["loss"], float)

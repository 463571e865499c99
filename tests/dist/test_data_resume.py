"""Resumable to the sample: a run on a text corpus killed and resumed, and resumed again from a
checkpoint a resumed run wrote, sees the samples an uninterrupted run sees and ends with its
parameters; a checkpoint resumed under another plan continues the same global sample order.

Every run trains the byte-level tiny GPT on a corpus (the json package's sources) for 6 steps on
2 gloo ranks launched by torchrun (`run_local`: each rank reads ahead in a DataLoader worker),
checkpointing every 2 steps. Tolerances: a run resumed under the same plan repeats the same
floating-point operations in the same order, so its losses and final parameters must be
identical; under another plan (TP2 instead of DP2) only the order of sums changes (rtol 1e-5 on
losses, as in test_equivalence.py).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from autopar.codegen import generate
from autopar.runtime import RunResult, run_local
from tests.dist.plans import make_plan
from tests.dist.test_training_data import BYTE_GPT, corpus

pytestmark = pytest.mark.slow

STEPS, EVERY, FAIL_AT = 6, 2, 3


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("resume")
    found = {"corpus": corpus(root)}
    for name, pins in {"dp2": dict(dp=2), "again_dp2": dict(dp=2), "tp2": dict(tp=2)}.items():
        generate(make_plan(BYTE_GPT, **pins), BYTE_GPT.path, root / name, model_kwargs=BYTE_GPT.kwargs)
        found[name] = root / name
    return found


def train(folder: Path, text: Path, steps: int, *extra: str, max_restarts: int = 0) -> RunResult:
    result = run_local(folder, steps=steps, max_restarts=max_restarts, timeout_s=300,
                       extra_args=["--data", f"path={text}", "--checkpoint-every", str(EVERY),
                                   # the schedule of a 6-step run, whatever --steps this launch has
                                   "--decay-steps", str(STEPS),
                                   "--save-final", str(folder / "final.pt"), *extra])
    assert result.ok, result.error
    return result


def last_per_step(records: list[dict]) -> dict[int, dict]:
    """Each step's record from the attempt that went on past it (a restart repeats steps)."""
    return {r["step"]: r for r in records if "loss" in r}


@pytest.fixture(scope="module")
def uninterrupted(folders) -> dict[int, dict]:
    result = train(folders["dp2"], folders["corpus"], STEPS)
    records = last_per_step(result.records)
    assert sorted(records) == list(range(STEPS))
    return records


def test_killed_and_resumed_twice_sees_the_same_samples_and_ends_the_same(folders, uninterrupted):
    folder = folders["again_dp2"]
    # A rank is killed at step 3; torchrun restarts both, and they resume from step_2.
    first = train(folder, folders["corpus"], 4, "--fail-at-step", str(FAIL_AT), max_restarts=1)
    assert "resumed from" in first.output and "step_2 (2 steps done)" in first.output
    # Started again, the run resumes from step_4, which the restarted attempt wrote.
    second = train(folder, folders["corpus"], STEPS)
    assert "step_4 (4 steps done)" in second.output
    resumed = last_per_step(first.records + second.records)
    assert sorted(resumed) == list(range(STEPS))
    for step, record in uninterrupted.items():
        assert resumed[step]["samples"] == record["samples"] == 8 * (step + 1)
        assert resumed[step]["loss"] == record["loss"], f"step {step}"
    final = torch.load(folder / "final.pt")
    for name, value in torch.load(folders["dp2"] / "final.pt").items():
        assert torch.equal(final[name], value), name


def test_resumed_under_another_plan_continues_the_sample_order(folders, uninterrupted):
    folder = folders["tp2"]
    shutil.copytree(folders["dp2"] / "checkpoints" / "step_4", folder / "checkpoints" / "step_4")
    result = train(folder, folders["corpus"], STEPS)
    assert "step_4 (4 steps done)" in result.output
    resumed = last_per_step(result.records)
    assert sorted(resumed) == [4, 5]
    for step in (4, 5):
        assert resumed[step]["samples"] == uninterrupted[step]["samples"]
        assert resumed[step]["loss"] == pytest.approx(uninterrupted[step]["loss"], rel=1e-5)
    final = torch.load(folder / "final.pt")
    for name, value in torch.load(folders["dp2"] / "final.pt").items():
        torch.testing.assert_close(final[name], value, rtol=1e-4, atol=1e-5)

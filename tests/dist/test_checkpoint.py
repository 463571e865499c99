"""Checkpoints of the generated module: a killed rank is restarted by torchrun and training
resumes exactly where it was; a checkpoint written under one plan loads under another; a
half-written checkpoint is never resumed from; the export holds the trained weights.

Every run trains the tiny GPT (tests/dist/plans.py) for 8 steps on 4 gloo ranks launched by
torchrun (`run_local`), checkpointing every 2 steps, and is compared with one uninterrupted DP4
run. Tolerances: a run resumed under the same plan repeats the same floating-point operations in
the same order, so its losses and final parameters must be identical; under another plan
(TP2 x DP2) only the order of sums changes, so losses agree to rtol 1e-5 as in
test_equivalence.py.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from autopar.cli import main as autopar_main
from autopar.codegen import generate
from autopar.sections.checkpoint import COMPLETE, latest_checkpoint
from autopar.runtime import RunResult, run_local
from autopar.runtime.generated import import_generated
from tests.dist.plans import GPT, make_plan
from tests.tiers import EXTENDED

pytestmark = pytest.mark.slow

STEPS, EVERY, FAIL_AT = 8, 2, 5


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoint")
    folders = {}
    for name, pins in {"dp4": dict(dp=4), "tp2_dp2": dict(dp=2, tp=2)}.items():
        generate(make_plan(GPT, **pins), GPT.path, root / name)
        folders[name] = root / name
    return folders


def train(folder: Path, checkpoints: Path, *extra: str, max_restarts: int = 0) -> RunResult:
    """8 steps of ``folder``'s module, checkpointing into ``checkpoints`` (resuming from it)."""
    result = run_local(folder, steps=STEPS, max_restarts=max_restarts, timeout_s=300,
                       extra_args=["--checkpoint-dir", str(checkpoints), "--checkpoint-every", str(EVERY), *extra])
    assert result.ok, result.error
    return result


@pytest.fixture(scope="module")
def uninterrupted(compiled) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """The reference: DP4 from scratch to the end (losses by step, final parameters), exporting."""
    folder = compiled["dp4"]
    result = train(folder, folder / "checkpoints", "--save-final", str(folder / "final.pt"),
                   "--export", str(folder / "export.pt"))
    assert [r["step"] for r in result.records] == list(range(STEPS))
    return {r["step"]: r["loss"] for r in result.records}, torch.load(folder / "final.pt")


@EXTENDED
def test_killed_rank_is_restarted_and_training_resumes_exactly(compiled, uninterrupted, tmp_path):
    """The last rank dies by SIGKILL when it starts step 5; torchrun restarts all four, which
    resume from the latest complete (asynchronously written) checkpoint and finish."""
    losses, parameters = uninterrupted
    result = train(compiled["dp4"], tmp_path / "checkpoints", "--async-checkpoint", "--fail-at-step", str(FAIL_AT),
                   "--save-final", str(tmp_path / "final.pt"), max_restarts=1)
    # Step 4's checkpoint may still have been in the writer's hands when the rank died.
    match = re.search(r"resumed from (\S+)step_(\d+) ", result.output)
    assert match and Path(match.group(1)) == tmp_path / "checkpoints"  # the folder was empty before this run
    resumed = int(match.group(2))
    assert resumed in (FAIL_AT - 1, FAIL_AT - 3)
    first, second = result.records[:-(STEPS - resumed)], result.records[-(STEPS - resumed):]
    assert [r["step"] for r in first] == list(range(len(first))) and resumed <= len(first) <= FAIL_AT
    assert [r["step"] for r in second] == list(range(resumed, STEPS))
    assert [r["loss"] for r in second] == [losses[s] for s in range(resumed, STEPS)]
    final = torch.load(tmp_path / "final.pt")
    assert final.keys() == parameters.keys()
    assert all(torch.equal(final[name], parameters[name]) for name in parameters)


@pytest.fixture(scope="module")
def resharded(compiled, uninterrupted, tmp_path_factory) -> tuple[RunResult, Path]:
    """TP2 x DP2 resuming from the DP4 run's step-4 checkpoint, beside a step-6 folder cut off
    while being written (no COMPLETE, no metadata, a shard file truncated)."""
    source = compiled["dp4"] / "checkpoints"
    checkpoints = tmp_path_factory.mktemp("resharded") / "checkpoints"
    shutil.copytree(source / "step_4", checkpoints / "step_4")
    half = checkpoints / "step_6"
    shutil.copytree(source / "step_6", half)
    (half / COMPLETE).unlink()
    (half / ".metadata").unlink()
    shard = sorted(half.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return train(compiled["tp2_dp2"], checkpoints), checkpoints


@EXTENDED
def test_dp4_checkpoint_loads_under_tp2_dp2_and_training_continues_alike(uninterrupted, resharded):
    losses, _ = uninterrupted
    result, checkpoints = resharded
    assert f"resumed from {checkpoints / 'step_4'}" in result.output
    assert [r["step"] for r in result.records] == list(range(4, STEPS))
    assert [r["loss"] for r in result.records] == pytest.approx([losses[s] for s in range(4, STEPS)], rel=1e-5)


@EXTENDED
def test_half_written_checkpoint_is_never_resumed_from(resharded):
    result, checkpoints = resharded
    assert result.records[0]["step"] == 4  # not 6
    assert latest_checkpoint(checkpoints) == (STEPS, checkpoints / f"step_{STEPS}")
    assert (checkpoints / "step_6" / COMPLETE).is_file()  # written again, whole, by the resumed run


def test_latest_checkpoint_is_the_complete_one_with_most_steps(tmp_path):
    for step, complete in ((2, True), (10, True), (12, False)):
        (tmp_path / f"step_{step}").mkdir()
        if complete:
            (tmp_path / f"step_{step}" / COMPLETE).write_text("{}")
    (tmp_path / "step_x").mkdir()
    assert latest_checkpoint(tmp_path) == (10, tmp_path / "step_10")
    assert latest_checkpoint(tmp_path / "missing") is None


def test_export_holds_the_gathered_parameters(compiled, uninterrupted):
    _, parameters = uninterrupted
    exported = torch.load(compiled["dp4"] / "export.pt")
    assert exported.keys() == parameters.keys()
    assert all(torch.equal(exported[name], parameters[name]) for name in parameters)


def test_export_without_torchrun_consolidates_the_latest_checkpoint(compiled, uninterrupted, tmp_path, monkeypatch):
    safetensors = pytest.importorskip("safetensors.torch")
    _, parameters = uninterrupted
    monkeypatch.delenv("RANK", raising=False)
    module = import_generated(compiled["dp4"] / "parallel_gpt.py", "generated_checkpoint_export")
    module.main(["--checkpoint-dir", str(compiled["dp4"] / "checkpoints"),
                 "--export", str(tmp_path / "gpt.safetensors")])
    exported = safetensors.load_file(tmp_path / "gpt.safetensors")
    assert exported.keys() == parameters.keys()
    assert all(torch.equal(exported[name], parameters[name]) for name in parameters)


def test_autopar_run_passes_restarts_and_checkpoints_on(compiled, monkeypatch):
    import autopar.runtime as runtime

    calls = []
    monkeypatch.setattr(runtime, "run_local", lambda *args, **kwargs: calls.append(kwargs) or RunResult(0))
    assert autopar_main(["run", str(compiled["dp4"]), "--max-restarts", "2", "--checkpoint-every", "5", "-q"]) == 0
    assert calls[0]["max_restarts"] == 2 and calls[0]["extra_args"] == ["--checkpoint-every", "5"]


@EXTENDED  # by default: skipping (test_interrupts, test_run_safety) and exact resumes (test_api, test_data_resume)
def test_resume_skips_truncated_checkpoints_and_ends_with_the_uninterrupted_parameters(compiled, uninterrupted,
                                                                                       tmp_path):
    """The DP4 run's checkpoints with step_8 and step_6 truncated: the run resumes from step_4 and
    its final parameters are exactly the uninterrupted run's."""
    _, parameters = uninterrupted
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(compiled["dp4"] / "checkpoints", checkpoints)
    for step in (STEPS, STEPS - 2):
        shard = sorted((checkpoints / f"step_{step}").glob("*.distcp"))[-1]
        shard.write_bytes(shard.read_bytes()[:-7])
    result = train(compiled["dp4"], checkpoints, "--save-final", str(tmp_path / "final.pt"))
    assert f"skipping checkpoint {checkpoints / f'step_{STEPS}'}" in result.output
    assert f"resumed from {checkpoints / 'step_4'} " in result.output
    assert [r["step"] for r in result.records] == list(range(4, STEPS))
    final = torch.load(tmp_path / "final.pt")
    assert all(torch.equal(final[name], parameters[name]) for name in parameters)

"""A folder or checkpoint received from someone else: `autopar run` never writes through a link
it holds (the run lock, run.jsonl, a checkpoint folder), a crafted checkpoint runs no code, and
a renamed checkpoint resumes at the step stored in it. Every run is the tiny GPT on 2 gloo ranks
for 6 steps, checkpointing every 2, compared with one uninterrupted run of the same plan: a run
resumed under one plan repeats the same operations, so its final parameters must be identical."""
from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from autopar.cli import main as autopar_main
from autopar.codegen import generate
from autopar.sections.checkpoint import COMPLETE, file_digests
from autopar.runtime import RunResult, run_local
from autopar.runtime.local import LOCK_NAME
from tests.dist.plans import GPT, make_plan
from tests.tiers import EXTENDED

pytestmark = pytest.mark.slow

STEPS, EVERY = 6, 2
METADATA = ".metadata"  # DCP's, a pickle


class Marker:
    """Unpickled, it creates the file ``path``: the oracle for "code from the checkpoint ran"."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return exec, (f"open({self.path!r}, 'w').write('ran')",)


@pytest.fixture(scope="module")
def dp2(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("received") / "dp2"
    generate(make_plan(GPT, dp=2), GPT.path, folder)
    return folder


def train(folder: Path, checkpoints: Path, *extra: str) -> RunResult:
    return run_local(folder, steps=STEPS, timeout_s=300,
                     extra_args=["--checkpoint-dir", str(checkpoints), "--checkpoint-every", str(EVERY), *extra])


@pytest.fixture(scope="module")
def uninterrupted(dp2) -> tuple[Path, dict[str, torch.Tensor]]:
    """The reference run's checkpoints (step_2, 4, 6) and final parameters."""
    result = train(dp2, dp2 / "checkpoints", "--save-final", str(dp2 / "final.pt"))
    assert result.ok, result.error
    return dp2 / "checkpoints", torch.load(dp2 / "final.pt")


def first_steps(uninterrupted, root: Path) -> Path:
    """A copy of the reference's checkpoints of steps 2 and 4 (a run stopped after step 4)."""
    source, _ = uninterrupted
    for step in (2, 4):
        shutil.copytree(source / f"step_{step}", root / "checkpoints" / f"step_{step}")
    return root / "checkpoints"


def assert_finished_like_the_reference(result: RunResult, final: Path, uninterrupted, resumed_at: int) -> None:
    assert result.ok, result.error
    assert [r["step"] for r in result.records] == list(range(resumed_at, STEPS))
    _, parameters = uninterrupted
    trained = torch.load(final, weights_only=True)
    assert trained.keys() == parameters.keys()
    assert all(torch.equal(trained[name], parameters[name]) for name in parameters)


@EXTENDED
def test_renamed_checkpoint_resumes_at_the_step_it_holds(dp2, uninterrupted, tmp_path):
    """step_4 renamed step_40: the run resumes at step 4 (not 40, which would end it with 36 steps
    unaccounted for and the parameters of step 4), says so, and ends as the reference did."""
    checkpoints = first_steps(uninterrupted, tmp_path)
    (checkpoints / "step_4").rename(checkpoints / "step_40")
    result = train(dp2, checkpoints, "--save-final", str(tmp_path / "final.pt"))
    assert f"resumed from {checkpoints / 'step_40'} (4 steps done, not the 40 its name says" in result.output
    assert_finished_like_the_reference(result, tmp_path / "final.pt", uninterrupted, resumed_at=4)
    assert (checkpoints / f"step_{STEPS}" / COMPLETE).is_file()


def test_crafted_checkpoint_runs_no_code_and_the_one_before_it_is_resumed(dp2, uninterrupted, tmp_path):
    """step_4's .metadata replaced by a pickle that would create a file, its checksums rewritten
    to match (whoever crafts the folder writes COMPLETE too): skipped, naming what it asked for."""
    marker = tmp_path / "RAN"
    checkpoints = first_steps(uninterrupted, tmp_path)
    crafted = checkpoints / "step_4"
    (crafted / METADATA).write_bytes(pickle.dumps(Marker(marker)))
    (crafted / COMPLETE).write_text(json.dumps({"step": 4, "sha256": file_digests(crafted)}))
    result = train(dp2, checkpoints, "--save-final", str(tmp_path / "final.pt"))
    assert f"skipping checkpoint {crafted}: {crafted / METADATA}: it names builtins.exec" in result.output
    assert f"resumed from {checkpoints / 'step_2'} " in result.output
    assert_finished_like_the_reference(result, tmp_path / "final.pt", uninterrupted, resumed_at=2)
    assert not marker.exists()


def test_checkpoint_folder_that_is_a_link_is_refused_and_its_target_kept(dp2, tmp_path):
    victim = tmp_path / "elsewhere"
    victim.mkdir()
    (victim / COMPLETE).write_text("the user's own file")
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / "step_2").symlink_to(victim)
    result = train(dp2, checkpoints)
    assert not result.ok
    assert f"checkpoint {checkpoints / 'step_2'} is a symbolic link" in result.error
    assert [p.name for p in victim.iterdir()] == [COMPLETE] and (victim / COMPLETE).read_text() == "the user's own file"


@pytest.mark.parametrize("name", [LOCK_NAME, "run.jsonl", "checkpoints", "tensorboard"])
def test_run_refuses_a_folder_whose_files_are_links(dp2, tmp_path, capsys, name):
    """The lock was truncated and given the run's pid, run.jsonl appended to, through the link."""
    folder = tmp_path / "received"
    shutil.copytree(dp2, folder,
                    ignore=shutil.ignore_patterns("checkpoints", "run.jsonl", "final.pt", "tensorboard", LOCK_NAME))
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own file\n")
    (folder / name).symlink_to(victim)
    assert autopar_main(["run", str(folder), "--steps", "2", "--checkpoint-every", "2"]) == 1
    err = capsys.readouterr().err
    assert f"{folder / name} is a symbolic link (to {victim})" in " ".join(err.split())
    assert victim.read_text() == "the user's own file\n"

"""Nothing autopar writes into a folder is written through a symbolic link there: a folder
received from someone else could point its files at any file of the user's. Each writer is
given a link to a file (or folder) of the user's and must refuse, naming the link, and leave
what it points at as it was."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopar.sections.metrics import MetricsLogger
from autopar.errors import UserError
from autopar.output_dir import MANIFEST_NAME, Manifest, OutputDirError, install
from autopar.runtime.local import LOCK_NAME, folder_lock

OWN = "the user's own file\n"


@pytest.fixture
def victim(tmp_path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_text(OWN)
    return path


def test_run_lock_that_is_a_link_is_refused_and_its_target_kept(tmp_path, victim):
    """The lock was opened following the link, truncated, and given the run's pid."""
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / LOCK_NAME).symlink_to(victim)
    with pytest.raises(UserError, match=f"{LOCK_NAME} is a symbolic link .to {victim}.*Fix: remove the link"):
        with folder_lock(folder):
            pass
    assert victim.read_text() == OWN


def test_run_lock_that_is_not_a_file_is_refused(tmp_path):
    folder = tmp_path / "out"
    (folder / LOCK_NAME).mkdir(parents=True)
    with pytest.raises(UserError, match="is not a regular file"):
        with folder_lock(folder):
            pass


def test_run_records_are_never_appended_through_a_link(tmp_path, victim):
    """The module's records (run.jsonl) were appended to whatever the link named."""
    log = tmp_path / "run.jsonl"
    log.symlink_to(victim)
    with pytest.raises(RuntimeError, match=f"{log} is a symbolic link .to {victim}.*Fix: remove the link"):
        MetricsLogger(log).log({"step": 0, "loss": 1.0})
    assert victim.read_text() == OWN
    log.unlink()
    MetricsLogger(log).log({"step": 0, "loss": 1.0})  # a real file is appended to as before
    MetricsLogger(log).log({"step": 1, "loss": 0.5})
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [0, 1]


def _staging(tmp_path: Path, text: str) -> Path:
    staging = tmp_path / f"staging-{len(list(tmp_path.iterdir()))}"
    (staging / ".hydra").mkdir(parents=True)
    (staging / "plan.json").write_text("{}")
    (staging / ".hydra" / "config.yaml").write_text(text)
    return staging


def test_install_lists_hydra_files_and_keeps_an_edit_of_them(tmp_path):
    out = tmp_path / "out"
    install(_staging(tmp_path, "first\n"), out, force=False)
    assert set(Manifest.read(out).files) == {"plan.json", ".hydra/config.yaml"}
    assert (out / ".hydra" / "config.yaml").read_text() == "first\n"
    install(_staging(tmp_path, "second\n"), out, force=False)  # autopar's own, unedited: replaced
    assert (out / ".hydra" / "config.yaml").read_text() == "second\n"
    (out / ".hydra" / "config.yaml").write_text("my notes\n")
    with pytest.raises(OutputDirError, match=r"\.hydra/config\.yaml"):
        install(_staging(tmp_path, "third\n"), out, force=False)
    assert (out / ".hydra" / "config.yaml").read_text() == "my notes\n"


@pytest.mark.parametrize("force", [False, True])
def test_install_never_writes_through_a_linked_subfolder(tmp_path, force):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    install(_staging(tmp_path, "first\n"), out, force=False)
    elsewhere.mkdir()
    (elsewhere / "config.yaml").write_text(OWN)
    (out / ".hydra" / "config.yaml").unlink()
    (out / ".hydra").rmdir()
    (out / ".hydra").symlink_to(elsewhere)
    with pytest.raises(OutputDirError, match=r"\.hydra is a symbolic link"):
        install(_staging(tmp_path, "second\n"), out, force=force)
    assert [p.name for p in elsewhere.iterdir()] == ["config.yaml"] and (elsewhere / "config.yaml").read_text() == OWN


def test_a_manifest_naming_files_outside_its_folders_is_not_read(tmp_path):
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"files": {"../x": "0", "other/x": "0"}}))
    assert Manifest.read(tmp_path) is None
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"files": {".hydra/x": "0", ".hydra/../../x": "0"}}))
    assert Manifest.read(tmp_path) is None


def test_plan_into_a_run_folder_with_a_linked_hydra_folder_is_refused(examples_dir, tmp_path, monkeypatch, capsys):
    """`autopar plan` without --out writes .hydra/ into Hydra's run folder: never through a link."""
    from tests.unit.test_bad_input import fails
    from tests.unit.test_safety import TINY

    monkeypatch.chdir(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.yaml").write_text(OWN)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / ".hydra").symlink_to(elsewhere)
    fails(capsys, ["plan", str(examples_dir / "gpt.py"), *TINY, "hydra.run.dir=runs"], "runs/.hydra is a symbolic link")
    assert [p.name for p in elsewhere.iterdir()] == ["config.yaml"] and (elsewhere / "config.yaml").read_text() == OWN


def test_exported_weights_never_go_through_a_link_planted_under_the_temporary_name(tmp_path, victim):
    """write_weights wrote ``.NAME.tmp`` beside the export, following a link planted there."""
    import torch

    from autopar.sections.checkpoint import write_weights

    (tmp_path / ".export.pt.tmp").symlink_to(victim)
    write_weights({"w": torch.ones(3)}, tmp_path / "export.pt")
    assert victim.read_text() == OWN
    assert torch.equal(torch.load(tmp_path / "export.pt", weights_only=True)["w"], torch.ones(3))


def test_tensorboard_folder_that_is_a_link_is_refused(tmp_path):
    from autopar.sections.metrics import MetricsConfig, tensorboard_dir

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "tensorboard").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(RuntimeError, match="tensorboard is a symbolic link"):
        tensorboard_dir(tmp_path / "run.jsonl", MetricsConfig(tensorboard=True))
    assert tensorboard_dir(tmp_path / "run.jsonl", MetricsConfig(tensorboard=True, tensorboard_dir="tb")) == Path("tb")

"""A checkpoint is data, never code: reading one (resuming, exporting) runs nothing from its
files, and the step it holds is the one stored inside it, whatever its folder is called.

Checkpoints here are written by DCP in this process (``no_dist``), as a rank writes its part."""
from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from autopar.sections.checkpoint import (COMPLETE, METADATA, UnsafeCheckpoint, checkpoint_problem,
                                                 consolidated_weights, export_latest_checkpoint, file_digests,
                                                 latest_checkpoint, read_metadata, usable_checkpoint)

WEIGHT = torch.arange(12, dtype=torch.float32).reshape(3, 4)


class Marker:
    """Unpickled, it creates the file ``path``: the oracle for "code from the checkpoint ran"."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return exec, (f"open({self.path!r}, 'w').write('ran')",)


def write_checkpoint(root: Path, step: int, name: str | None = None, extra: dict | None = None) -> Path:
    """A complete checkpoint as rank 0 marks it (COMPLETE with the step and the files' sha256)."""
    folder = root / (name or f"step_{step}")
    state = {"model.w": WEIGHT + step, "train.step": torch.tensor(step), "optimizer.param_groups.w.lr": 0.5,
             **(extra or {})}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=folder, no_dist=True)
    mark_complete(folder, step)
    return folder


def mark_complete(folder: Path, step: int) -> None:
    """COMPLETE as a crafter would write it: with checksums matching the (crafted) files."""
    (folder / COMPLETE).unlink(missing_ok=True)
    (folder / COMPLETE).write_text(json.dumps({"step": step, "world_size": 1, "sha256": file_digests(folder)}))


def craft_metadata(folder: Path, marker: Path) -> None:
    """Replace DCP's .metadata by a pickle that would run code, checksums updated to match."""
    (folder / METADATA).write_bytes(pickle.dumps(Marker(marker)))
    mark_complete(folder, json.loads((folder / COMPLETE).read_text())["step"])


def test_a_checkpoint_reads_back_through_the_safe_reader(tmp_path):
    folder = write_checkpoint(tmp_path, 4)
    assert checkpoint_problem(folder) is None
    assert set(read_metadata(folder).state_dict_metadata) == {"model.w", "train.step", "optimizer.param_groups.w.lr"}
    assert torch.equal(consolidated_weights(folder)["w"], WEIGHT + 4)


def test_crafted_metadata_runs_nothing_and_the_checkpoint_before_it_is_used(tmp_path, capsys):
    marker = tmp_path / "RAN"
    write_checkpoint(tmp_path, 2)
    crafted = write_checkpoint(tmp_path, 4)
    craft_metadata(crafted, marker)
    assert usable_checkpoint(tmp_path) == (2, tmp_path / "step_2")
    out = capsys.readouterr().out
    assert f"skipping checkpoint {crafted}: {crafted / METADATA}: it names builtins.exec" in out
    with pytest.raises(UnsafeCheckpoint, match="builtins.exec"):
        consolidated_weights(crafted)
    assert torch.equal(consolidated_weights(tmp_path / "step_2")["w"], WEIGHT + 2)
    assert not marker.exists()


def test_only_crafted_checkpoints_fail_with_their_names_and_run_nothing(tmp_path):
    marker = tmp_path / "RAN"
    craft_metadata(write_checkpoint(tmp_path, 4), marker)
    with pytest.raises(RuntimeError, match=r"no usable checkpoint .*step_4/\.metadata: it names builtins\.exec"):
        usable_checkpoint(tmp_path)
    with pytest.raises(RuntimeError, match="no usable checkpoint"):
        export_latest_checkpoint(tmp_path, tmp_path / "out.pt")
    assert not marker.exists() and not (tmp_path / "out.pt").exists()


def test_crafted_plain_value_is_refused_before_it_is_unpickled(tmp_path):
    """DCP keeps non-tensor values (the optimizer's options) as pickled bytes and would load them
    with torch.load(weights_only=False): a crafted one is refused, by the check and by the load."""
    marker = tmp_path / "RAN"
    crafted = write_checkpoint(tmp_path, 4, extra={"optimizer.param_groups.w.betas": Marker(marker)})
    problem = checkpoint_problem(crafted)
    assert problem is not None and "'optimizer.param_groups.w.betas' is not plain data" in problem
    assert "it names exec" in problem
    from autopar.sections.checkpoint import load_safely
    with pytest.raises(CheckpointException, match="not plain data .it names exec"):
        load_safely({"model.w": torch.empty(3, 4), "optimizer.param_groups.w.betas": None}, crafted, no_dist=True)
    assert not marker.exists()


@pytest.mark.parametrize("path", ["../outside.distcp", "/etc/hostname"])
def test_metadata_pointing_outside_its_folder_is_refused(tmp_path, path):
    folder = write_checkpoint(tmp_path, 4)
    metadata = read_metadata(folder)
    for info in metadata.storage_data.values():
        info.relative_path = path
    (folder / METADATA).write_bytes(pickle.dumps(metadata))
    mark_complete(folder, 4)
    assert "points outside its folder" in checkpoint_problem(folder)


def test_a_renamed_checkpoint_is_ordered_by_the_step_it_holds(tmp_path):
    """step_6 renamed step_60 is the checkpoint of step 6: older than a real step_8."""
    write_checkpoint(tmp_path, 6, name="step_60")
    assert latest_checkpoint(tmp_path) == (6, tmp_path / "step_60")
    write_checkpoint(tmp_path, 8)
    assert latest_checkpoint(tmp_path) == (8, tmp_path / "step_8")

"""Safe with the user's files and machine: compile never loses a file autopar did not write,
paths reaching a shell run nothing, no file is imported that the user did not name, bounded
time for any input, environment errors are one paragraph (exit 1), and real allocations in
the model file are refused before they happen."""
from __future__ import annotations

import errno
import json
import os
import resource
import shutil
from pathlib import Path

import pytest

from autopar.cli import main
from autopar.errors import UserError
from autopar.output_dir import MANIFEST_NAME, Manifest, install
from autopar.plans import Plan
from autopar.solver.space import _group_span, divisors
from tests.conftest import write_model_file
from tests.tiers import tiered
from tests.unit.test_bad_input import _address_space_bytes, capped_memory, fails  # noqa: F401 - a fixture

TINY = ["cluster=cpu_gloo", "cluster.gpus_per_node=2", "model.layers=2", "model.hidden=64", "model.heads=4",
        "model.seq_len=32", "model.vocab=128", "train.global_batch_size=8", "train.precision=fp32"]

# A model file whose import leaves a marker: the oracle for "this file was never imported".
MARKED_MODEL = """
from pathlib import Path
Path(__file__).with_name("IMPORTED").touch()
import torch
def build_model():
    return torch.nn.Linear(4, 4)
def example_batch(batch_size):
    return torch.randn(batch_size, 4)
"""


@pytest.fixture(scope="module")
def compiled(examples_dir, tmp_path_factory) -> Path:
    """A tiny GPT compiled once; tests work on copies."""
    out = tmp_path_factory.mktemp("compiled") / "out"
    assert main(["compile", str(examples_dir / "gpt.py"), *TINY, "--out-dir", str(out), "-q"]) == 0
    return out


def copy_of(compiled: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "out"
    shutil.copytree(compiled, folder)
    return folder


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# -- 1: compile into an existing folder ---------------------------------------------------------

def test_compile_records_what_it_wrote(compiled):
    manifest = Manifest.read(compiled)
    assert manifest is not None
    # .hydra/ is Hydra's record of the settings: its files are listed like the others.
    assert set(manifest.files) == ({p.name for p in compiled.iterdir()} - {MANIFEST_NAME, ".hydra"}
                                   | {".hydra/config.yaml", ".hydra/overrides.yaml"})
    assert {"plan.json", "launch.sh", "sbatch.sh", "parallel_gpt.py", "gpt.py", "report.html"} <= set(manifest.files)


# Recompiling a trained folder keeps its checkpoints, run records and the user's files, and leaves
# no staging folder: tests/dist/test_compile_cli.py::test_recompiling_a_trained_folder_keeps_its_
# checkpoints_and_run_records (on a folder really trained before and after the compile).


def test_a_folder_autopar_did_not_write_is_refused_then_forced_without_losing_files(examples_dir, tmp_path,
                                                                                    capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    (out / "plan.json").write_text("my own plan notes")
    before = snapshot(out)
    err = fails(capsys, ["compile", str(examples_dir / "gpt.py"), *TINY, "--out-dir", str(out)],
                "not written by autopar", "thesis.tex", "plan.json", "--force")
    assert "Traceback" not in err and snapshot(out) == before
    assert main(["compile", str(examples_dir / "gpt.py"), *TINY, "--out-dir", str(out), "--force", "-q"]) == 0
    assert (out / "thesis.tex").read_text() == "years of work"  # --force replaces, never removes others
    assert Plan.load(out / "plan.json").world_size == 2


def test_an_edited_generated_file_is_not_replaced_without_force(examples_dir, compiled, tmp_path, capsys):
    out = copy_of(compiled, tmp_path)
    (out / "launch.sh").write_text("#!/bin/sh\n# my cluster's tweaks\n")
    before = snapshot(out)
    fails(capsys, ["compile", str(examples_dir / "gpt.py"), *TINY, "--plan", str(out / "plan.json"), "--out-dir",
                   str(out)], "launch.sh", "edited", "--force")
    assert snapshot(out) == before


def test_an_edited_hydra_record_is_not_replaced_without_force(examples_dir, compiled, tmp_path, capsys):
    out = copy_of(compiled, tmp_path)
    (out / ".hydra" / "config.yaml").write_text("# my notes on this run\n")
    before = snapshot(out)
    fails(capsys, ["compile", str(examples_dir / "gpt.py"), *TINY, "--plan", str(out / "plan.json"), "--out-dir",
                   str(out)], ".hydra/config.yaml", "edited", "--force")
    assert snapshot(out) == before


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_compile_never_writes_through_a_linked_hydra_folder(examples_dir, compiled, tmp_path, capsys, force):
    """OUT/.hydra pointing at a folder of the user's: refused before any work, even with --force
    (which replaces files, never writes through them), and the folder it points at is untouched."""
    out = copy_of(compiled, tmp_path)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "config.yaml").write_text("the user's own file\n")
    shutil.rmtree(out / ".hydra")
    (out / ".hydra").symlink_to(victim)
    fails(capsys, ["compile", str(examples_dir / "gpt.py"), *TINY, "--plan", str(out / "plan.json"), "--out-dir",
                   str(out), *force], f"{out / '.hydra'} is a symbolic link", "remove the link")
    assert [p.name for p in victim.iterdir()] == ["config.yaml"]
    assert (victim / "config.yaml").read_text() == "the user's own file\n"


def test_out_dir_naming_a_file_is_refused_and_the_file_kept(examples_dir, tmp_path, capsys):
    target = tmp_path / "results.csv"
    target.write_text("a,b\n1,2\n")
    fails(capsys, ["compile", str(examples_dir / "gpt.py"), *TINY, "--out-dir", str(target)], "existing file")
    assert target.read_text() == "a,b\n1,2\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.csv"]


def test_out_dir_dot_is_a_folder_like_any_other(examples_dir, tmp_path, capsys, monkeypatch):
    (tmp_path / "data.bin").write_bytes(b"\0" * 10)
    monkeypatch.chdir(tmp_path)
    fails(capsys, ["compile", str(examples_dir / "gpt.py"), *TINY, "--out-dir", "."], "not written by autopar",
          "data.bin")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.bin"]


def test_a_report_into_a_compiled_folder_keeps_the_compiled_files(compiled, tmp_path):
    out = copy_of(compiled, tmp_path)
    before = snapshot(out)
    assert main(["report", str(out), "-q"]) == 0
    after = snapshot(out)
    assert set(after) == set(before)
    assert {k: v for k, v in after.items() if not k.startswith(("report", "timeline", "memory", "time", "autopar"))} \
        == {k: v for k, v in before.items() if not k.startswith(("report", "timeline", "memory", "time", "autopar"))}
    assert set(Manifest.read(out).files) == set(Manifest.read(compiled).files)


def test_install_removes_only_unmodified_files_of_an_earlier_write(tmp_path):
    out, staging = tmp_path / "out", tmp_path / "staging"
    staging.mkdir()
    for name in ("parallel_a.py", "a.py", "plan.json"):
        (staging / name).write_text(f"first {name}")
    install(staging, out, force=False)
    (out / "a.py").write_text("edited by the user")
    (out / "run.jsonl").write_text("records")
    assert list(staging.iterdir()) == []  # every file was moved in
    for name in ("parallel_b.py", "b.py", "plan.json"):
        (staging / name).write_text(f"second {name}")
    install(staging, out, force=False)
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST_NAME, "a.py", "b.py", "parallel_b.py",
                                                            "plan.json", "run.jsonl"])
    assert (out / "a.py").read_text() == "edited by the user"
    assert "a.py" in Manifest.read(out).files and "parallel_a.py" not in Manifest.read(out).files


def test_a_manifest_naming_paths_outside_the_folder_is_not_trusted(tmp_path):
    out, staging = tmp_path / "out", tmp_path / "staging"
    out.mkdir()
    precious = tmp_path / "precious.txt"
    precious.write_text("keep")
    (out / MANIFEST_NAME).write_text(json.dumps({"files": {"../precious.txt": "x"}}))
    assert Manifest.read(out) is None
    staging.mkdir()
    (staging / "plan.json").write_text("{}")
    install(staging, out, force=True)
    assert precious.read_text() == "keep"


# -- 2: paths reaching a shell ------------------------------------------------------------------
# Hostile file and folder names in the launch scripts (stand-in and real torchrun, one compile):
# tests/dist/test_compile_cli.py::test_launch_script_of_a_hostile_file_and_folder_name_trains_and_runs_nothing_else.


# -- 3: no file imported that the user did not name ---------------------------------------------

@pytest.fixture(scope="module")
def plan_naming_a_marked_model(examples_dir, tmp_path_factory) -> Path:
    """A valid plan whose provenance names a model file that leaves a marker when imported."""
    folder = tmp_path_factory.mktemp("received")
    plan = folder / "plan.json"
    assert main(["plan", str(examples_dir / "gpt.py"), *TINY, "--out", str(plan), "-q"]) == 0
    evil = write_model_file(folder, MARKED_MODEL, name="evil.py")
    data = json.loads(plan.read_text())
    data["provenance"]["model_path"] = str(evil)
    plan.write_text(json.dumps(data))
    return plan


def test_report_of_a_plan_never_imports_the_file_the_plan_names(plan_naming_a_marked_model, tmp_path, capsys):
    marker = plan_naming_a_marked_model.with_name("IMPORTED")
    fails(capsys, ["report", str(plan_naming_a_marked_model), "--out-dir", str(tmp_path / "rep")], "--model",
          "never the one a plan names", unwritten=(tmp_path / "rep",))
    assert not marker.exists()


def test_a_named_model_file_is_checked_against_the_plan_before_import(plan_naming_a_marked_model, tmp_path, capsys):
    other = write_model_file(tmp_path, MARKED_MODEL, name="other.py")
    fails(capsys, ["report", str(plan_naming_a_marked_model), "--model", str(other), "--out-dir",
                   str(tmp_path / "rep")], "sha256", "not imported", unwritten=(tmp_path / "rep",))
    assert not (tmp_path / "IMPORTED").exists()


def test_compile_with_a_plan_for_another_file_refuses_before_importing(plan_naming_a_marked_model, tmp_path,
                                                                       capsys):
    other = write_model_file(tmp_path, MARKED_MODEL, name="other.py")
    fails(capsys, ["compile", str(other), *TINY, "--plan", str(plan_naming_a_marked_model), "--out-dir",
                   str(tmp_path / "out")], "different model file", unwritten=(tmp_path / "out",))
    assert not (tmp_path / "IMPORTED").exists()


# -- 8: bounded time for any input --------------------------------------------------------------

def test_a_million_node_cluster_is_refused_before_the_model_is_read(tmp_path, capsys):
    model = write_model_file(tmp_path, MARKED_MODEL)
    fails(capsys, ["plan", str(model), "cluster.nodes=1000000", "solver.time_limit_s=5", "--out",
                   str(tmp_path / "plan.json")], "8,000,000 GPUs", "up to 65,536", "cluster.nodes",
          unwritten=(tmp_path / "plan.json",))
    assert not (tmp_path / "IMPORTED").exists()


def test_a_model_of_too_many_modules_is_refused_while_it_is_built(tmp_path, capsys):
    model = write_model_file(tmp_path, """
import torch
def build_model(layers=100000):
    return torch.nn.Sequential(*[torch.nn.Identity() for _ in range(layers)])
def example_batch(batch_size):
    return torch.randn(batch_size, 4)
""")
    fails(capsys, ["profile", str(model), "--out", str(tmp_path / "p.json")], "more than 20,000 modules",
          "model.layers", unwritten=(tmp_path / "p.json",))


def test_divisors_and_group_spans_match_brute_force():
    for n in list(range(1, 200)) + [8_000_000, 65536, 1_000_003]:
        expected = [d for d in range(1, n + 1) if n % d == 0] if n < 10**5 else None
        found = list(divisors(n))
        assert found == sorted(found) and all(n % d == 0 for d in found)
        if expected is not None:
            assert found == expected
    assert len(divisors(8_000_000)) == 70  # 2^9 * 5^6
    for degrees in ({"tp": 4, "cp": 3, "pp": 5, "dp": 7}, {"tp": 2, "cp": 1, "pp": 3, "dp": 16}):
        for gpus_per_node in (1, 2, 3, 8, 16):
            for order in (("tp", "cp", "pp", "dp"), ("dp", "pp", "cp", "tp"), ("cp", "dp", "tp", "pp")):
                for axis in degrees:
                    stride = 1
                    for inner in order[: order.index(axis)]:
                        stride *= degrees[inner]
                    world = 1
                    for degree in degrees.values():
                        world *= degree
                    # Every group (the ranks at coordinate 0 on the axis, each with its stride
                    # steps); the one touching the most nodes is the span.
                    firsts = [r for r in range(world) if (r // stride) % degrees[axis] == 0]
                    most = max(len({(first + i * stride) // gpus_per_node for i in range(degrees[axis])})
                               for first in firsts)
                    want = (1, 1) if degrees[axis] == 1 else (most, degrees[axis] // most)
                    assert _group_span(order, axis, degrees, gpus_per_node) == want


# -- 9: environment errors ----------------------------------------------------------------------

def test_out_pointing_at_a_folder_is_refused_before_the_model_is_read(tmp_path, capsys):
    model = write_model_file(tmp_path, MARKED_MODEL)
    (tmp_path / "plans").mkdir()
    fails(capsys, ["plan", str(model), "--out", str(tmp_path / "plans")], "is a folder")
    fails(capsys, ["profile", str(model), "--out", str(tmp_path / "plans")], "is a folder")
    fails(capsys, ["plan", str(model), "--out", str(model / "plan.json")], "not a folder")
    assert not (tmp_path / "IMPORTED").exists()


def test_calibrate_checks_its_output_before_measuring(tmp_path, capsys, monkeypatch):
    import cost_models.calibrate

    def measure(*args, **kwargs):
        raise AssertionError("measured before checking --out")
    monkeypatch.setattr(cost_models.calibrate, "calibrate", measure)
    fails(capsys, ["calibrate", "--out", str(tmp_path)], "is a folder")
    # /proc takes no new files, even from root (whose permission bits say yes).
    fails(capsys, ["calibrate", "--out", "/proc/hw.yaml"], "/proc", "nothing can be written")


def test_a_read_only_location_is_refused_before_the_model_is_read(tmp_path, capsys):
    model = write_model_file(tmp_path, MARKED_MODEL)
    fails(capsys, ["plan", str(model), "--out", "/proc/plan.json"], "nothing can be written")
    fails(capsys, ["compile", str(model), "--out-dir", "/proc/autopar_out"], "nothing can be written")
    fails(capsys, ["plan", str(model), "--report", "/proc/autopar_report"], "nothing can be written")
    assert not (tmp_path / "IMPORTED").exists()


# By default the full disk; the read-only one takes the same path with its own words.
@pytest.mark.parametrize("code, words", tiered([(errno.ENOSPC, "disk is full"), (errno.EROFS, "read-only")],
                                               [(errno.ENOSPC, "disk is full")], unpack=True))
def test_a_full_or_read_only_disk_while_compiling_is_one_paragraph_and_writes_nothing(examples_dir, tmp_path,
                                                                                      capsys, monkeypatch,
                                                                                      code, words):
    import autopar.report.render

    real = autopar.report.render.write_report

    def fail_midway(report, folder):
        real(report, folder)
        raise OSError(code, os.strerror(code), str(Path(folder) / "report.html"))
    monkeypatch.setattr(autopar.report.render, "write_report", fail_midway)
    out = tmp_path / "out"
    fails(capsys, ["compile", str(examples_dir / "gpt.py"), *TINY, "--out-dir", str(out)], words, "report.html",
          unwritten=(out,))
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no staging folder left either


def test_a_read_only_plan_output_is_named_with_its_fix(examples_dir, tmp_path, capsys, monkeypatch):
    import autopar.cli

    def read_only(path, text):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
    monkeypatch.setattr(autopar.cli, "write_atomically", read_only)
    fails(capsys, ["plan", str(examples_dir / "gpt.py"), *TINY, "--out", str(tmp_path / "p.json")],
          "read-only", str(tmp_path / "p.json"), "writable")


# -- 12: large allocations other than torch tensors ---------------------------------------------

@pytest.fixture
def roomy_cap():
    """An address-space cap 16 GiB above this process, so a regression cannot exhaust the machine,
    while the 8 GiB the tests ask for stays below it (only autopar's own cap can refuse it)."""
    current = _address_space_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if current is not None:
        resource.setrlimit(resource.RLIMIT_AS, (current + 16 * 2**30, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


# numpy.zeros/empty of 8 GiB reserve address space without touching it: harmless if a regression
# lets them through (the test then fails on the exit code), refused at once by the cap.
@pytest.mark.parametrize("at_import, in_build, in_batch", [
    ("TABLE = numpy.zeros(8 * 2**30, dtype=numpy.uint8)", "", ""),
    ("", "    table = numpy.zeros((2**30, 8), dtype=numpy.uint8)\n", ""),
    ("", "", "    table = numpy.empty(2**30, dtype=numpy.float64)\n"),
])
def test_an_8_gib_numpy_array_is_refused_before_it_is_allocated(tmp_path, capsys, roomy_cap, at_import, in_build,
                                                                in_batch):
    model = write_model_file(tmp_path, f"""
import numpy
import torch
{at_import}
def build_model():
{in_build}    return torch.nn.Linear(4, 4)
def example_batch(batch_size):
{in_batch}    return torch.randn(batch_size, 4)
""")
    fails(capsys, ["profile", str(model), "--out", str(tmp_path / "p.json")], "8.00 GiB", "refused before",
          "model.py:", unwritten=(tmp_path / "p.json",))


def test_a_touched_8_gib_buffer_is_refused_too(tmp_path, capsys, capped_memory):  # noqa: F811 - the fixture
    """bytearray fills its memory, so it is tested only under the 6 GiB safety cap of the test."""
    model = write_model_file(tmp_path, """
import torch
def build_model():
    buffer = bytearray(8 * 2**30)
    return torch.nn.Linear(4, 4)
def example_batch(batch_size):
    return torch.randn(batch_size, 4)
""")
    fails(capsys, ["profile", str(model)], "out of memory", "refused before", "build_model")


def test_validate_never_deletes_a_measure_folder_it_did_not_write(tmp_path):
    """`autopar validate DIR` writes DIR/measure/rank_<r>.json; an earlier validation's files are
    replaced, anything else there is refused and kept."""
    from autopar.runtime.validate import _clear_measurements

    folder = tmp_path / "measure"
    folder.mkdir()
    (folder / "rank_0.json").write_text("{}")
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="notes.txt"):
        _clear_measurements(folder)
    assert (folder / "notes.txt").read_text() == "mine" and (folder / "rank_0.json").exists()
    (folder / "notes.txt").unlink()
    _clear_measurements(folder)
    assert not folder.exists()

"""A second plan of the same model reuses the first one's profile (autopar/profile_cache.py), and
only then: any change to the model file, a module beside it that it imports, or a setting that
tracing reads traces again; a damaged entry is traced again and an unwritable cache costs nothing."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from autopar import driver, model_file, profile, profile_cache
from tests.conftest import REPO
from autopar.cli import main
from autopar.config import compose_config

GPT = """
import torch
from torch import nn
from helpers import width


def build_model(layers: int = 2, hidden: int = 32):
    return nn.Sequential(nn.Embedding(64, hidden), *[nn.Linear(hidden, width(hidden)) for _ in range(layers)],
                         nn.Linear(width(hidden), 64))


def example_batch(batch_size: int):
    return torch.randint(0, 64, (batch_size, 8))
"""


@pytest.fixture
def model(tmp_path, monkeypatch):
    monkeypatch.setenv(profile_cache.CACHE_VARIABLE, str(tmp_path / "cache"))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "helpers.py").write_text("def width(hidden):\n    return hidden\n")
    (folder / "model.py").write_text(GPT)
    return folder / "model.py"


@pytest.fixture
def traces(monkeypatch):
    """How many times a profile was traced (not reused)."""
    count = []
    real = profile.profile_model  # the driver imports it when it must trace
    monkeypatch.setattr(profile, "profile_model", lambda *a, **k: count.append(1) or real(*a, **k))
    return count


def _profile(path, *overrides):
    return driver.traced_or_kept(path, compose_config(["cluster=cpu_gloo", *overrides]))


def test_the_second_profile_of_the_same_model_is_the_first_one_kept(model, traces, tmp_path):
    first, kept_first = _profile(model)
    second, kept_second = _profile(model)
    assert (kept_first, kept_second, len(traces)) == (False, True, 1)
    assert second.to_json() == first.to_json()
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1


def test_a_kept_profile_is_found_without_importing_the_model_file(model, traces, monkeypatch):
    first, _ = _profile(model)
    imports = []
    real = model_file.load_model_file
    monkeypatch.setattr(model_file, "load_model_file", lambda *a, **k: imports.append(1) or real(*a, **k))
    second, kept = _profile(model)
    assert kept and not imports and second.to_json() == first.to_json()
    model.write_text(GPT + "\n# edited\n")  # other bytes: imported and traced again
    _, kept = _profile(model)
    assert not kept and len(imports) == 1 and len(traces) == 2


@pytest.mark.parametrize("package", ["yaml", "omegaconf"])
def test_a_package_is_keyed_the_same_before_it_is_imported_as_after(package, monkeypatch):
    """A fresh process looks a kept profile up before importing the model file: a package the file
    imports must key the same then (PyYAML: a module named unlike its distribution)."""
    import importlib
    import sys

    importlib.import_module(package)
    after = profile_cache._installed_version(package)
    monkeypatch.delitem(sys.modules, package)
    assert profile_cache._installed_version(package) == after is not None


@pytest.mark.parametrize("change", ["model file", "imported neighbour", "model setting", "precision"])
def test_any_change_tracing_reads_traces_again(model, traces, change):
    _profile(model)
    overrides = []
    if change == "model file":
        model.write_text(GPT + "\n# edited\n")
    elif change == "imported neighbour":
        (model.parent / "helpers.py").write_text("def width(hidden):\n    return hidden  # edited\n")
    elif change == "model setting":
        overrides = ["model.hidden=16"]
    else:
        overrides = ["train.precision=fp32"]
    _, kept = _profile(model, *overrides)
    assert not kept and len(traces) == 2


def test_a_damaged_entry_is_traced_again_and_replaced(model, traces, tmp_path):
    _profile(model)
    (entry,) = (tmp_path / "cache").glob("*.json")
    entry.write_text('{"model_name": ')
    _, kept = _profile(model)
    assert not kept and len(traces) == 2
    _, kept = _profile(model)
    assert kept and len(traces) == 2


def test_what_planning_found_is_kept_beside_the_profile_and_a_damaged_record_of_it_is_dropped(model, traces, tmp_path):
    first, _ = _profile(model)
    assert first.kept_as is not None and first.findings == {}
    findings = {"tp_legality": {"static": [{"layer": "1", "tp": 2, "illegal": {}, "fused": {}}], "probed": []}}
    profile_cache.store_findings(first.kept_as, findings)
    second, kept = _profile(model)
    assert kept and second.findings == findings and len(traces) == 1
    (record,) = (tmp_path / "cache").glob(f"*{profile_cache.FINDINGS_SUFFIX}")
    record.write_text('{"tp_legality": ')
    third, kept = _profile(model)
    assert kept and third.findings == {} and len(traces) == 1  # the profile still kept, the findings asked again


def test_reuse_off_by_setting_or_variable_keeps_nothing(model, traces, tmp_path, monkeypatch):
    _profile(model, "plan.reuse_profile=false")
    _profile(model, "plan.reuse_profile=false")
    assert len(traces) == 2 and not (tmp_path / "cache").exists()
    monkeypatch.setenv(profile_cache.CACHE_VARIABLE, "off")
    _profile(model)
    assert len(traces) == 3 and not (tmp_path / "cache").exists()


def test_an_unwritable_cache_still_plans(model, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder would go")
    monkeypatch.setenv(profile_cache.CACHE_VARIABLE, str(blocker / "profiles"))
    assert main(["plan", str(model), "cluster=cpu_gloo", "--out", str(tmp_path / "plan.json")]) == 0
    assert (tmp_path / "plan.json").exists() and blocker.read_text().startswith("a file")


def test_plan_says_when_it_reused_a_profile(model, tmp_path, capsys):
    for out in ("first.json", "second.json"):
        assert main(["plan", str(model), "cluster=cpu_gloo", "--out", str(tmp_path / out)]) == 0
    assert (tmp_path / "first.json").read_text() == (tmp_path / "second.json").read_text()
    output = capsys.readouterr()
    assert (output.out + output.err).count("reused: traced before") == 1


def test_a_plan_from_a_kept_profile_solves_no_tensor_parallel_split_again(model, tmp_path, monkeypatch):
    """The ILP's proven splits are kept with the legality answers (ModelProfile.findings): a
    second plan of the same model and cluster solves none and writes the same plan."""
    from autopar.solver import intra_op

    solves = []
    real = intra_op.IntraOpSolver.solve
    monkeypatch.setattr(intra_op.IntraOpSolver, "solve", lambda self, *a: solves.append(1) or real(self, *a))
    overrides = ["cluster=cpu_gloo", "cluster.gpus_per_node=4", "model.hidden=64"]
    assert main(["plan", str(model), *overrides, "--out", str(tmp_path / "first.json")]) == 0
    first = len(solves)
    assert main(["plan", str(model), *overrides, "--out", str(tmp_path / "second.json")]) == 0
    assert first > 0 and len(solves) == first
    assert (tmp_path / "first.json").read_text() == (tmp_path / "second.json").read_text()


# A plan in a fresh process, as a user runs it; it fails if torch or the model's library was imported.
PLAN_WITHOUT_TORCH = """
import sys
from autopar.cli import main
code = main(["plan", sys.argv[1], "cluster=cpu_gloo", "--out", sys.argv[2]])
loaded = sorted(name for name in ("torch", "helpers") if name in sys.modules)
sys.exit(code or (f"imported {loaded}" if loaded else 0))
"""


def test_a_plan_from_a_kept_profile_imports_neither_torch_nor_the_model(model, tmp_path):
    """Reusing a profile saves what importing torch and the model's library cost (seconds for
    transformers), not just tracing: nothing on that path may import them."""
    assert main(["plan", str(model), "cluster=cpu_gloo", "--out", str(tmp_path / "first.json")]) == 0
    again = subprocess.run([sys.executable, "-c", PLAN_WITHOUT_TORCH, str(model), str(tmp_path / "second.json")],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert again.returncode == 0, again.stderr[-2000:]
    assert (tmp_path / "first.json").read_text() == (tmp_path / "second.json").read_text()


def test_imports_are_read_from_the_source_at_any_depth():
    source = b"import os.path\nfrom transformers.models import llama\nfrom . import sibling\n" \
             b"def f():\n    import helpers\n"
    assert profile_cache.imported_names(source) == ["helpers", "os", "transformers"]


def test_reusing_a_profile_is_not_a_pin(model, tmp_path, capsys):
    """plan.reuse_profile says how the model is traced, not what the plan decides."""
    assert main(["plan", str(model), "cluster=cpu_gloo", "plan.reuse_profile=false", "--out",
                 str(tmp_path / "plan.json")]) == 0
    output = capsys.readouterr()
    assert "reuse_profile" not in output.out + output.err


def test_a_module_on_a_path_the_model_file_adds_is_keyed_by_its_bytes(model, traces):
    """A helper outside the model's folder, found through sys.path, has no version: its bytes count."""
    shared = model.parent.parent / "shared"
    shared.mkdir()
    (shared / "widths.py").write_text("def wide(hidden):\n    return hidden\n")
    added = "import sys\nfrom pathlib import Path\nsys.path.insert(0, str(Path(__file__).parent.parent / 'shared'))\n"
    model.write_text(added + GPT.replace("from helpers import width", "from widths import wide as width"))
    _profile(model)
    _, kept = _profile(model)
    assert kept and len(traces) == 1
    (shared / "widths.py").write_text("def wide(hidden):\n    return hidden  # edited\n")
    _, kept = _profile(model)
    assert not kept and len(traces) == 2


def test_a_neighbour_that_does_not_parse_does_not_stop_planning(model, traces):
    (model.parent / "broken.py").write_text("def (:\n")
    model.write_text("try:\n    import broken\nexcept SyntaxError:\n    pass\n" + GPT)
    _, kept = _profile(model)
    assert not kept and len(traces) == 1


def test_the_folder_is_pruned_to_its_size_least_recently_used_first_and_nothing_else_goes(tmp_path):
    """Entries of 100 bytes (with findings 10 more), used at t = 1, 3, 2: at a 250-byte limit the
    one used longest ago goes with its findings, the one just written stays whatever the size,
    findings left without their profile go, and files that are not entries are never touched."""
    folder = tmp_path / "cache"
    folder.mkdir()
    keys = [f"{n:032x}" for n in (1, 2, 3)]
    for used, key in zip((1, 3, 2), keys):
        (folder / f"{key}.json").write_text("x" * 100)
        (folder / f"{key}{profile_cache.FINDINGS_SUFFIX}").write_text("y" * 10)
        os.utime(folder / f"{key}.json", (used, used))
    orphan = folder / f"{4:032x}{profile_cache.FINDINGS_SUFFIX}"
    orphan.write_text("z")
    users = [folder / "notes.json", folder / "results.findings.json"]
    for path in users:
        path.write_text("a user's file" * 100)
    assert profile_cache.prune(folder, 250, keep=keys[0]) == [keys[2]]  # keys[0] is oldest but just written
    assert sorted(p.name for p in folder.iterdir() if p not in users) == sorted(
        [f"{keys[0]}.json", f"{keys[0]}{profile_cache.FINDINGS_SUFFIX}", f"{keys[1]}.json",
         f"{keys[1]}{profile_cache.FINDINGS_SUFFIX}"])
    assert all(path.exists() for path in users) and not orphan.exists()
    assert profile_cache.prune(folder, 10, keep=keys[0]) == [keys[1]]  # the written one alone stays


def test_a_link_in_the_cache_folder_is_neither_removed_nor_followed(model, traces, tmp_path):
    """An entry that is a link (to a file elsewhere, a user's) is read, but never counted as
    autopar's: reuse touches the link's time, not its target's, and pruning leaves the link, its
    target and the findings beside it alone."""
    first, _ = _profile(model)
    folder, elsewhere = tmp_path / "cache", tmp_path / "mine"
    elsewhere.mkdir()
    target = elsewhere / "results.json"
    (folder / f"{first.kept_as}.json").rename(target)
    (folder / f"{first.kept_as}.json").symlink_to(target)
    (folder / f"{first.kept_as}{profile_cache.FINDINGS_SUFFIX}").write_text("{}")
    os.utime(target, (5, 5))
    content = target.read_text()
    _, kept = _profile(model)
    assert kept and len(traces) == 1 and target.stat().st_mtime == 5
    (folder / f"{8:032x}.json").write_text("x" * 100)
    assert profile_cache.prune(folder, 0, keep=f"{9:032x}") == [f"{8:032x}"]
    assert (folder / f"{first.kept_as}.json").is_symlink() and target.read_text() == content
    assert (folder / f"{first.kept_as}{profile_cache.FINDINGS_SUFFIX}").exists()  # beside a profile's name


def test_a_reused_profile_counts_as_used_and_the_limit_is_a_setting(model, traces, tmp_path, monkeypatch):
    first, _ = _profile(model)
    entry = tmp_path / "cache" / f"{first.kept_as}.json"
    os.utime(entry, (1, 1))
    _profile(model)
    assert entry.stat().st_mtime > 1
    monkeypatch.setenv(profile_cache.MAX_MB_VARIABLE, "0.5")
    assert profile_cache.max_bytes() == 2**19
    _profile(model, "model.layers=3")  # two small profiles, far under half a MiB: both kept
    assert entry.exists()
    monkeypatch.setenv(profile_cache.MAX_MB_VARIABLE, "0")
    second, _ = _profile(model, "model.layers=4")
    assert not entry.exists() and (tmp_path / "cache" / f"{second.kept_as}.json").exists()

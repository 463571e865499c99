"""`autopar compile` and `autopar run` end to end: the folder is written whole or not at all, a
saved plan is reused only for the model and cluster it was made for, and a compiled folder
trains on local gloo ranks exactly like the unsharded model."""
from __future__ import annotations

import importlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.cli import main
from autopar.codegen.generate import DEFAULT_OPTIMIZER
from autopar.output_dir import Manifest
from autopar.plans import Plan
from autopar.runtime import run_reference
from tests.dist.harness import free_port
from tests.dist.test_codegen_run import RECORD_KEYS

TINY = {"layers": 2, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 128}
OVERRIDES = ["cluster=cpu_gloo", "cluster.gpus_per_node=2", "train.global_batch_size=8", "train.precision=fp32",
             *[f"model.{k}={v}" for k, v in TINY.items()]]


@pytest.fixture(scope="module")
def compiled(examples_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("compile") / "gpt"
    assert main(["compile", str(examples_dir / "gpt.py"), *OVERRIDES, "--out-dir", str(out), "-q"]) == 0
    return out


def test_compile_writes_the_module_scripts_and_plan(compiled):
    names = {path.name for path in compiled.iterdir()}
    assert {"plan.json", "parallel_gpt.py", "launch.sh", "sbatch.sh", "gpt.py", "report.html", "report.md",
            "report.json", "timeline.json", "timeline.png"} <= names
    plan = Plan.load(compiled / "plan.json")
    assert plan.world_size == 2 and plan.solver.status == "OPTIMAL"
    assert "--nproc-per-node" in (compiled / "launch.sh").read_text()
    assert not [p for p in compiled.parent.iterdir() if p.name.startswith(".")]  # no staging left


def test_compiled_folder_keeps_the_hydra_config_that_made_it(compiled):
    """.hydra/config.yaml and overrides.yaml travel with the module: the plan's provenance."""
    import yaml

    assert yaml.safe_load((compiled / ".hydra" / "overrides.yaml").read_text())[:4] == OVERRIDES[:4]
    config = yaml.safe_load((compiled / ".hydra" / "config.yaml").read_text())
    assert config["cluster"]["gpus_per_node"] == 2 and config["model"]["hidden"] == 64
    # The value used, not the ${oc.env:...} interpolation that chose it.
    assert config["check"] == os.environ.get("AUTOPAR_CHECK", "auto")


def test_run_trains_like_the_unsharded_model(compiled, capsys):
    assert main(["run", str(compiled), "--steps", "3", "--echo"]) == 0
    records = [json.loads(line) for line in (compiled / "run.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(set(r) == RECORD_KEYS for r in records)
    reference = run_reference(compiled / "gpt.py", TINY, 8, 3, DEFAULT_OPTIMIZER)
    assert [r["loss"] for r in records] == pytest.approx(reference.losses, rel=1e-5)
    for record in records:
        assert record["tokens_per_s"] == pytest.approx(8 * TINY["seq_len"] / record["step_time_s"], rel=1e-6)
        assert record["peak_memory_bytes"] > 0


def test_run_refuses_another_rank_count(compiled, capsys):
    assert main(["run", str(compiled), "--nproc", "3"]) == 1
    assert "compiled for 2 ranks" in capsys.readouterr().err


def test_saved_plan_is_reused_without_solving(examples_dir, compiled, tmp_path, capsys):
    out = tmp_path / "again"
    code = main(["compile", str(examples_dir / "gpt.py"), *OVERRIDES, "--plan", str(compiled / "plan.json"),
                 "--out-dir", str(out)])
    assert code == 0
    assert "reused" in capsys.readouterr().out
    assert Plan.load(out / "plan.json") == Plan.load(compiled / "plan.json")
    assert "Rebuilt from plan.json" in (out / "report.md").read_text()  # priced again for the report


@pytest.mark.parametrize("change, message", [
    (["cluster.gpus_per_node=4"], "planned for cluster"),
    (["model.hidden=128"], "other model settings"),
])
def test_mismatched_plan_is_refused_and_nothing_is_written(examples_dir, compiled, tmp_path, capsys, change,
                                                           message):
    out = tmp_path / "refused"
    code = main(["compile", str(examples_dir / "gpt.py"), *OVERRIDES, *change, "--plan",
                 str(compiled / "plan.json"), "--out-dir", str(out)])
    assert code == 1
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_plan_for_another_model_file_is_refused(examples_dir, compiled, tmp_path, capsys):
    edited = tmp_path / "gpt.py"
    edited.write_text((examples_dir / "gpt.py").read_text() + "\n# edited\n")
    code = main(["compile", str(edited), *OVERRIDES, "--plan", str(compiled / "plan.json"),
                 "--out-dir", str(tmp_path / "out")])
    assert code == 1
    assert "different model file" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_corrupted_plan_is_a_clear_error(examples_dir, tmp_path, capsys):
    broken = tmp_path / "plan.json"
    broken.write_text('{"dp": 2, "tp": ')
    code = main(["compile", str(examples_dir / "gpt.py"), *OVERRIDES, "--plan", str(broken),
                 "--out-dir", str(tmp_path / "out")])
    assert code == 1
    assert "not a readable plan" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _files(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_failed_generation_leaves_an_existing_folder_untouched(examples_dir, compiled, tmp_path, monkeypatch):
    """An error half-way through code generation keeps the previous compile as it was."""
    generate_module = importlib.import_module("autopar.codegen.generate")

    out = tmp_path / "kept"
    shutil.copytree(compiled, out)
    before = _files(out)

    def broken_launch(*args, **kwargs):
        raise generate_module.CodegenError("launch scripts cannot be written.", "none.")

    monkeypatch.setattr(generate_module, "launch_script", broken_launch)
    code = main(["compile", str(examples_dir / "gpt.py"), *OVERRIDES, "--plan", str(compiled / "plan.json"),
                 "--out-dir", str(out)])
    assert code == 1
    assert [p.name for p in tmp_path.iterdir()] == ["kept"]
    assert _files(out) == before  # and no staging folder left inside


def test_recompiling_a_trained_folder_keeps_its_checkpoints_and_run_records(examples_dir, compiled, tmp_path):
    """Train, compile again into the same folder, train on: the checkpoint, the records of the
    first run and the user's own files survive the compile, which leaves no staging folder, and
    the second run resumes from that checkpoint."""
    out = tmp_path / "trained"
    shutil.copytree(compiled, out)
    (out / "run.jsonl").unlink(missing_ok=True)
    assert main(["run", str(out), "--steps", "2", "--checkpoint-every", "2"]) == 0
    (out / "notes.txt").write_text("mine")
    trained = {name: data for name, data in _files(out).items()
               if name.startswith(("checkpoints", "run.jsonl", "notes.txt"))}
    assert any(name.endswith("COMPLETE") for name in trained)
    assert main(["compile", str(examples_dir / "gpt.py"), *OVERRIDES, "--plan", str(out / "plan.json"),
                 "--out-dir", str(out), "-q"]) == 0
    after = _files(out)
    assert {name: after[name] for name in trained} == trained
    assert Manifest.read(out).files["plan.json"] == Manifest.read(compiled).files["plan.json"]
    assert not [p for p in out.iterdir() if p.name.startswith(".autopar-staging")]
    assert main(["run", str(out), "--steps", "3", "--checkpoint-every", "2"]) == 0
    records = [json.loads(line) for line in (out / "run.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [0, 1, 2]  # the second run trained the third step only


def test_compile_generates_context_parallel_plans_and_refuses_models_without_positions(examples_dir, tmp_path,
                                                                                         capsys):
    """A cp pin compiles into a module that shards sequences (GPT takes `positions`); a model
    whose forward takes no token positions is refused before anything is written."""
    out = tmp_path / "cp"
    assert main(["compile", str(examples_dir / "gpt.py"), *OVERRIDES, "plan.cp=2", "plan.cp_strategy=ring",
                 "--out-dir", str(out), "-q"]) == 0
    plan = Plan.load(out / "plan.json")
    assert plan.cp == 2 and plan.cp_strategy == "ring" and plan.zero_stage >= 2
    source = (out / "parallel_gpt.py").read_text()
    assert "def ring_attention(" in source and "POSITION_ARGUMENT = 'positions'" in source
    model = tmp_path / "no_positions.py"
    model.write_text((examples_dir / "gpt.py").read_text().replace(
        "def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None)",
        "def forward(self, tokens: torch.Tensor)").replace("if positions is None:", "if True:"))
    code = main(["compile", str(model), *OVERRIDES, "plan.cp=2", "--out-dir", str(tmp_path / "b")])
    assert code == 1
    assert "position_ids" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


HOSTILE = "g x$(touch X)y 'é\""


def test_launch_script_of_a_hostile_file_and_folder_name_trains_and_runs_nothing_else(examples_dir, tmp_path,
                                                                                        capsys):
    """Spaces, quotes, unicode and `$(...)` in the model file's and the folder's names: the hint
    names the folder as one word, launch.sh and sbatch.sh hand stand-ins for torchrun/srun the
    generated module's name whole, launch.sh runs the real torchrun on it for one step, and no
    `touch X` runs. (One compile serves the stand-ins and the real run.)"""
    model = tmp_path / f"{HOSTILE}.py"
    shutil.copyfile(examples_dir / "gpt.py", model)
    out = tmp_path / f"out {HOSTILE} ü"
    assert main(["compile", str(model), *OVERRIDES, "--out-dir", str(out)]) == 0
    hint = next(line for line in capsys.readouterr().out.splitlines() if "autopar run" in line)
    assert shlex.split(hint.split("`")[1]) == ["autopar", "run", str(out)]
    script = f"parallel_{HOSTILE}.py"
    assert (out / script).is_file() and (out / model.name).is_file()
    # The generated module is valid Python whatever the name (its docstring quotes it).
    compile((out / script).read_text(), script, "exec")
    # Stand-ins for torchrun, srun and scontrol record the command line the scripts build.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    argv_file = tmp_path / "argv.json"
    (bin_dir / "torchrun").write_text(f"#!/usr/bin/env python3\nimport json, sys\n"
                                      f"json.dump(sys.argv[1:], open({str(argv_file)!r}, 'w'))\n")
    (bin_dir / "srun").write_text('#!/bin/sh\nexec "$@"\n')
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho localhost\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    stand_ins = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n0",
                 "SLURM_NNODES": "1", "SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(out)}
    for launcher in ("launch.sh", "sbatch.sh"):
        subprocess.run(["bash", "-n", str(out / launcher)], check=True)
        argv_file.unlink(missing_ok=True)
        subprocess.run(["bash", str(out / launcher), "--steps", "1"], cwd=tmp_path, env=stand_ins, check=True,
                       timeout=60)
        argv = json.loads(argv_file.read_text())
        assert argv[-3:] == [script, "--steps", "1"], argv
    # The real torchrun, with its rendezvous on a free port.
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               RDZV_PORT=str(free_port()), MAX_RESTARTS="0")
    run = subprocess.run(["bash", str(out / "launch.sh"), "--steps", "1"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    records = [json.loads(line) for line in (out / "run.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [0]
    assert not list(tmp_path.rglob("X")), "a $(...) in a file name ran"

"""Hydra semantics of the CLI: hydra.* settings honoured, provenance in each output folder,
--cfg/--info/--help, +/~ overrides checked against the schemas, typed errors before torch is
imported, and sweeps through Hydra's launchers and sweepers (basic, joblib, Optuna)."""
from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autopar.cli import main
from autopar.config import compose_config
from autopar.errors import ConfigError
from autopar.plans import Plan
from tests.tiers import EXTENDED

TINY = ["cluster=cpu_gloo", "model.layers=2", "model.hidden=64", "model.heads=4", "model.seq_len=32",
        "model.vocab=128", "train.global_batch_size=8", "train.precision=fp32"]


def error_of(capsys, argv: list[str]) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and "Traceback" not in err
    return " ".join(err.split())


@pytest.mark.parametrize("override, words", [
    ("cluster.nodes=two", "cluster.nodes=two: an integer is expected"),
    ("solver.time_limit_s=fast", "solver.time_limit_s=fast: a number is expected"),
    ("plan.hybrid_shard=maybe", "plan.hybrid_shard=maybe: true or false is expected"),
    ("solver.schedules=gpipe", "solver.schedules: a list is expected"),
    ("cluster.nodez=2", "cluster.nodez is not a field of cluster. Fix: check the spelling (did you mean nodes?)"),
])
def test_typed_errors_name_what_the_field_expects(examples_dir, capsys, override, words):
    assert words in error_of(capsys, ["plan", str(examples_dir / "gpt.py"), override])


def test_plus_adds_keys_only_where_the_schema_allows(examples_dir, capsys):
    """`+key=value` on a dataclass section used to be accepted and ignored; the model section
    (build_model's keywords) stays open."""
    assert "cluster.foo is not a field of cluster" in error_of(capsys, ["plan", str(examples_dir / "gpt.py"),
                                                                          "+cluster.foo=1"])
    assert "plan.tpp is not a field of plan" in error_of(capsys, ["estimate", str(examples_dir / "gpt.py"),
                                                                    "+plan.tpp=2"])
    assert "(did you mean tp?)" in error_of(capsys, ["profile", str(examples_dir / "gpt.py"), "+plan.tpp=2"])
    assert compose_config(["+model.dropout=0.1"]).model.dropout == 0.1


def test_tilde_deletes_open_keys_but_not_schema_fields():
    assert "layers" not in compose_config(["model.layers=2", "model.hidden=64", "~model.layers"]).model
    with pytest.raises(ConfigError, match=r"~cluster.nodes would delete a field of the schema"):
        compose_config(["~cluster.nodes"])


def test_config_error_is_reported_before_torch_is_imported(examples_dir):
    """A typo costs a fraction of a second: the configuration is checked before the model
    (and torch, ~10 s to import on a loaded 2-core machine) is loaded."""
    code = ("import sys; from autopar.cli import main; rc = main(['plan', sys.argv[1], 'cluster.nodez=2']); "
            "print('torch imported:', 'torch' in sys.modules); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, str(examples_dir / "gpt.py")], capture_output=True, text=True)
    assert done.returncode == 1 and "cluster.nodez" in done.stderr
    assert "torch imported: False" in done.stdout


def test_cfg_job_prints_the_composed_config_and_writes_nothing(examples_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", str(examples_dir / "gpt.py"), *TINY, "cluster.gpus_per_node=2", "--cfg", "job"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["cluster"]["name"] == "cpu_gloo" and cfg["cluster"]["gpus_per_node"] == 2
    assert cfg["model"]["layers"] == 2 and cfg["train"]["precision"] == "fp32" and "hydra" not in cfg
    assert main(["compile", str(examples_dir / "gpt.py"), "hydra.run.dir=somewhere", "-c", "hydra", "--out-dir",
                 "x"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["hydra"]["run"]["dir"] == "somewhere"
    assert list(tmp_path.iterdir()) == []


def test_info_and_help_list_groups_and_fields(examples_dir, capsys):
    assert main(["plan", str(examples_dir / "gpt.py"), "--info", "defaults"]) == 0
    assert "cluster/dgx_h100" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        main(["plan", "--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert "cluster=  calibrated | cpu_gloo" in text and "global_batch_size:int" in text
    assert "hydra/launcher=basic|joblib|submitit_local|submitit_slurm" in text


def test_plan_writes_into_the_hydra_run_dir_with_its_provenance(examples_dir, tmp_path, monkeypatch, capsys):
    """Without --out the plan goes to Hydra's run folder, says so, and keeps .hydra/ beside it;
    a failed plan leaves no folder behind."""
    monkeypatch.chdir(tmp_path)
    assert main(["plan", str(examples_dir / "gpt.py"), *TINY, "hydra.run.dir=runs/${hydra.job.name}",
                 "hydra.job.name=a"]) == 0
    assert "wrote runs/a/plan.json (Hydra's run folder" in " ".join(capsys.readouterr().out.split())
    assert Plan.load(tmp_path / "runs/a/plan.json").world_size == 4
    assert yaml.safe_load((tmp_path / "runs/a/.hydra/overrides.yaml").read_text())[0] == "cluster=cpu_gloo"
    assert yaml.safe_load((tmp_path / "runs/a/.hydra/config.yaml").read_text())["model"]["hidden"] == 64
    assert main(["plan", str(examples_dir / "gpt.py"), *TINY, "plan.tp=3"]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # no outputs/<date>/<time> left over


def test_sweep_writes_into_hydra_sweep_dir(examples_dir, tmp_path, monkeypatch):
    """`autopar plan MODEL -m cluster.nodes=1,2 hydra.sweep.dir=D` writes into D: one folder per
    point with its plan and .hydra/, and the sweep's tables."""
    monkeypatch.chdir(tmp_path)
    assert main(["plan", str(examples_dir / "gpt.py"), *TINY, "cluster.gpus_per_node=1", "-m", "cluster.nodes=1,2",
                 "hydra.sweep.dir=D", "-q"]) == 0
    rows = list(csv.DictReader((tmp_path / "D/sweep.csv").open()))
    assert [(row["overrides"], int(row["gpus"])) for row in rows] == [("cluster.nodes=1", 1), ("cluster.nodes=2", 2)]
    for point in ("0", "1"):
        assert Plan.load(tmp_path / "D" / point / "plan.json").world_size == int(point) + 1
        assert f"cluster.nodes={int(point) + 1}" in (tmp_path / "D" / point / ".hydra/overrides.yaml").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["D"]


# the sweep itself runs by default in the basic launcher (test_sweep_writes_into_hydra_sweep_dir, the wheel check)
@EXTENDED
def test_joblib_launcher_plans_points_in_parallel_processes(examples_dir, tmp_path):
    out = tmp_path / "sweep"
    assert main(["plan", str(examples_dir / "gpt.py"), *TINY, "-m", "cluster.gpus_per_node=1,2",
                 "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "--out-dir", str(out), "-q"]) == 0
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert [int(row["gpus"]) for row in rows] == [1, 2] and {row["status"] for row in rows} == {"ok"}
    assert (out / "multirun.yaml").is_file() and Plan.load(out / "1" / "plan.json").world_size == 2


def test_optuna_minimises_cost_per_million_tokens_under_a_step_time_bound(examples_dir, tmp_path):
    """Optuna's best value is the cheapest cost per million tokens among the points it tried that
    meet the deadline; a point over the deadline scores an infinite cost."""
    out = tmp_path / "sweep"
    # The deadline lets the 4-GPU point through (just above its priced step), whatever the
    # cost model's current prices are, so the bound decides between feasible and infeasible points.
    four = tmp_path / "four.json"
    assert main(["plan", str(examples_dir / "gpt.py"), *TINY, "cluster.gpus_per_node=4", "--out", str(four), "-q"]) == 0
    deadline_s = Plan.load(four).predicted.step_time_s * 1.001
    assert main(["plan", str(examples_dir / "gpt.py"), *TINY, "-m", "cluster.gpus_per_node=choice(1,2,4)",
                 "cluster.price_per_gpu_hour=2", "sweep.objective=cost_per_million_tokens",
                 f"sweep.max_step_time_s={deadline_s}", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=4",
                 "hydra.sweeper.direction=minimize", "hydra.sweeper.sampler.seed=3", "--out-dir", str(out), "-q"]) == 0
    rows = [json.loads(path.read_text()) for path in sorted(out.glob("*/sweep_row.json"))]
    assert len(rows) == 4
    for row in rows:
        expected = row["cost_per_million_tokens"] if row["step_time_s"] <= deadline_s else math.inf
        assert row["objective"] == expected
    best = yaml.safe_load((out / "optimization_results.yaml").read_text())
    assert best["best_value"] == min(row["objective"] for row in rows) < math.inf
    best_row = min(rows, key=lambda row: row["objective"])
    assert best["best_params"]["cluster.gpus_per_node"] == best_row["gpus"]


def test_optuna_direction_must_match_the_objective(examples_dir, tmp_path, capsys):
    err = error_of(capsys, ["plan", str(examples_dir / "gpt.py"), *TINY, "-m", "cluster.gpus_per_node=choice(1,2)",
                            "hydra/sweeper=optuna", "hydra.sweeper.direction=maximize",
                            "--out-dir", str(tmp_path / "s")])
    assert "set hydra.sweeper.direction=minimize" in err and not (tmp_path / "s").exists()


def test_progress_by_phase_in_a_log(examples_dir, tmp_path, capsys):
    """Not on a terminal, each phase is a timestamped line (the solver's too), and bf16 on CPU
    ranks is said to train in fp32."""
    assert main(["plan", str(examples_dir / "gpt.py"), *TINY[:-1], "train.precision=bf16", "--out",
                 str(tmp_path / "plan.json")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "note: train.precision=bf16: CPU ranks compute in fp32" in out
    phases = ["tracing one training step", "traced", "graph nodes in 6 layers", "pricing",
              "candidates (compute floors)", "solving: candidate"]
    positions = [out.index(words) for words in phases]
    assert positions == sorted(positions)


def test_solving_lines_show_the_incumbent_and_gap_at_most_every_interval():
    from rich.console import Console

    from autopar.progress import PhaseProgress
    from autopar.solver.search import SearchProgress

    console = Console(record=True, force_terminal=False, width=200)
    with PhaseProgress(console, "planning", interval_s=3600) as progress:
        progress.phase("tracing")
        progress.search(SearchProgress("pricing", 0, 10))
        progress.search(SearchProgress("solving", 1, 10))
        progress.search(SearchProgress("solving", 2, 10, incumbent_s=0.010, bound_s=0.008))  # within the interval
    lines = console.export_text().splitlines()
    assert [line.split("] ", 1)[1] for line in lines] == [
        "tracing", "pricing 10 candidates (compute floors)", "solving: candidate 1 of 10 in bound order"]
    progress = PhaseProgress(console, "planning", interval_s=0.0)
    progress.search(SearchProgress("solving", 2, 10, incumbent_s=0.010, bound_s=0.008))
    assert console.export_text().strip().endswith("best plan so far 10.0 ms/step, gap ≤ 20.0%")


def test_a_missing_plugin_names_the_extra_that_installs_it(examples_dir, tmp_path, capsys):
    err = error_of(capsys, ["plan", str(examples_dir / "gpt.py"), "-m", "cluster.nodes=1,2", "hydra/launcher=ray",
                            "--out-dir", str(tmp_path / "s")])
    assert "Could not find 'hydra/launcher/ray'" in err and "pip install 'autopar[joblib]'" in err
    assert not (tmp_path / "s").exists()



@pytest.mark.parametrize("value", ["/tmp/runs/a", "runs", "runs [1], it's a b", "true", "1e3",
                                   "runs/${hydra.job.name}", "out/${now:%Y}"])
def test_a_run_folder_read_without_composing_is_the_composed_one(value, monkeypatch):
    """A hydra.run.dir given without interpolation is read from the override alone (a composition
    less per command); the answer is the composed configuration's for every value, including those
    Hydra reads as a bool or a number, and those it must resolve."""
    from hydra.core.utils import setup_globals
    from omegaconf import OmegaConf

    from autopar import hydra_app

    override = hydra_app.setting("hydra.run.dir", value)
    setup_globals()
    composed = str(OmegaConf.select(compose_config([override, "hydra.job.name=plan"], hydra=True), "hydra.run.dir"))
    composes = []
    monkeypatch.setattr(hydra_app, "compose_config", lambda *a, **k: composes.append(1) or compose_config(*a, **k))
    read = hydra_app.resolved_hydra_setting([override, "hydra.job.name=plan"], "hydra.run.dir")
    if "${now" not in value:
        assert read == composed
    assert bool(composes) == (value in {"true", "1e3"} or "${" in value)


def test_folders_with_spaces_commas_and_quotes_reach_hydra_whole(examples_dir, tmp_path):
    """autopar passes --out's folder and --out-dir to Hydra as overrides: quoted, so a comma is
    not a sweep and a space not a parse error."""
    from autopar.hydra_app import setting

    odd = "runs [1], it's a b"
    cfg = compose_config([setting("hydra.run.dir", odd), setting("hydra.sweep.dir", odd)], hydra=True)
    assert cfg.hydra.run.dir == odd and cfg.hydra.sweep.dir == odd
    out = tmp_path / odd / "plan.json"
    assert main(["plan", str(examples_dir / "gpt.py"), *TINY, "--out", str(out), "-q"]) == 0
    assert Plan.load(out).world_size == 4


def test_chdir_runs_the_job_in_its_folder_with_the_given_paths_intact(examples_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpt.py").write_text((examples_dir / "gpt.py").read_text())
    assert main(["plan", "gpt.py", *TINY, "hydra.job.chdir=true", "hydra.run.dir=run", "-q"]) == 0
    assert Plan.load(tmp_path / "run" / "plan.json").world_size == 4
    assert Path.cwd() == tmp_path


def test_objective_values_of_a_row():
    """Hand-worked: 2 GPUs at $3/GPU-hour and 10,000 tokens/s cost 6/3600/1e4*1e6 = $0.1667 per
    million tokens, so a dollar trains 6 million tokens; over the deadline or without a plan the
    worst value (infinite cost, no throughput)."""
    from autopar.sweep import objective_value, row_of

    class Predicted:
        step_time_s, tokens_per_s, samples_per_s, mfu, peak_memory_bytes = 0.5, 10_000.0, 20.0, 0.4, 2**30

    class FakePlan:
        world_size, dp, tp, pp, cp, zero_stage, micro_batch_size, num_micro_batches = 2, 2, 1, 1, 1, 0, 1, 4
        schedule, predicted = "1f1b", Predicted()

    row = row_of(FakePlan(), 3.0, "test")
    assert row["cost_per_million_tokens"] == pytest.approx(6 / 3600 / 1e4 * 1e6)
    assert objective_value(row, "tokens_per_dollar", 0.0) == pytest.approx(6e6)
    assert objective_value(row, "step_time_s", 1.0) == 0.5
    assert objective_value(row, "cost_per_million_tokens", 0.4) == math.inf
    assert objective_value(row, "tokens_per_s", 0.4) == 0.0
    assert objective_value({"status": "no plan: too big"}, "tokens_per_dollar", 0.0) == 0.0

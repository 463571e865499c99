"""Metrics sinks of the generated module (metrics.py beside it): run.jsonl, TensorBoard, and
Weights & Biases / MLflow through fake modules (neither package is a dependency)."""
from __future__ import annotations

import ast
import dataclasses
import json
import sys
import types

import pytest

from autopar.codegen import generate
from autopar.codegen.assemble import module_beside
from autopar.sections import metrics
from autopar.runtime.generated import command_line, import_generated
from tests.dist.plans import GPT, make_plan

STEP = {"step": 3, "loss": 2.5, "step_time_s": 0.25, "tokens_per_s": 4096.0, "peak_memory_bytes": 2**20,
        "attempt": 1, "run_id": "abc"}
VALIDATION = {"step": 4, "val_loss": 2.25}


def test_scalars_are_the_numeric_measurements():
    assert metrics.scalars(STEP) == {"loss": 2.5, "step_time_s": 0.25, "tokens_per_s": 4096.0,
                                     "peak_memory_bytes": float(2**20)}
    assert metrics.scalars({"step": 1, "flag": True, "loss": float("nan"), "lr": 1e-3}) == {"lr": 1e-3}


def test_rank_zero_appends_the_json_line_and_tensorboard_gets_every_scalar(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = tmp_path / "run.jsonl"
    log.write_text(json.dumps({"step": 0, "loss": 9.0}) + "\n")  # an earlier run's record stays
    config = metrics.MetricsConfig(tensorboard=True, tensorboard_dir=str(tmp_path / "tb"))
    logger = metrics.open_logger(log, config, rank=0)
    logger.log(STEP)
    logger.log(VALIDATION)
    logger.close()
    assert [json.loads(line) for line in log.read_text().splitlines()] == [{"step": 0, "loss": 9.0}, STEP, VALIDATION]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"loss", "step_time_s", "tokens_per_s", "peak_memory_bytes", "val_loss"}
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(3, 2.5)]
    assert [(e.step, e.value) for e in events.Scalars("val_loss")] == [(4, 2.25)]


def test_tensorboard_folder_defaults_to_the_run_id_beside_the_log(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-7")
    config = metrics.MetricsConfig(tensorboard=True)
    assert metrics.tensorboard_dir(tmp_path / "run.jsonl", config) == tmp_path / "tensorboard" / "run-7"
    assert metrics.tensorboard_dir(None, config) is None


def test_other_ranks_write_nothing(tmp_path):
    config = metrics.MetricsConfig(tensorboard=True, tensorboard_dir=str(tmp_path / "tb"))
    logger = metrics.open_logger(tmp_path / "run.jsonl", config, rank=1)
    logger.log(STEP)
    logger.close()
    assert list(tmp_path.iterdir()) == []


def test_without_tensorboard_one_warning_and_the_log_still_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    logger = metrics.open_logger(tmp_path / "run.jsonl", metrics.MetricsConfig(tensorboard=True), rank=0)
    logger.log(STEP)
    logger.close()
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("warning:") and "--no-tensorboard" in out
    assert not (tmp_path / "tensorboard").exists()
    assert json.loads((tmp_path / "run.jsonl").read_text()) == STEP


class Calls:
    """A fake package recording the calls made on it."""

    def __init__(self, name: str, *functions: str) -> None:
        self.calls: list[tuple] = []
        self.module = types.ModuleType(name)
        for function in functions:
            setattr(self.module, function, self.recorder(function))

    def recorder(self, function: str):
        return lambda *args, **kwargs: self.calls.append((function, args, kwargs))


def test_wandb_gets_init_log_finish(tmp_path, monkeypatch):
    wandb = Calls("wandb", "init", "log", "finish")
    monkeypatch.setitem(sys.modules, "wandb", wandb.module)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-7")
    metrics.require_packages(metrics.MetricsConfig(wandb_project="proj"))  # installed: no refusal
    logger = metrics.open_logger(tmp_path / "run.jsonl", metrics.MetricsConfig(wandb_project="proj"), rank=0)
    logger.log(STEP)
    logger.log(VALIDATION)
    logger.close()
    assert wandb.calls == [("init", (), {"project": "proj", "name": "run-7"}),
                           ("log", (metrics.scalars(STEP),), {"step": 3}),
                           ("log", ({"val_loss": 2.25},), {"step": 4}),
                           ("finish", (), {})]


def test_mlflow_gets_a_run_in_the_experiment(tmp_path, monkeypatch):
    mlflow = Calls("mlflow", "set_experiment", "start_run", "log_metrics", "end_run")
    monkeypatch.setitem(sys.modules, "mlflow", mlflow.module)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-7")
    logger = metrics.open_logger(None, metrics.MetricsConfig(mlflow_experiment="exp"), rank=0)
    logger.log(STEP)
    logger.close()
    assert mlflow.calls == [("set_experiment", ("exp",), {}), ("start_run", (), {"run_name": "run-7"}),
                            ("log_metrics", (metrics.scalars(STEP),), {"step": 3}), ("end_run", (), {})]


@pytest.mark.parametrize("option, package", [("wandb_project", "wandb"), ("mlflow_experiment", "mlflow")])
def test_a_dashboard_without_its_package_refuses_in_one_line(option, package, monkeypatch):
    monkeypatch.setitem(sys.modules, package, None)  # as if not installed
    with pytest.raises(SystemExit) as refused:
        metrics.require_packages(metrics.MetricsConfig(**{option: "name"}))
    message = str(refused.value)
    assert "\n" not in message and f"pip install {package}" in message


def test_beside_file_imports_only_stdlib_and_torch():
    tree = ast.parse(module_beside("metrics"))
    top = {alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    top |= {node.module.split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom)}
    assert top - set(sys.stdlib_module_names) <= {"torch"}


def test_generated_module_reads_the_metrics_options(tmp_path):
    files = generate(make_plan(GPT, dp=2), GPT.path, tmp_path)
    assert (tmp_path / "metrics.py").read_text() == module_beside("metrics")
    module = import_generated(files.script, "generated_metrics_options")
    defaults = module.train_config(module.PLAN, command_line(module)).metrics  # metrics.py's own class
    assert dataclasses.asdict(defaults) == dataclasses.asdict(metrics.MetricsConfig(tensorboard=True))
    argv = ["--no-tensorboard", "--wandb", "proj", "--mlflow", "exp", "--tensorboard-dir", "tb"]
    chosen = module.train_config(module.PLAN, command_line(module, argv=argv)).metrics
    assert (chosen.tensorboard, chosen.wandb_project, chosen.mlflow_experiment, chosen.tensorboard_dir) == \
        (False, "proj", "exp", "tb")


def test_autopar_run_refuses_a_missing_dashboard_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    from autopar.cli import main

    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed
    assert main(["run", str(tmp_path), "--mlflow", "exp"]) == 1  # no plan.json needed: refused first
    err = capsys.readouterr().err
    assert "--mlflow exp needs the mlflow package" in err and "pip install mlflow" in err

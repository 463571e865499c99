"""Metrics: each step's record to run.jsonl, TensorBoard, and Weights & Biases or MLflow when asked for.

Rank 0 writes; the other ranks get a logger that does nothing. A record is one JSON object per
line of run.jsonl (``step`` and the step's numbers: ``loss``, ``step_time_s``, ... or a
validation record's ``val_loss``); every numeric field except ``step`` and ``attempt`` also goes
to the dashboards, as a scalar at the record's step:
    tensorboard/<run id>/       beside run.jsonl, when the tensorboard package is installed
                                (--tensorboard-dir DIR instead, --no-tensorboard: none);
                                `tensorboard --logdir tensorboard` shows every run of the folder
    --wandb PROJECT             a Weights & Biases run in PROJECT (pip install wandb)
    --mlflow EXPERIMENT         an MLflow run in EXPERIMENT (pip install mlflow)
Asked-for dashboards whose package is missing stop the run before training, on every rank.

It depends on no plan, so a generated folder holds it once, as metrics.py beside the training
module. Only the standard library and torch are imported here; the dashboards' packages are
imported when a run asks for them.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

# Fields of a record that count, or name, rather than measure: not plotted.
NOT_SCALARS = ("step", "attempt")


@dataclass(frozen=True)
class MetricsConfig:
    """Where rank 0 sends the records besides run.jsonl.

    Attributes:
        tensorboard: write TensorBoard event files (skipped, with a warning, without the package).
        tensorboard_dir: their folder; default ``tensorboard/<run id>`` beside the log file.
        wandb_project: a Weights & Biases project to log to, or None.
        mlflow_experiment: an MLflow experiment to log to, or None.
    """

    tensorboard: bool = False
    tensorboard_dir: str | None = None
    wandb_project: str | None = None
    mlflow_experiment: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "MetricsConfig":
        return cls(tensorboard=not args.no_tensorboard, tensorboard_dir=args.tensorboard_dir,
                   wandb_project=args.wandb, mlflow_experiment=args.mlflow)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The training module's metrics options (read back by `MetricsConfig.from_args`)."""
    parser.add_argument("--tensorboard-dir", default=None, metavar="DIR",
                        help="TensorBoard event files here (default: tensorboard/<run id> beside the log file)")
    parser.add_argument("--no-tensorboard", action="store_true", help="write no TensorBoard event files")
    parser.add_argument("--wandb", default=None, metavar="PROJECT",
                        help="also log to this Weights & Biases project (pip install wandb)")
    parser.add_argument("--mlflow", default=None, metavar="EXPERIMENT",
                        help="also log to this MLflow experiment (pip install mlflow)")


# option -> (package, what it is): dashboards a run asks for by name.
DASHBOARDS = {"--wandb": ("wandb", "Weights & Biases"), "--mlflow": ("mlflow", "MLflow")}


def installed(package: str) -> bool:
    """Whether ``package`` can be imported (without importing it: wandb and mlflow take seconds)."""
    if package in sys.modules:  # imported already (None: blocked)
        return sys.modules[package] is not None
    return importlib.util.find_spec(package) is not None


def missing_packages(config: MetricsConfig) -> list[str]:
    """One line per dashboard asked for whose package is not installed (empty: all there)."""
    asked = {"--wandb": config.wandb_project, "--mlflow": config.mlflow_experiment}
    lines = []
    for option, value in asked.items():
        package, title = DASHBOARDS[option]
        if value is not None and not installed(package):
            lines.append(f"{option} {value} needs the {package} package ({title}), which is not installed: "
                         f"pip install {package}, or run without {option}.")
    return lines


def require_packages(config: MetricsConfig) -> None:
    """Stop before training when a dashboard asked for cannot be reached (every rank checks, so
    none waits for a rank that left)."""
    missing = missing_packages(config)
    if missing:
        raise SystemExit(f"error: {missing[0]}")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric fields a dashboard plots (booleans and names are not numbers)."""
    return {name: float(value) for name, value in record.items()
            if name not in NOT_SCALARS and isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)}


class Sink(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """TensorBoard event files: one scalar per field and step."""

    def __init__(self, directory: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory))

    def log(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run (wandb.init / wandb.log / wandb.finish)."""

    def __init__(self, project: str, name: str) -> None:
        self.wandb = importlib.import_module("wandb")
        self.wandb.init(project=project, name=name)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.wandb.log(values, step=step)

    def close(self) -> None:
        self.wandb.finish()


class MlflowSink:
    """An MLflow run in an experiment (mlflow.start_run / log_metrics / end_run)."""

    def __init__(self, experiment: str, name: str) -> None:
        self.mlflow = importlib.import_module("mlflow")
        self.mlflow.set_experiment(experiment)
        self.mlflow.start_run(run_name=name)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def append_no_follow(path: str | Path) -> Any:
    """``path`` opened for appending, refused (never followed) when it is a symbolic link: a
    folder received from someone else could point run.jsonl at any file of the user's."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as error:
        if not os.path.islink(path):
            raise
        raise RuntimeError(f"{path} is a symbolic link (to {os.readlink(path)}); the run never writes through a "
                           "link. Fix: remove the link, or pass --log-file with another path") from error
    return os.fdopen(fd, "a")


class MetricsLogger:
    """Writes each record to the log file (one JSON line) and to every sink; `close` at the end.
    With no log file and no sinks (the ranks other than 0) it does nothing."""

    def __init__(self, log_file: str | Path | None = None, sinks: list[Sink] | None = None) -> None:
        self.log_file = log_file
        self.sinks = list(sinks or [])
        self.on_new_line = False  # whether the log file is known to end with a whole line

    def log(self, record: dict[str, Any]) -> None:
        if self.log_file:
            if not self.on_new_line:
                end_line(self.log_file)
                self.on_new_line = True
            with append_no_follow(self.log_file) as log:
                log.write(json.dumps(record) + "\n")
        values = scalars(record)
        if values and "step" in record:
            for sink in self.sinks:
                sink.log(int(record["step"]), values)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def end_line(path: str | Path) -> None:
    """End a last line left without its newline (a run killed while writing a record), so the
    next record starts a line of its own instead of joining the broken one; readers skip that."""
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            if log.tell() == 0:
                return
            log.seek(-1, os.SEEK_END)
            last = log.read(1)
    except FileNotFoundError:
        return
    if last != b"\n":
        with append_no_follow(path) as log:
            log.write("\n")


def run_name() -> str:
    """torchrun's run id (shared by a run's restarts), else the start time."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return run_id if run_id and run_id != "none" else time.strftime("%Y%m%d-%H%M%S")


def tensorboard_dir(log_file: str | Path | None, config: MetricsConfig) -> Path | None:
    """Where TensorBoard's files go: the option's folder, else ``tensorboard/<run id>`` beside the log."""
    if config.tensorboard_dir:
        return Path(config.tensorboard_dir)
    if not log_file:
        return None
    default = Path(log_file).parent / "tensorboard"
    if default.is_symlink():  # a received folder's link would have the events written wherever it points
        raise RuntimeError(f"{default} is a symbolic link (to {os.readlink(default)}); the run never writes "
                           "through a link. Fix: remove the link, or pass --tensorboard-dir with a folder of yours")
    return default / run_name()


def open_logger(log_file: str | Path | None, config: MetricsConfig, rank: int) -> MetricsLogger:
    """Rank 0's logger with the sinks ``config`` asks for; a logger that does nothing elsewhere."""
    if rank != 0:
        return MetricsLogger()
    sinks: list[Sink] = []
    folder = tensorboard_dir(log_file, config) if config.tensorboard else None
    if folder is not None:
        if not installed("tensorboard"):
            print("warning: the tensorboard package is not installed, so no TensorBoard files are written "
                  "(pip install tensorboard, or pass --no-tensorboard)", flush=True)
        else:
            sinks.append(TensorBoardSink(folder))
    if config.wandb_project is not None:
        sinks.append(WandbSink(config.wandb_project, run_name()))
    if config.mlflow_experiment is not None:
        sinks.append(MlflowSink(config.mlflow_experiment, run_name()))
    return MetricsLogger(log_file, sinks)

"""Running generated modules the way users do: torchrun via `run_local`, and a Python that cannot
import autopar. launch.sh running the real torchrun with its rendezvous is
tests/dist/test_compile_cli.py's (on a folder with hostile names, which covers a plain one)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from autopar.codegen import generate
from autopar.codegen.generate import DEFAULT_OPTIMIZER
from autopar.plans import Plan
from autopar.runtime import read_records, run_local, run_reference
from autopar.runtime.local import finished_everywhere
from tests.dist.plans import GLOBAL_BATCH, GPT, make_plan
from tests.tiers import EXTENDED

# What each step's record in run.jsonl holds (samples: the data position after the step).
RECORD_KEYS = {"step", "loss", "step_time_s", "tokens_per_s", "peak_memory_bytes", "attempt", "run_id", "lr",
               "grad_norm", "samples", "data_wait_s"}


@pytest.fixture(scope="module")
def gpt_dp2(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpt_dp2")
    generate(make_plan(GPT, dp=2), GPT.path, out)
    return out


@EXTENDED  # by default through `autopar run`: test_compile_cli.py's test_run_trains_like_the_unsharded_model
def test_run_local_trains_and_records_one_record_per_step(gpt_dp2):
    """A second run appends to run.jsonl instead of overwriting it: tests/dist/test_compile_cli.py's
    test_recompiling_a_trained_folder_keeps_its_checkpoints_and_run_records finds both runs'
    records after two `autopar run`s of one folder (run_local each time)."""
    result = run_local(gpt_dp2, steps=2)
    assert result.ok, result.error
    assert [r["step"] for r in result.records] == [0, 1]
    assert all(set(r) == RECORD_KEYS for r in result.records)
    reference = run_reference(GPT.path, GPT.kwargs, GLOBAL_BATCH, 2, DEFAULT_OPTIMIZER)
    for record, expected in zip(result.records, reference.losses):
        assert record["loss"] == pytest.approx(expected, rel=1e-5)
        tokens = GLOBAL_BATCH * GPT.kwargs["seq_len"]
        assert record["tokens_per_s"] == pytest.approx(tokens / record["step_time_s"], rel=1e-6)
        assert record["peak_memory_bytes"] > 0


BROKEN_MODEL = '''
import os
import re
import torch
from torch import nn


def build_model(hidden: int = 8) -> nn.Module:
    if os.environ.get("RANK") == "1":
        raise RuntimeError("rank one cannot build the model")
    return nn.Sequential(nn.Linear(hidden, hidden), nn.Linear(hidden, hidden))


def example_batch(batch_size: int, hidden: int = 8):
    return torch.randn(batch_size, hidden)
'''


def run_broken(tmp_path, source: str):
    model = tmp_path / "broken.py"
    model.write_text(source)
    plan = Plan(dp=2, stages=[["0", "1"]], layer_names=["0", "1"], global_batch_size=4, micro_batch_size=2,
                num_micro_batches=1, precision="fp32")
    generate(plan, model, tmp_path / "out")
    return run_local(tmp_path / "out", steps=1, timeout_s=120)


def test_failing_rank_is_named_with_its_error(tmp_path):
    result = run_broken(tmp_path, BROKEN_MODEL)
    assert not result.ok
    assert result.failed_rank == 1
    assert "RuntimeError: rank one cannot build the model" in result.error


@EXTENDED
def test_rank_killed_in_native_code_shows_its_python_stack(tmp_path):
    """A rank dying by a signal (a crash in C++) has no Python exception; torchrun's workers print
    their Python stack (faulthandler), and the error carries it: the signal and the call that died."""
    crashing = BROKEN_MODEL.replace('raise RuntimeError("rank one cannot build the model")',
                                    "import signal; os.kill(os.getpid(), signal.SIGSEGV)")
    result = run_broken(tmp_path, crashing)
    assert not result.ok and result.failed_rank == 1
    assert "SIGSEGV" in result.error
    assert "Fatal Python error: Segmentation fault" in result.error and "build_model" in result.error


def test_generated_module_runs_where_autopar_is_not_installed(gpt_dp2, tmp_path):
    """Ranks run `python -S` (no site-packages, so no installed autopar) with only torch's
    folder on PYTHONPATH, from a copy of the output folder outside the repository."""
    out = tmp_path / "cluster"
    shutil.copytree(gpt_dp2, out, ignore=shutil.ignore_patterns("run.jsonl"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = sysconfig.get_paths()["purelib"]
    probe = subprocess.run([sys.executable, "-S", "-c", "import torch, autopar"], env=env, cwd=out,
                           capture_output=True, text=True)
    assert "No module named 'autopar'" in probe.stderr  # the control: autopar really is out of reach
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--no-python",
                sys.executable, "-S", "parallel_gpt.py", "--steps", "1"]
    run = subprocess.run(launcher, env=env, cwd=out, capture_output=True, text=True, timeout=300)
    output = run.stdout + run.stderr
    # gloo's teardown can abort a rank after every rank said it finished (a loaded CPU;
    # `autopar run` counts such a run as finished, test_run_safety.py): the module ran.
    assert run.returncode == 0 or finished_everywhere(output, 2), run.stdout[-2000:] + run.stderr[-4000:]
    assert len(read_records(out / "run.jsonl")) == 1


def test_autopar_run_shows_progress_lines_and_writes_tensorboard(gpt_dp2, capsys):
    """Without a terminal (as under pytest or CI) `autopar run` prints timestamped progress
    lines; the module writes the same losses to run.jsonl and to a new TensorBoard folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from autopar.cli import main

    before = set((gpt_dp2 / "tensorboard").glob("*"))
    logged = len(read_records(gpt_dp2 / "run.jsonl"))
    assert main(["run", str(gpt_dp2), "--steps", "3"]) == 0
    progress = [line for line in capsys.readouterr().out.splitlines()
                if re.match(r"^\[\d\d:\d\d:\d\d\] step \d/3  loss \d+\.\d{4}  [\d,]+ tokens/s", line)]
    assert progress and progress[0].split("] ")[1].startswith("step 1/3")
    assert progress[-1].split("] ")[1].startswith("step 3/3") and "ETA 0:00:00" in progress[-1]
    records = read_records(gpt_dp2 / "run.jsonl")[logged:]
    assert [r["step"] for r in records] == [0, 1, 2]
    [folder] = set((gpt_dp2 / "tensorboard").glob("*")) - before
    events = EventAccumulator(str(folder))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(r["step"], pytest.approx(r["loss"], rel=1e-6))
                                                                  for r in records]

"""Compile's proof (autopar/runtime/proof.py): a plan whose module crashes at full scale or trains
something else than one process is never written; the planner's next plan is, and the report
and the terminal name what was rejected and why. When no plan passes, nothing is written.

The models (tests/dist/models/) are broken on purpose, so these tests do not depend on which
real-model failures autopar still has: ``no_tp`` raises when a block's weight arrives split
across tensor-parallel ranks, ``batch_mixing`` centres activations on the batch mean (data
parallel ranks see half the batch each: different losses, no crash).
"""
from __future__ import annotations

import json
from pathlib import Path


from autopar.cli import main
from tests.tiers import EXTENDED

MODELS = Path(__file__).resolve().parent / "models"
TWO_CPU_RANKS = ["cluster=cpu_gloo", "cluster.gpus_per_node=2", "train.global_batch_size=8", "train.precision=fp32"]


def test_a_model_with_dropout_is_checked_with_it_off_and_trains_with_it_on(tmp_path):
    """Dropout (nn.Dropout, attention's dropout_p) draws other masks on every sharded rank than on
    one process: compile's check runs both with dropout off (--dropout-off), so a data-parallel
    plan of a model with dropout is proven instead of blamed on the batch split; the module it
    writes trains with dropout on unless told otherwise (its losses differ from the check's)."""
    from autopar.runtime import run_local

    out = tmp_path / "out"
    assert main(["compile", str(MODELS / "with_dropout.py"), *TWO_CPU_RANKS, "plan.dp=2", "check=on",
                 "--out-dir", str(out)]) == 0
    proof = (out / "report.md").read_text().split("## Proof at compile", 1)[1]
    assert "steps on 2 local gloo ranks equal to one process" in proof
    losses = {}
    for name, extra in (("on", []), ("off", ["--dropout-off"])):
        result = run_local(out, steps=2, extra_args=["--seed", "0", *extra])
        assert result.ok, result.error
        losses[name] = [record["loss"] for record in result.records]
    assert losses["on"][0] != losses["off"][0]


def test_a_model_drawing_other_random_numbers_is_run_but_not_compared(tmp_path):
    """Noise drawn in forward (not dropout) differs on every sharded rank whatever the plan: the
    check runs the plan on gloo ranks but compares nothing, says why in the report, and blames
    no way of splitting (the data-parallel plan is written)."""
    out = tmp_path / "out"
    assert main(["compile", str(MODELS / "with_dropout.py"), *TWO_CPU_RANKS, "model.noise=0.5", "plan.dp=2",
                 "check=on", "--out-dir", str(out)]) == 0
    assert json.loads((out / "plan.json").read_text())["dp"] == 2
    proof = " ".join((out / "report.md").read_text().split("## Proof at compile", 1)[1].split())
    assert "ran, not compared with one process: the model draws random numbers in forward besides dropout " \
           "(aten.randn_like in blocks.0" in proof


def test_a_plan_that_crashes_is_rejected_and_the_next_plan_is_written(tmp_path, capsys):
    out = tmp_path / "out"
    # dp and cp pinned to 1: the planner's fastest is a TP split (colwise/rowwise blocks at this
    # width), which the model refuses at run time; the pipeline split after it trains.
    assert main(["compile", str(MODELS / "no_tp.py"), *TWO_CPU_RANKS, "plan.dp=1", "plan.cp=1", "check=on",
                 "--out-dir", str(out)]) == 0
    terminal = capsys.readouterr().out
    plan = json.loads((out / "plan.json").read_text())
    assert plan["tp"] == 1 and plan["pp"] == 2
    report = (out / "report.md").read_text()
    proof = report[report.index("## Proof at compile"):]
    assert "| dp=1 tp=2 pp=1 cp=1" in proof and "this model cannot run tensor-parallel" in proof
    assert "2 steps on 2 local gloo ranks equal to one process" in proof
    assert "rejected at compile: dp=1 tp=2" in " ".join(terminal.split())
    assert "cannot run tensor-parallel" in " ".join(terminal.split())
    rejected = json.loads((out / "report.json").read_text())["rejected"]
    assert rejected and all("tp=2" in r["summary"] for r in rejected)


@EXTENDED  # also held by the default tests below (with dp pinned no plan is left: nothing written)
def test_nothing_is_written_when_every_plan_fails(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["compile", str(MODELS / "no_tp.py"), *TWO_CPU_RANKS, "plan.tp=2", "check=on",
                 "--out-dir", str(out)]) == 1
    error = " ".join(capsys.readouterr().err.split())
    assert "No plan passed compile's proof, so nothing was written" in error
    assert "this model cannot run tensor-parallel" in error and "Traceback" not in error
    assert not out.exists()


def test_a_plan_that_trains_something_else_is_caught_only_by_the_check(tmp_path, capsys):
    pinned = [*TWO_CPU_RANKS, "plan.dp=2", "plan.zero_stage=0", "plan.micro_batch_size=4"]
    checked = tmp_path / "checked"
    assert main(["compile", str(MODELS / "batch_mixing.py"), *pinned, "check=on", "--out-dir", str(checked)]) == 1
    error = " ".join(capsys.readouterr().err.split())
    assert "loss differs from one process by" in error and "at step 0" in error
    # The check blames the batch split (the plan split nothing else) and says how samples meet;
    # with dp pinned no plan is left, and a known cause is no autopar bug.
    assert "to blame: splitting the batch" in error and "the samples of a batch meet" in error
    assert "autopar bug" not in error
    assert "No plan passed compile's proof, so nothing was written" in error and "Traceback" not in error
    assert not checked.exists()
    # check=off skips the small-scale run: the full-scale step on fake tensors passes (the
    # shapes are right), so the plan is written and its report says what was not checked.
    unchecked = tmp_path / "unchecked"
    assert main(["compile", str(MODELS / "batch_mixing.py"), *pinned, "check=off", "--out-dir", str(unchecked),
                 "-q"]) == 0
    report = (unchecked / "report.md").read_text()
    assert "one step at full scale (2 ranks) on fake tensors" in report and "local gloo ranks" not in report


@EXTENDED
def test_a_split_that_trains_something_else_is_not_tried_again(tmp_path, capsys):
    """Unpinned, the fastest plans of the batch-mixing model (narrow, long sequences: little to
    all-reduce for dp, much for TP) split the batch; the check blames that split, so the next plan
    keeps the whole batch in one micro-batch (tensor parallelism) instead of trying the batch
    split again with another ZeRO stage or micro-batch size, as its runners-up do."""
    out = tmp_path / "out"
    settings = ["cluster=cpu_gloo", "cluster.gpus_per_node=2", "train.global_batch_size=32", "train.precision=fp32",
                "model.hidden=16", "model.seq_len=64"]
    assert main(["compile", str(MODELS / "batch_mixing.py"), *settings, "check=on", "--out-dir", str(out)]) == 0
    terminal = " ".join(capsys.readouterr().out.split())
    plan = json.loads((out / "plan.json").read_text())
    assert plan["dp"] == 1 and plan["num_micro_batches"] == 1 and plan["cp"] == 1
    rejected = json.loads((out / "report.json").read_text())["rejected"]
    assert len(rejected) == 1 and "dp=2" in rejected[0]["summary"]
    assert "to blame: splitting the batch" in rejected[0]["reason"]
    assert "not splitting that way again" in terminal


def test_a_saved_plan_that_fails_is_refused_with_its_reason(tmp_path, capsys):
    plan_file = tmp_path / "plan.json"
    assert main(["plan", str(MODELS / "no_tp.py"), *TWO_CPU_RANKS, "plan.tp=2", "plan.sequence_parallel=false",
                 "--out", str(plan_file), "-q"]) == 0
    capsys.readouterr()
    out = tmp_path / "out"
    assert main(["compile", str(MODELS / "no_tp.py"), *TWO_CPU_RANKS, "--plan", str(plan_file),
                 "--out-dir", str(out)]) == 1
    error = " ".join(capsys.readouterr().err.split())
    assert f"The saved plan {plan_file}" in error and "fails compile's proof" in error
    assert "this model cannot run tensor-parallel" in error
    assert not out.exists()


@EXTENDED  # a regression of one model's pipeline (the zoo's frozen GPT, whose ZeRO-3 case runs by default)
def test_a_pipeline_stage_of_frozen_parameters_only_passes_the_full_scale_step(tmp_path):
    # The zoo's frozen GPT (embeddings and the first block frozen) trains under pp=2 on gloo
    # ranks; its first stage's output needs no gradient, which the fake-tensor step once took for
    # a failure and rejected every pipeline plan.
    frozen = Path(__file__).resolve().parents[1] / "zoo" / "models" / "frozen.py"
    out = tmp_path / "out"
    assert main(["compile", str(frozen), *TWO_CPU_RANKS, "plan.pp=2", "check=off", "--out-dir", str(out), "-q"]) == 0
    assert json.loads((out / "plan.json").read_text())["pp"] == 2
    assert "rank 0 (pipeline rank 0): stage(s) [0]" in json.loads((out / "report.json").read_text())["proof"]


@EXTENDED  # the blame of a batch split runs by default (test_a_plan_that_trains_something_else_...), on 2 ranks
def test_a_plan_splitting_several_ways_is_diagnosed_split_by_split(tmp_path, capsys):
    """dp=2 x tp=2 of the batch-mixing model trains something else, and the check alone cannot
    tell which split is to blame; compile checks the batch split alone (dp=2 on 2 ranks), which
    differs too, so the batch split is blamed: with dp pinned nothing is left, and the refusal
    names the measured cause, not an autopar bug."""
    out = tmp_path / "out"
    settings = ["cluster=cpu_gloo", "cluster.gpus_per_node=4", "train.global_batch_size=8", "train.precision=fp32",
                "plan.dp=2", "plan.tp=2", "plan.pp=1", "plan.cp=1", "check=on"]
    assert main(["compile", str(MODELS / "batch_mixing.py"), *settings, "--out-dir", str(out)]) == 1
    error = " ".join(capsys.readouterr().err.split())
    assert "to blame: splitting the batch" in error
    assert "with its batch split alone (dp=2 tp=1 pp=1 cp=1" in error and "split several ways" in error
    assert "autopar bug" not in error and not out.exists()


USER_SCRIPT = """
from pathlib import Path
with Path({marker!r}).open("a") as marker:
    marker.write("ran\\n")
from autopar.cli import main
raise SystemExit(main(["compile", {model!r}, *{settings!r}, "check=on", "--out-dir", {out!r}, "-q"]))
"""


def test_a_script_compiling_from_its_top_level_runs_once(tmp_path):
    """A user's script that calls autopar at its top level (no ``if __name__ == "__main__":``): the
    proof's processes (the check's ranks, the fake step) do not import it again, as
    multiprocessing's children otherwise do, so it runs once and compile succeeds."""
    import os
    import subprocess
    import sys

    marker, script = tmp_path / "ran.txt", tmp_path / "train_it.py"
    script.write_text(USER_SCRIPT.format(marker=str(marker), model=str(MODELS / "with_dropout.py"),
                                         settings=[*TWO_CPU_RANKS, "plan.dp=2"], out=str(tmp_path / "out")))
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(repo)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert marker.read_text() == "ran\n"
    assert "equal to one process" in (tmp_path / "out" / "report.md").read_text()

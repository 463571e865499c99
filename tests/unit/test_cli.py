"""`autopar profile` from the command line: output file, overrides, exit codes."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from autopar.cli import main


def test_profile_writes_required_json_keys(examples_dir, tmp_path, capsys):
    out = tmp_path / "profile.json"
    code = main(["profile", str(examples_dir / "gpt.py"), "model.layers=2", "model.hidden=64", "model.heads=2",
                 "train.micro_batch_size=3", "train.precision=fp32", "--out", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    for key in ("param_count", "param_bytes", "flops_forward", "flops_backward", "layers", "num_nodes", "seconds"):
        assert key in data
    assert data["micro_batch_size"] == 3
    assert [layer["name"] for layer in data["layers"]][2:4] == ["blocks.0", "blocks.1"]
    for layer in data["layers"]:
        assert {"name", "param_count", "flops_forward", "flops_backward", "activation_bytes"} <= set(layer)
    assert "blocks.0 … blocks.1" in capsys.readouterr().out


def test_unknown_override_exits_1_with_one_line(examples_dir, capsys):
    assert main(["profile", str(examples_dir / "gpt.py"), "train.micro_bach_size=2"]) == 1
    err = capsys.readouterr().err.strip()
    assert "micro_bach_size" in err and len(err.splitlines()) <= 3


def test_bad_override_value_exits_1(examples_dir, capsys):
    assert main(["profile", str(examples_dir / "gpt.py"), "train.micro_batch_size=many"]) == 1
    assert "micro_batch_size" in capsys.readouterr().err


def test_missing_model_file_exits_1_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["profile", str(tmp_path / "nope.py"), "--out", str(out)]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert not out.exists()


def test_console_script_is_installed():
    exe = shutil.which("autopar") or str(__import__("pathlib").Path(sys.executable).parent / "autopar")
    result = subprocess.run([exe, "profile", "--help"], capture_output=True, text=True, check=True)
    assert "examples:" in result.stdout and "model.<kwarg>" in result.stdout


def test_the_command_freezes_what_it_leaves_and_keeps_main_s_exit_code(monkeypatch, capsys):
    """`autopar` (the console script and `python -m autopar.cli`) runs `main` with young
    collections less frequent and then freezes the objects left, so the interpreter's last
    collection skips them; its exit code is main's. `main` itself, run by tests and callers whose
    process goes on, changes neither."""
    import gc

    from autopar.cli import command

    installed = (Path(sys.executable).parent / "autopar").read_text()
    assert "from autopar.cli import command" in installed  # the script runs `command`, not `main`
    thresholds = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    assert main(["profile", "--no-such-option"]) == 1 and gc.get_freeze_count() == 0
    assert gc.get_threshold() == thresholds
    monkeypatch.setattr(sys, "argv", ["autopar", "profile", "--no-such-option"])
    try:
        assert command() == 1
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold()[0] > thresholds[0] and gc.get_threshold()[1:] == thresholds[1:]
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
    assert capsys.readouterr().err.count("the following arguments are required") == 2


def test_stage_split_and_layer_recompute_pins_reach_the_plan(examples_dir, tmp_path):
    """plan.stages and plan.layer_recompute from the command line fix the layer-wise split and
    per-layer recomputation; the rest is still searched."""
    out = tmp_path / "plan.json"
    code = main(["plan", str(examples_dir / "gpt.py"), "cluster=cpu_gloo", "cluster.gpus_per_node=2",
                 "model.layers=2", "model.hidden=64", "model.heads=4", "model.seq_len=32", "model.vocab=128",
                 "train.global_batch_size=8", "train.precision=fp32",
                 "plan.stages=[[wte,wpe,blocks.0],[blocks.1,ln_f,lm_head]]", "plan.layer_recompute={blocks.0: full}",
                 "--out", str(out), "-q"])
    assert code == 0
    plan = json.loads(out.read_text())
    assert plan["pp"] == 2 and plan["stages"] == [["wte", "wpe", "blocks.0"], ["blocks.1", "ln_f", "lm_head"]]
    assert plan["recompute"]["blocks.0"] == "full" and plan["recompute"]["blocks.1"] == "none"


def test_stage_pin_that_skips_a_layer_exits_1(examples_dir, capsys):
    code = main(["plan", str(examples_dir / "gpt.py"), "cluster=cpu_gloo", "model.layers=2",
                 "plan.stages=[[wte,wpe,blocks.0],[ln_f,lm_head]]"])
    assert code == 1
    err = capsys.readouterr().err
    assert "plan.stages must list every layer exactly once" in err and "(missing: blocks.1)" in err


def test_plan_twice_writes_the_same_plan_json(examples_dir, tmp_path):
    """Same inputs, same plan.json byte for byte: the solvers are seeded and single-threaded,
    ties go to the earlier candidate in the search space's fixed order, and the search's wall
    time is kept out of the file; the plan records the versions that made it and the model hash."""
    args = ["plan", str(examples_dir / "gpt.py"), "cluster=cpu_gloo", "cluster.gpus_per_node=4", "model.layers=2",
            "model.hidden=64", "model.heads=4", "model.seq_len=32", "model.vocab=128", "train.global_batch_size=8",
            "train.precision=fp32", "-q", "--out"]
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    assert main(args + [str(first)]) == 0 and main(args + [str(second)]) == 0
    assert first.read_bytes() == second.read_bytes()
    plan = json.loads(first.read_text())
    assert "seconds" not in plan["solver"]
    assert set(plan["provenance"]["versions"]) == {"autopar", "torch", "ortools"}
    assert len(plan["provenance"]["model_sha256"]) == 64

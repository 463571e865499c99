"""A tensor-parallel degree whose best split replicates every linear layer is not offered
(autopar/solver/planner.py `_idle_tp`): it would spend tp GPUs on one GPU's work."""
from __future__ import annotations

import json
from pathlib import Path

from autopar.cli import main

MODEL = Path(__file__).resolve().parents[1] / "zoo" / "models" / "value_dependent.py"
# CPU ranks at their default 200 µs link latency: for this small MoE, splitting its expert and
# head linears costs more than it saves, so every tp=2 split replicates them all.
TWO_CPU_RANKS = ["cluster=cpu_gloo", "cluster.gpus_per_node=2", "train.global_batch_size=8", "train.precision=fp32"]


def test_a_degree_that_splits_nothing_is_not_offered(tmp_path, capsys):
    assert main(["plan", str(MODEL), *TWO_CPU_RANKS, "--out", str(tmp_path / "plan.json")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["tp"] == 1 and plan["dp"] == 2
    assert "tp=2 not offered: its best split of this model replicates every linear layer" in out


def test_a_pinned_degree_is_planned_as_pinned(tmp_path, capsys):
    """Pinned, the same degree is kept (its linears could split: the coverage check passes), the
    plan's words say how little it splits, and a warning what the pin costs."""
    assert main(["plan", str(MODEL), *TWO_CPU_RANKS, "plan.tp=2", "--out", str(tmp_path / "plan.json")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert json.loads((tmp_path / "plan.json").read_text())["tp"] == 2
    assert "tensor parallel (tp=2) splits 0% of the blocks' linear parameters" in out
    assert ("warning: plan.tp=2 is pinned, but its best split of this model on this cluster replicates every "
            "linear layer") in out and "leave plan.tp unset" in out

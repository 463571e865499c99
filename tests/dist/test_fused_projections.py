"""Fused projections split as their parts keep the model's own layout wherever weights leave a run.

The model (tests/zoo/models/fused_layouts.py, ``split``) cuts one ``qkv`` projection into q, k
and v of unequal sizes (grouped query attention) and a fused ``gate_up`` into two halves. At tp=2
each rank holds its share of every part, its rows permuted (autopar.sections.fused). The
tests: the plan lists those projections in ``tp_fused`` and the generated module splits them; a
tp2 run ZeRO-3 sharded over 4 ranks checkpoints weights equal to one process's, in its row order;
a checkpoint written by dp2 resumes under tp2 (and, in the extended tier, one written by tp2
under dp2; the zero3 test already reads tp2's saved layout), each finishing equal to one
uninterrupted process; and ``--init-from`` puts a file's rows where each
rank holds them (a tp2 run from a file trains exactly as a dp2 run from it).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autopar.codegen import generate
from autopar.sections.checkpoint import consolidated_weights
from autopar.runtime import run_local, run_reference
from tests.dist.equivalence import OPTIMIZER, assert_trains_like
from tests.dist.plans import GLOBAL_BATCH, REPO, TinyModel, make_plan
from tests.tiers import EXTENDED, tiered

pytestmark = pytest.mark.slow

FUSED = TinyModel(name="fused_layouts", path=REPO / "tests" / "zoo" / "models" / "fused_layouts.py",
                  kwargs=dict(layout="split", layers=2, hidden=32, heads=4, kv_heads=2, seq_len=16, vocab=64),
                  prologue=["wte", "wpe"], container="blocks", blocks=2, epilogue=["ln_f", "lm_head"])
HALF, STEPS = 3, 6
# The rate decays over 6 steps whether a run is asked for 3 or 6 (a resumed run continues one schedule).
SCHEDULED = {**OPTIMIZER, "decay_steps": STEPS}
PLANS = {"tp2": dict(tp=2), "dp2": dict(dp=2), "tp2_zero3": dict(dp=2, tp=2, zero=3)}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fused")
    folders = {}
    for name, pins in PLANS.items():
        plan = make_plan(FUSED, **pins)
        generate(plan, FUSED.path, root / name, optimizer=SCHEDULED)
        folders[name] = root / name
    return folders


@pytest.fixture(scope="module")
def reference() -> dict[int, object]:
    """One process: the losses of 6 steps and the parameters after 3 and after 6."""
    return {steps: run_reference(FUSED.path, FUSED.kwargs, GLOBAL_BATCH, steps, SCHEDULED) for steps in (HALF, STEPS)}


def train(folder: Path, steps: int, checkpoints: Path, *extra: str) -> list[dict]:
    result = run_local(folder, steps=steps, timeout_s=300, extra_args=[
        "--seed", "0", "--checkpoint-dir", str(checkpoints), "--checkpoint-every", str(HALF), *extra])
    assert result.ok, result.error
    return result.records


def assert_parameters_equal(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert found.keys() >= expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(found[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_the_plan_splits_the_fused_projections_as_their_parts(compiled):
    import json

    plan = json.loads((compiled["tp2"] / "plan.json").read_text())
    assert plan["tp_fused"] == {f"blocks.{i}.{module}": parts for i in range(2)
                                for module, parts in (("attn.qkv", [32, 16, 16]), ("mlp.gate_up", [64, 64]))}
    assert all(plan["tp_styles"][f"blocks.{i}.attn.qkv"] == "colwise" for i in range(2))
    source = next(compiled["tp2"].glob("parallel_*.py")).read_text()
    assert "FusedColwise(parts=[32, 16, 16]" in source and "CutsFused(" in source


@EXTENDED
def test_zero3_tp2_checkpoint_holds_the_weights_of_one_process_in_its_row_order(compiled, reference, tmp_path):
    records = train(compiled["tp2_zero3"], HALF, tmp_path / "checkpoints")
    assert_trains_like([r["loss"] for r in records], consolidated_weights(tmp_path / "checkpoints" / f"step_{HALF}"),
                       reference[HALF])


@pytest.mark.parametrize("first, then", tiered([("dp2", "tp2"), ("tp2", "dp2")], default=[("dp2", "tp2")], unpack=True))
def test_a_checkpoint_resumes_across_the_fused_split(compiled, reference, tmp_path, first, then):
    checkpoints = tmp_path / "checkpoints"
    train(compiled[first], HALF, checkpoints)
    records = train(compiled[then], STEPS, checkpoints, "--save-final", str(tmp_path / "final.pt"))
    assert [r["step"] for r in records] == list(range(HALF, STEPS))
    torch.testing.assert_close(torch.tensor([r["loss"] for r in records], dtype=torch.float64),
                               torch.tensor(reference[STEPS].losses[HALF:], dtype=torch.float64), rtol=1e-5, atol=0)
    assert_parameters_equal(torch.load(tmp_path / "final.pt", weights_only=True), reference[STEPS].parameters)


@EXTENDED
def test_init_from_a_file_puts_its_rows_where_the_fused_split_holds_them(compiled, reference, tmp_path):
    weights = tmp_path / "start.pt"
    torch.save(reference[HALF].parameters, weights)
    runs = {}
    for name in ("dp2", "tp2"):
        runs[name] = train(compiled[name], HALF, tmp_path / f"checkpoints_{name}", "--init-from", str(weights),
                           "--save-final", str(tmp_path / f"{name}.pt"))
    torch.testing.assert_close(torch.tensor([r["loss"] for r in runs["tp2"]], dtype=torch.float64),
                               torch.tensor([r["loss"] for r in runs["dp2"]], dtype=torch.float64), rtol=1e-5, atol=0)
    assert runs["tp2"][0]["loss"] != pytest.approx(reference[HALF].losses[0], rel=1e-3)  # it did start from the file
    assert_parameters_equal(torch.load(tmp_path / "tp2.pt", weights_only=True),
                            torch.load(tmp_path / "dp2.pt", weights_only=True))

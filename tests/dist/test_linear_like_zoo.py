"""Hugging Face GPT-2 (Conv1D) and Falcon (FalconLinear, an MLP output modified in place) under a
pinned plan.tp=2: compiled with compile's proof, then 3 steps on 2 gloo ranks equal to one
process (the zoo's own run, tests/zoo/harness.py), with their MLPs and GPT-2's attention
projection split and the coverage recorded in plan.json."""
from __future__ import annotations

import pytest

from autopar.plans import Plan
from tests.zoo.harness import run_zoo

# About a minute and a half on an idle 2-core machine. Extended tier (tests/tiers.py): the same
# splits (Conv1D under the transposed styles, FalconLinear, the in-place output copied) train
# like one process in the default run at module level, tests/dist/test_linear_like_tp.py; here
# they run end to end through compile's proof on the Hugging Face models (also zoo cases
# hf_gpt2-tp2 and hf_falcon-tp2, make test-zoo).
pytestmark = [pytest.mark.slow, pytest.mark.extended]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("linear_like_zoo")
    return root, run_zoo([("hf_gpt2", "tp2"), ("hf_falcon", "tp2")], root)


def _plan(root, case: str) -> Plan:
    return Plan.load(root / case / "compiled" / "plan.json")


def test_gpt2_conv1d_splits_and_trains_like_one_process(outcomes):
    root, found = outcomes
    assert found["hf_gpt2-tp2"].kind == "trains", found["hf_gpt2-tp2"].detail
    styles = _plan(root, "hf_gpt2-tp2").tp_styles
    for block in ("transformer.h.0", "transformer.h.1"):
        assert styles[f"{block}.mlp.c_fc"] == "colwise" and styles[f"{block}.mlp.c_proj"] == "rowwise"
        # c_attn's fused output stays whole (fused output): its partner c_proj splits on its own
        # (the search's choice of column or row split, gathered or sliced)
        assert styles[f"{block}.attn.c_proj"] in ("colwise", "rowwise")
    source = next((root / "hf_gpt2-tp2" / "compiled").glob("parallel_*.py")).read_text()
    assert "TransposedColwiseParallel(" in source and "TransposedRowwiseParallel(" in source
    assert _plan(root, "hf_gpt2-tp2").predicted.tp_param_share >= 0.5


def test_falcon_mlp_splits_with_its_in_place_output_copied_and_trains_like_one_process(outcomes):
    root, found = outcomes
    assert found["hf_falcon-tp2"].kind == "trains", found["hf_falcon-tp2"].detail
    plan = _plan(root, "hf_falcon-tp2")
    for block in ("transformer.h.0", "transformer.h.1"):
        assert plan.tp_styles[f"{block}.mlp.dense_h_to_4h"] == "colwise"
        assert plan.tp_styles[f"{block}.mlp.dense_4h_to_h"] == "rowwise"
    source = next((root / "hf_falcon-tp2" / "compiled").glob("parallel_*.py")).read_text()
    assert "OwnedOutput(style=RowwiseParallel())" in source
    assert plan.predicted.tp_param_share >= 0.5

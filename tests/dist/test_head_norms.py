"""Per-head norms run on the rank's heads and train like one process
(autopar.solver.tp_head_norms).

Hugging Face's Qwen3 (the zoo's: hidden 32, 4 query heads of 8 features, 2 key/value heads)
normalises queries and keys per head (``q_norm``, ``k_norm``). At tp=2 (with and without
sequence parallelism), at tp=4 (key/value projections computed by group) and at dp=2 x tp=2
under ZeRO-3, the plan pairs its attention (q, k, v column-parallel or by group, o_proj
row-parallel) with both norms on head shards (``head_norm``); after 3 steps the losses and every
parameter match the single-process run, and one step issues what the pricer counts, the norms'
weight gradients' all-reduces among them (once a step, every micro-batch under ZeRO-3).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist.equivalence import (Outcome, assert_issues_the_priced_collectives, assert_outcome_trains_like,
                                    run_selected_cases)
from tests.dist.plans import REPO, TinyModel
from tests.tiers import tiered

QWEN3 = TinyModel(name="qwen3", path=REPO / "tests" / "zoo" / "models" / "hf_zoo.py",
                  kwargs=dict(arch="qwen3", layers=2, seq_len=16), prologue=["model.embed_tokens"],
                  container="model.layers", blocks=2, epilogue=["model.norm", "lm_head"])

# case -> (model, pins)
CASES = {"tp2": (QWEN3, dict(tp=2)), "tp2_sp": (QWEN3, dict(tp=2, sp=True)), "tp4": (QWEN3, dict(tp=4)),
         "dp2_tp2_zero3": (QWEN3, dict(dp=2, tp=2, zero=3))}

# The default tier leaves out tp2, whose split tp2_sp holds under SP and dp2_tp2_zero3 without it.
CASE_TIERS = tiered(list(CASES), default=[case for case in CASES if case != "tp2"])


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict[str, Outcome]:
    return run_selected_cases(request, tmp_path_factory, CASES, Path(__file__).resolve())


@pytest.mark.parametrize("case", CASE_TIERS)
def test_plan_pairs_attention_with_its_norms_on_head_shards(case, runs):
    plan = runs[case].plan
    key_value = "kv_group" if plan.tp > 2 else "colwise"
    for block in QWEN3.block_names:
        assert {m[len(block) + 1:]: s for m, s in plan.tp_styles.items() if m.startswith(block + ".self_attn.")} == {
            "self_attn.q_proj": "colwise", "self_attn.k_proj": key_value, "self_attn.v_proj": key_value,
            "self_attn.o_proj": "rowwise", "self_attn.q_norm": "head_norm", "self_attn.k_norm": "head_norm"}


@pytest.mark.parametrize("case", CASE_TIERS)
def test_head_norms_train_like_one_process(case, runs):
    assert_outcome_trains_like(runs[case], QWEN3)


@pytest.mark.parametrize("case", CASE_TIERS)
def test_step_issues_the_priced_collectives(case, runs):
    assert_issues_the_priced_collectives(case, runs[case])

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

from autopar.runtime import run_reference
from tests.dist.equivalence import OPTIMIZER, STEPS, Outcome, assert_trains_like, issued_by_kind, run_pinned_cases
from tests.dist.plans import GLOBAL_BATCH, REPO, TinyModel
from tests.tiers import selected, tiered

QWEN3 = TinyModel(name="qwen3", path=REPO / "tests" / "zoo" / "models" / "hf_zoo.py",
                  kwargs=dict(arch="qwen3", layers=2, seq_len=16), prologue=["model.embed_tokens"],
                  container="model.layers", blocks=2, epilogue=["model.norm", "lm_head"])

# case -> (model, pins)
CASES = {"tp2": (QWEN3, dict(tp=2)), "tp2_sp": (QWEN3, dict(tp=2, sp=True)), "tp4": (QWEN3, dict(tp=4)),
         "dp2_tp2_zero3": (QWEN3, dict(dp=2, tp=2, zero=3))}

# The default tier leaves out tp2 is held by tp2_sp (the same split under SP) and dp2_tp2_zero3 (tp=2 without SP).
CASE_TIERS = tiered(list(CASES), default=[case for case in CASES if case != "tp2"])

@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict[str, Outcome]:
    wanted = selected(request, "case", "runs", Path(__file__).resolve())
    return run_pinned_cases(tmp_path_factory.mktemp("head_norms"), {c: v for c, v in CASES.items() if c in wanted})


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
    run = runs[case]
    assert run.error is None, run.error
    reference = run_reference(QWEN3.path, QWEN3.kwargs, GLOBAL_BATCH, STEPS, OPTIMIZER)
    assert_trains_like(run.losses, run.parameters, reference)


@pytest.mark.parametrize("case", CASE_TIERS)
def test_step_issues_the_priced_collectives(case, runs):
    run = runs[case]
    assert run.error is None, run.error
    issued = issued_by_kind(run)
    priced = run.planner.pricer.issued_collectives(run.plan.layout())
    assert issued == priced, f"{case}: issued {issued}, priced {priced}"

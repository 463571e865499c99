"""Grouped-query attention with more tensor-parallel ranks than key/value heads trains like one
process (autopar.solver.tp_kv_groups).

A Hugging Face Llama (hidden 64, 4 query heads) with 1 key/value head at tp=2 (with and without
sequence parallelism, 2 gloo ranks) and with 2 key/value heads at tp=4 (4 gloo ranks), and a
Hugging Face Phi-3 at tp=4 (2 key/value heads, q, k and v one fused linear whose key/value parts
are computed by group and whose query part splits by heads): the plan
splits q_proj column-wise and o_proj row-wise, computes k_proj and v_proj by key/value group
(``kv_group``: each rank its group's head, the weight split by rows and gathered each forward),
sets the attention's repeat count to
the query heads per rank, and after 3 steps the losses and every parameter match the
single-process run (tolerances as tests/dist/test_equivalence.py); so does the 1-head Llama at
dp=2 x tp=2 under ZeRO-3 (FSDP sharding the row-split key/value weights further). The step
issues what the pricer counts: per block one all-reduce per row-parallel linear in forward, the
regions' input gradients' all-reduces in backward, and per key/value weight one all-gather in
forward and one reduce-scatter of its gradient in backward, every micro-batch.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist.equivalence import (Outcome, assert_issues_the_priced_collectives, assert_outcome_trains_like,
                                    run_selected_cases)
from tests.dist.plans import REPO, TinyModel
from tests.tiers import tiered


def _llama(kv_heads: int) -> TinyModel:
    return TinyModel(name=f"llama_kv{kv_heads}", path=REPO / "examples" / "llama_hf.py",
                     kwargs=dict(layers=2, hidden=64, heads=4, kv_heads=kv_heads, ffn=128, vocab=64, seq_len=16),
                     prologue=["model.embed_tokens"], container="model.layers", blocks=2,
                     epilogue=["model.norm", "lm_head"])


# Hugging Face's Phi-3 at the zoo's size: q, k and v in one fused qkv_proj (2 key/value heads of 4)
PHI3 = TinyModel(name="phi3", path=REPO / "tests" / "zoo" / "models" / "hf_zoo.py",
                 kwargs=dict(arch="phi3", layers=2, seq_len=16), prologue=["model.embed_tokens"],
                 container="model.layers", blocks=2, epilogue=["model.norm", "lm_head"])

# case -> (model, pins)
CASES = {"kv1-tp2": (_llama(1), dict(tp=2)), "kv1-tp2_sp": (_llama(1), dict(tp=2, sp=True)),
         "kv2-tp4": (_llama(2), dict(tp=4)), "kv1-dp2_tp2_zero3": (_llama(1), dict(dp=2, tp=2, zero=3)),
         "phi3-tp4": (PHI3, dict(tp=4))}
# case -> the attention's styles, the key/value heads
ATTENTION = {case: ({"self_attn.q_proj": "colwise", "self_attn.k_proj": "kv_group", "self_attn.v_proj": "kv_group",
                     "self_attn.o_proj": "rowwise"}, model.kwargs["kv_heads"])
             for case, (model, _) in CASES.items() if model is not PHI3}
ATTENTION["phi3-tp4"] = ({"self_attn.qkv_proj": "kv_group", "self_attn.o_proj": "rowwise"}, 2)

# The default tier runs a key/value projection of its own (kv1-tp2_sp) and one fused with the
# query (phi3-tp4, at tp4); the extended tier adds kv1-tp2 (the same split without SP), kv2-tp4
# (separate projections at tp4) and kv1-dp2_tp2_zero3 (FSDP sharding the row-split weights
# further, as the equivalence suite's ZeRO-3 x TP case shards split weights).
CASE_TIERS = tiered(list(CASES), default=["kv1-tp2_sp", "phi3-tp4"])


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict[str, Outcome]:
    return run_selected_cases(request, tmp_path_factory, CASES, Path(__file__).resolve())


@pytest.mark.parametrize("case", CASE_TIERS)
def test_plan_computes_key_value_heads_by_group(case, runs):
    plan, model = runs[case].plan, CASES[case][0]
    styles, kv_heads = ATTENTION[case]
    for block in model.block_names:
        assert {m[len(block) + 1:]: s for m, s in plan.tp_styles.items()
                if m.startswith(block + ".self_attn.")} == styles
    assert plan.tp_kv_heads == kv_heads
    # Phi-3's fused projection: its key and value parts computed by group, its query part split
    assert plan.tp_grouped_parts == ({f"{b}.self_attn.qkv_proj": [1, 2] for b in model.block_names}
                                     if model is PHI3 else {})
    # Hugging Face repeats key/value heads by num_key_value_groups (4 / kv): set to the query
    # heads per rank, found by probing the attention module's integers by value.
    assert plan.tp_region_attributes == {f"{b}.self_attn": {"num_key_value_groups": 4 // plan.tp}
                                         for b in model.block_names}
    assert plan.tp_dtensor_regions == []


@pytest.mark.parametrize("case", CASE_TIERS)
def test_key_value_groups_train_like_one_process(case, runs):
    assert_outcome_trains_like(runs[case], CASES[case][0])


@pytest.mark.parametrize("case", CASE_TIERS)
def test_step_issues_the_priced_collectives(case, runs):
    """One step's collectives, by kind, equal the pricer's, the key/value weights' gathers and
    their gradients' reduce-scatters among them."""
    assert_issues_the_priced_collectives(case, runs[case])

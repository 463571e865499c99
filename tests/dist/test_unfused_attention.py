"""Attention written out (scores by a batched matmul with the causal mask added, softmax, the
weighted values by a second one: Megatron-LM's attention before fused kernels, Hugging Face's
"eager" attention) is split by heads like a fused kernel, and trains like one process.

The plan at tp=2 splits q, k, v column-wise and the output projection row-wise (before, the
mask read by the scores' matmul made it look like a weight, and the softmax needed whole
activations: the attention ran replicated between gathered projections), and a run on 2 gloo
ranks, with and without sequence parallelism and with full recomputation, matches the
single-process run (losses and parameters after 3 steps, tolerances as
tests/dist/test_equivalence.py).
"""
from __future__ import annotations

import pytest
import torch

from autopar.codegen import generate
from autopar.runtime import read_records, run_reference
from tests.dist.equivalence import OPTIMIZER, STEPS, _run_generated_cases, assert_trains_like
from tests.dist.harness import run_ranks
from tests.dist.plans import GLOBAL_BATCH, REPO, TinyModel, make_planner

UNFUSED = TinyModel(name="gpt_unfused", path=REPO / "examples" / "gpt.py",
                    kwargs=dict(layers=2, hidden=32, heads=4, seq_len=16, vocab=64, attention="unfused"),
                    prologue=["wte", "wpe"], container="blocks", blocks=2, epilogue=["ln_f", "lm_head"])
CASES = {"tp2": dict(tp=2), "tp2_sp": dict(tp=2, sp=True),
         "tp2_recompute": dict(tp=2, recompute={"blocks.0": "full", "blocks.1": "selective"})}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("unfused_attention")
    found, jobs = {}, []
    for case, pins in CASES.items():
        plan = make_planner(UNFUSED, **pins).run().plan
        out = root / case
        files = generate(plan, UNFUSED.path, out, optimizer=OPTIMIZER)
        found[case] = {"plan": plan, "log": out / "run.jsonl", "final": out / "final.pt"}
        jobs.append((case, str(files.script), str(out / "run.jsonl"), str(out / "final.pt")))
    run_ranks(_run_generated_cases, 2, jobs, timeout_s=900)
    for run in found.values():
        run["losses"] = [r["loss"] for r in read_records(run["log"])]
        run["parameters"] = torch.load(run["final"], weights_only=True)
    return found


@pytest.mark.parametrize("case", list(CASES))
def test_unfused_attention_is_split_by_heads(case, runs):
    plan = runs[case]["plan"]
    for block in UNFUSED.block_names:
        assert {m[len(block) + 1:]: s for m, s in plan.tp_styles.items() if m.startswith(block + ".")} == {
            "attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise", "attn.out_proj": "rowwise",
            "mlp.fc_in": "colwise", "mlp.fc_out": "rowwise"}


@pytest.mark.parametrize("case", list(CASES))
def test_unfused_attention_split_by_heads_trains_like_one_process(case, runs):
    reference = run_reference(UNFUSED.path, UNFUSED.kwargs, GLOBAL_BATCH, STEPS, OPTIMIZER)
    assert_trains_like(runs[case]["losses"], runs[case]["parameters"], reference)

"""Attention written out (scores by a batched matmul with the causal mask added, softmax, the
weighted values by a second one: Megatron-LM's attention before fused kernels, Hugging Face's
"eager" attention) is split by heads like a fused kernel, and trains like one process.

The plan at tp=2 splits q, k, v column-wise and the output projection row-wise (before, the
mask read by the scores' matmul made it look like a weight, and the softmax needed whole
activations: the attention ran replicated between gathered projections), and a run on 2 gloo
ranks, with and without sequence parallelism and with full recomputation, matches the
single-process run (losses and parameters after 3 steps, tolerances as
tests/dist/test_equivalence.py).

With dropout on the attention probabilities (and on the residual branches) the attention still
splits, its region listed in ``tp_random_regions``, and the generated code seeds that region's
generators per rank (``RankRandomNumbers``): recorded on 2 ranks, each rank draws its own mask
for its heads, every rank the same mask for the replicated residual branch, and full
recomputation draws, for every region it runs again, the mask its forward drew.

Under selective recomputation each rank keeps its projections' outputs and reruns the scores
and the weighted values on its heads (products of two activations), as the cost model prices.
"""
from __future__ import annotations

import hashlib

import pytest
import torch

from autopar.codegen import generate
from collections import Counter

import torch.nn.functional as F

from autopar.runtime import read_records, run_reference
from autopar.runtime.generated import import_generated
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


DROPOUT = TinyModel(name="gpt_dropout", path=REPO / "examples" / "gpt.py",
                    kwargs={**UNFUSED.kwargs, "attention_dropout": 0.5, "hidden_dropout": 0.5},
                    prologue=UNFUSED.prologue, container="blocks", blocks=2, epilogue=UNFUSED.epilogue)
DROPOUT_CASES = {"tp2": dict(tp=2),
                 "tp2_full_recompute": dict(tp=2, recompute={"blocks.0": "full", "blocks.1": "full"})}


def _record_masks(rank: int, world_size: int, jobs: list[tuple[str, str, str]]) -> dict[str, list[tuple[str, str]]]:
    """Per case, each F.dropout call of one training step on this rank: ("attention" or
    "residual", a digest of the kept positions)."""
    torch.set_num_threads(1)
    original = F.dropout
    found: dict[str, list[tuple[str, str]]] = {}

    def recording(input, p=0.5, training=True, inplace=False):
        out = original(input, p, training, inplace)
        if training and p > 0:
            kept = (out != 0).to(torch.uint8).contiguous().numpy().tobytes()
            scores = input.shape[-1] == input.shape[-2]  # queries x keys; the residual stream is b x s x h
            found[case].append(("attention" if scores else "residual", hashlib.sha256(kept).hexdigest()))
        return out

    F.dropout = recording
    try:
        for case, script, log_file in jobs:
            found[case] = []
            module = import_generated(script, f"generated_dropout_{case}")
            module.main(["--steps", "1", "--seed", "0", "--log-file", log_file])
    finally:
        F.dropout = original
    return found


@pytest.fixture(scope="module")
def dropout_runs(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("dropout_on_shards")
    plans, jobs = {}, []
    for case, pins in DROPOUT_CASES.items():
        plans[case] = make_planner(DROPOUT, **pins).run().plan
        out = root / case
        files = generate(plans[case], DROPOUT.path, out, optimizer=OPTIMIZER)
        jobs.append((case, str(files.script), str(out / "run.jsonl")))
    masks = run_ranks(_record_masks, 2, jobs, timeout_s=900)
    return {case: {"plan": plans[case], "masks": [by_case[case] for by_case in masks],
                   "losses": [r["loss"] for r in read_records(root / case / "run.jsonl")]} for case in DROPOUT_CASES}


def _of(kind: str, masks: list[tuple[str, str]]) -> list[str]:
    return [digest for found, digest in masks if found == kind]


@pytest.mark.parametrize("case", list(DROPOUT_CASES))
def test_attention_with_dropout_splits_and_seeds_its_region_per_rank(case, dropout_runs):
    plan = dropout_runs[case]["plan"]
    assert plan.tp_styles["blocks.0.attn.out_proj"] == "rowwise"
    assert plan.tp_random_regions == ["blocks.0.attn", "blocks.1.attn"]
    assert all(loss == loss for loss in dropout_runs[case]["losses"])  # trains (no NaN)


@pytest.mark.parametrize("case", list(DROPOUT_CASES))
def test_each_rank_draws_its_own_mask_on_its_heads_and_the_same_on_replicated_branches(case, dropout_runs):
    first, second = dropout_runs[case]["masks"]
    assert len(_of("attention", first)) == len(_of("attention", second)) > 0
    assert all(a != b for a, b in zip(_of("attention", first), _of("attention", second)))
    assert _of("residual", first) == _of("residual", second) and _of("residual", first)


def test_recomputation_draws_the_masks_its_forward_drew(dropout_runs):
    """Each attention region runs twice under full recomputation, and draws each of its masks
    twice, not a fresh one for backward. (The block's last residual dropout is not counted:
    recomputation stops inside it, at the last tensor backward reads.)"""
    for masks in dropout_runs["tp2_full_recompute"]["masks"]:
        assert set(Counter(_of("attention", masks)).values()) == {2}


def _record_products(rank: int, world_size: int, script: str, log_file: str) -> list[tuple[str, str]]:
    """Each product the checkpoint policy saw in one step on this rank: (op, decision)."""
    torch.set_num_threads(1)
    module = import_generated(script, "generated_selective_products")
    policy = module._selective_policy
    seen: list[tuple[str, str]] = []

    def recording(ctx, op, *args, **kwargs):
        decision = policy(ctx, op, *args, **kwargs)
        if op in module._PRODUCT_OPS:
            seen.append((op.__name__.split(".")[0], decision.name))
        return decision

    module._selective_policy = recording
    module.main(["--steps", "1", "--seed", "0", "--log-file", log_file])
    return seen


def test_selective_recomputation_reruns_the_attention_core_on_each_ranks_heads(tmp_path):
    """Split by heads, selective recomputation keeps the projections' outputs and reruns the
    scores and the weighted values (Megatron-LM's attention core), as the cost model prices it
    (tests/unit/test_selective_products.py): the policy tells a product of two activations from
    one with a weight on each rank's shards too."""
    plan = make_planner(UNFUSED, tp=2, recompute={"blocks.0": "selective", "blocks.1": "selective"}).run().plan
    files = generate(plan, UNFUSED.path, tmp_path, optimizer=OPTIMIZER)
    for seen in run_ranks(_record_products, 2, str(files.script), str(tmp_path / "run.jsonl"), timeout_s=600):
        per_block = [("mm", "MUST_SAVE")] * 3 + [("baddbmm", "PREFER_RECOMPUTE"), ("bmm", "PREFER_RECOMPUTE")] + \
            [("mm", "MUST_SAVE")] * 3
        calls = len(seen) // len(per_block)  # each block once per micro-batch
        assert calls >= 2 and [(op.replace("addmm", "mm"), decision) for op, decision in seen] == per_block * calls

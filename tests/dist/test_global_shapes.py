"""A GPT whose code views by global sizes (``b, s, h = x.shape``, ``view(b, s, self.n_head,
h // self.n_head)``) is split like one written for shares, and trains like one process.

Its paired regions run with DTensor activations (autopar.solver.tp_global_shapes): the plan
splits q, k, v, proj and the MLP, lists those regions in ``tp_dtensor_regions``, and a run at
tp=2 on 2 gloo ranks (with and without sequence parallelism) matches the single-process run
(losses and parameters after 3 steps, tolerances as tests/dist/test_equivalence.py). The same
GPT written with ``view(b, s, -1, d)`` (examples/gpt.py, local tensors) runs beside it: the
DTensor path issues exactly the collectives the local one does, no hidden all-gather.
"""
from __future__ import annotations

import pytest
import torch

from autopar.codegen import generate
from autopar.runtime import read_records, run_reference
from tests.dist.equivalence import OPTIMIZER, STEPS, _run_generated_cases, assert_trains_like
from tests.dist.harness import run_ranks
from tests.dist.plans import GLOBAL_BATCH, REPO, TinyModel, make_planner

SIZE = dict(layers=2, hidden=32, heads=4, seq_len=16, vocab=64)
GLOBAL_VIEWS = TinyModel(name="gpt_global_shapes", path=REPO / "tests" / "dist" / "models" / "gpt_global_shapes.py",
                         kwargs=SIZE, prologue=["wte", "wpe"], container="blocks", blocks=2,
                         epilogue=["ln_f", "lm_head"])
LOCAL_VIEWS = TinyModel(name="gpt_local_views", path=REPO / "examples" / "gpt.py", kwargs=SIZE, prologue=["wte", "wpe"],
                        container="blocks", blocks=2, epilogue=["ln_f", "lm_head"])
CASES = {"tp2": dict(tp=2), "tp2_sp": dict(tp=2, sp=True)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Per ``model-case``: its plan, losses, final parameters and per-rank collectives of step 2."""
    root = tmp_path_factory.mktemp("global_shapes")
    found, jobs = {}, []
    for model in (GLOBAL_VIEWS, LOCAL_VIEWS):
        for case, pins in CASES.items():
            case_id = f"{model.name}-{case}"
            plan = make_planner(model, **pins).run().plan
            out = root / case_id
            files = generate(plan, model.path, out, optimizer=OPTIMIZER)
            found[case_id] = {"plan": plan, "log": out / "run.jsonl", "final": out / "final.pt"}
            jobs.append((case_id, str(files.script), str(out / "run.jsonl"), str(out / "final.pt")))
    issued = run_ranks(_run_generated_cases, 2, jobs, timeout_s=900)
    for case_id, run in found.items():
        run["losses"] = [r["loss"] for r in read_records(run["log"])]
        run["parameters"] = torch.load(run["final"], weights_only=True)
        run["issued"] = [by_case[case_id] for by_case in issued]
    return found


@pytest.mark.parametrize("case", list(CASES))
def test_plan_splits_every_block_linear_of_a_gpt_viewing_by_global_sizes(case, runs):
    plan = runs[f"gpt_global_shapes-{case}"]["plan"]
    for block in GLOBAL_VIEWS.block_names:
        assert {m[len(block) + 1:]: s for m, s in plan.tp_styles.items() if m.startswith(block + ".")} == {
            "attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.proj": "rowwise",
            "mlp.fc": "colwise", "mlp.out": "rowwise"}
    assert plan.tp_dtensor_regions == [f"{b}.{r}" for b in GLOBAL_VIEWS.block_names for r in ("attn", "mlp")]
    # The GPT written for shares keeps local tensors: no DTensor dispatch where it is not needed.
    assert runs[f"{LOCAL_VIEWS.name}-{case}"]["plan"].tp_dtensor_regions == []


@pytest.mark.parametrize("case", list(CASES))
def test_a_gpt_viewing_by_global_sizes_trains_like_one_process(case, runs):
    run = runs[f"gpt_global_shapes-{case}"]
    reference = run_reference(GLOBAL_VIEWS.path, GLOBAL_VIEWS.kwargs, GLOBAL_BATCH, STEPS, OPTIMIZER)
    assert_trains_like(run["losses"], run["parameters"], reference)


@pytest.mark.parametrize("case", list(CASES))
def test_dtensor_regions_issue_the_collectives_of_local_ones(case, runs):
    """Same plan shape, same collectives per step: the views and SDPA stay on local shards."""
    global_plan, local_plan = runs[f"gpt_global_shapes-{case}"]["plan"], runs[f"{LOCAL_VIEWS.name}-{case}"]["plan"]
    assert sorted(global_plan.tp_styles.values()) == sorted(local_plan.tp_styles.values())
    assert runs[f"gpt_global_shapes-{case}"]["issued"] == runs[f"{LOCAL_VIEWS.name}-{case}"]["issued"]


"""Every kind of split trains like the unsharded model: numerical parity of the *generated
module* with a single-process run of the original model.

For each case (tests/dist/equivalence.py: the cases, run once per session by the `outcomes`
fixture) a plan is generated into ``parallel_<model>.py``, run for 3 optimizer steps on gloo
ranks from the same seed, and compared with `run_reference` (same weights, same batches,
AdamW): the loss of every step and every parameter after the last step, gathered to full
tensors. One spawn of ranks per world size runs all of that size's cases in sequence.

Tolerances (fp32 throughout):
- Sharding changes only the order of floating-point sums (a matmul split over ranks, gradients
  reduced over ranks, micro-batches accumulated), which perturbs results at ~1e-7 relative.
  Losses must agree to rtol 1e-5; parameters to rtol 1e-4 and atol 1e-5.
- atol: some gradients are zero in exact arithmetic (a key bias cannot change a softmax over
  keys), so in fp32 they are rounding noise of ~1e-9 whose sign depends on summation order.
  AdamW divides by sqrt(v) + eps, which turns such noise into steps of up to lr * noise / eps;
  the tests use eps = 1e-6 (instead of 1e-8, which would make those steps ~lr/10 and
  different for *any* change of reduction order, including a different GPU) so the amplified
  noise stays below 1e-5 in absolute terms. Every other parameter is held to rtol 1e-4.

The collectives a generated step issues are the ones its plan was priced with (here, beside the
runs it reads, so that one process computes them; tests/dist/test_collective_counts.py holds the
tensor-parallel counts per micro-batch). Every plan, per step
(`test_step_issues_the_priced_collectives`): for each plan of the equivalence suite
(tests/dist/equivalence.py, both models), the run the equivalence test compares with one
process also profiles its second step's `train_step` on every rank (the
torch profiler, CPU events). The c10d op of every collective call is counted (`C10D`: the
transport's one event per call, whoever issued it: FSDP, DTensor's functional collectives,
torch.distributed calls), on the ranks of the pipeline group through rank 0 (one rank per
stage, coordinate 0 on every other axis), summed, by kind. That equals
`PlanPricer.issued_collectives` of the plan: tensor-, expert-, data-, pipeline- and
context-parallel groups' calls in one step. Why the second step: the first one's set-up (FSDP's
lazy initialisation, the pipeline's shape inference) is not a steady step; profiling only
`train_step` leaves out, in one named place, what a step does besides training and what no
price covers: the logged loss's all-reduce and the peak memory's (`timed_step`'s measurement).
A send and its receive are one `send_recv`; the receives are checked to match the sends. A c10d
op that no kind names fails the test (an unpriced collective cannot slip through).
"""

from __future__ import annotations

import pytest
import torch

from autopar.runtime import run_reference
from tests.dist.equivalence import (CASES, DEFAULT_IDS, IDS, OPTIMIZER, STEPS, Case,
                                    assert_issues_the_priced_collectives)
from tests.dist.plans import GLOBAL_BATCH, MODELS
from tests.tiers import tiered


@pytest.fixture(scope="module")
def references() -> dict[str, object]:
    return {name: run_reference(model.path, model.kwargs, GLOBAL_BATCH, STEPS, OPTIMIZER)
            for name, model in MODELS.items()}


@pytest.mark.parametrize("case_id", tiered(IDS, DEFAULT_IDS))
def test_generated_module_matches_unsharded_model(case_id, outcomes, references):
    """Loss per step and final parameters equal the single-process run of the original model."""
    outcome = outcomes[case_id]
    assert outcome.error is None, outcome.error
    reference = references[case_id.split("-")[0]]
    torch.testing.assert_close(torch.tensor(outcome.losses, dtype=torch.float64),
                               torch.tensor(reference.losses, dtype=torch.float64), rtol=1e-5, atol=0)
    assert set(reference.parameters) <= set(outcome.parameters)
    for name, expected in reference.parameters.items():
        torch.testing.assert_close(outcome.parameters[name], expected, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    # The loss moved: three steps of training happened (guards against a no-op run).
    assert outcome.losses[0] != outcome.losses[-1]


@pytest.mark.parametrize("case_id", tiered([f"gpt-{c.name}" for c in CASES if "pp2" in c.name], DEFAULT_IDS))
def test_tied_embedding_and_head_stay_identical_across_stages(case_id, outcomes):
    """GPT ties its LM head to the token embedding; pipeline stages hold one copy each, and the
    summed gradient keeps both copies equal, as the single tensor would be."""
    outcome = outcomes[case_id]
    assert outcome.error is None, outcome.error
    torch.testing.assert_close(outcome.parameters["lm_head.weight"], outcome.parameters["wte.weight"],
                               rtol=0, atol=0)


@pytest.mark.parametrize("model", list(MODELS))
def test_planned_tp_splits_shard_the_blocks(model):
    """The planner's operator-wise split is what the TP cases exercise: Megatron's pairing on the
    fast link (every block linear split, column then row); on the slow one, GPT's attention split
    and its MLP replicated, and the tiny Llama's blocks replicated whole. (Llama's only partial
    split would be q/k/v column-parallel without o_proj, each output gathered on its own, which
    the ILP prices as codegen runs it: measured, the blocks split whole up to 30 µs per message
    and replicate whole from 33 µs, so its slow case is sequence parallelism around replicated
    blocks.)"""
    tiny = MODELS[model]
    block = tiny.block_names[0]

    def block_styles(case: Case) -> list[str]:
        return [style for module, style in case.plan(tiny).tp_styles.items() if module.startswith(block + ".")]

    assert sorted(set(block_styles(Case("tp2", dict(tp=2))))) == ["colwise", "rowwise"]
    slow = set(block_styles(Case("tp2_sp_mixed_split", dict(tp=2, sp=True, mixed_tp=True))))
    assert slow == ({"colwise", "rowwise", "replicate"} if model == "gpt" else {"replicate"})


@pytest.mark.parametrize("case_id", tiered(IDS, DEFAULT_IDS))
def test_step_issues_the_priced_collectives(case_id, outcomes):
    """One step's collectives, by kind, equal those priced for the plan (the module docstring says how)."""
    assert_issues_the_priced_collectives(case_id, outcomes[case_id])

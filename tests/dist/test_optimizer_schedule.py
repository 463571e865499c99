"""The generated module's optimizer trains like the single-process reference under every split:
warmup then cosine learning rate, weight decay on the decayed group only, and gradients clipped
by the global norm on every step.

The tiny GPT (tests/dist/plans.py) trains `STEPS` steps under dp2, ZeRO-1 dp2, ZeRO-3 dp2, tp2,
pp2 (1F1B; its head is tied to the embedding across the two stages), cp2 (ring) and a
parameter server on 2 ranks (whose exchange clips between averaging and stepping), all in one
spawn of 2 gloo ranks, and `run_reference` trains the unsharded model with torch's own
``clip_grad_norm_`` and AdamW's two groups. Compared per step: the loss, the logged gradient norm
(before clipping) and learning rate; after the last step every parameter. Tolerances as the
equivalence suite's (tests/dist/test_equivalence.py), whose eps=1e-6 this uses too. The norm is
held below every step's (checked on the reference), so every step clips; the weight decay is
large enough (lr x weight_decay = 1e-3 per step) that decaying the exempt parameters too would
move them past the tolerance (checked against a reference run that decays everything).
"""
from __future__ import annotations


import pytest
import torch

from autopar.codegen import generate
from autopar.codegen.generate import DEFAULT_OPTIMIZER
from autopar.runtime import read_records, run_reference
from autopar.runtime.generated import import_generated
from tests.dist.equivalence import Case
from tests.dist.harness import run_ranks
from tests.dist.plans import GLOBAL_BATCH, GPT

STEPS = 4
OPTIMIZER = {**DEFAULT_OPTIMIZER, "eps": 1e-6, "lr": 1e-3, "weight_decay": 1.0, "warmup_steps": 2,
             "schedule": "cosine", "max_grad_norm": 0.05}
CASES = [Case("dp2", dict(dp=2)), Case("zero1_dp2", dict(dp=2, zero=1)), Case("zero3_dp2", dict(dp=2, zero=3)),
         Case("tp2", dict(tp=2)), Case("pp2_1f1b", dict(pp=2, schedule="1f1b")),
         Case("cp2_ring", dict(cp=2, cp_strategy="ring", zero=2)),
         Case("dp2_parameter_server", dict(dp=2, dp_sync="ps"), gpus_per_node=2)]


def _train(rank: int, world_size: int, jobs: list[tuple[str, str, str, str]]) -> None:
    torch.set_num_threads(1)
    for name, script, log_file, final in jobs:
        module = import_generated(script, f"optimizer_{name}")
        module.main(["--steps", str(STEPS), "--seed", "0", "--log-file", log_file, "--save-final", final])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[list[dict], dict[str, torch.Tensor]]]:
    """Per case: its run.jsonl records and final parameters (one spawn of 2 ranks for all)."""
    root = tmp_path_factory.mktemp("optimizer")
    jobs = []
    for case in CASES:
        plan = case.plan(GPT)
        assert plan.world_size == 2, case.name
        out = root / case.name
        files = generate(plan, GPT.path, out, optimizer=OPTIMIZER, gpus_per_node=case.gpus_per_node)
        jobs.append((case.name, str(files.script), str(out / "run.jsonl"), str(out / "final.pt")))
    run_ranks(_train, 2, jobs, timeout_s=600)
    return {name: (read_records(log_file), torch.load(final)) for name, _, log_file, final in jobs}


@pytest.fixture(scope="module")
def reference():
    return run_reference(GPT.path, GPT.kwargs, GLOBAL_BATCH, STEPS, OPTIMIZER)


def test_reference_clips_every_step_and_warms_up(reference):
    assert min(reference.grad_norms) > 4 * OPTIMIZER["max_grad_norm"]
    # warmup 5e-4, 1e-3; cosine from step 2 over the 2 steps left: 1e-3, 5e-4
    assert reference.lrs == pytest.approx([5e-4, 1e-3, 1e-3, 5e-4])


def test_decay_groups_are_visible_in_the_parameters(reference):
    """Decaying every parameter moves the exempt ones (here a LayerNorm gain) past the tolerance
    the cases are held to, so the comparison below sees which group each parameter is in."""
    everything = run_reference(GPT.path, GPT.kwargs, GLOBAL_BATCH, STEPS, {**OPTIMIZER, "decay_all": True})
    with pytest.raises(AssertionError):
        torch.testing.assert_close(everything.parameters["ln_f.weight"], reference.parameters["ln_f.weight"],
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", [case.name for case in CASES])
def test_schedule_decay_and_clipping_match_one_process(case, runs, reference):
    records, parameters = runs[case]
    assert [r["step"] for r in records] == list(range(STEPS))
    torch.testing.assert_close(torch.tensor([r["loss"] for r in records], dtype=torch.float64),
                               torch.tensor(reference.losses, dtype=torch.float64), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in records], dtype=torch.float64),
                               torch.tensor(reference.grad_norms, dtype=torch.float64), rtol=1e-5, atol=0)
    assert [r["lr"] for r in records] == pytest.approx(reference.lrs, rel=1e-12)
    assert set(reference.parameters) <= set(parameters)
    for name, expected in reference.parameters.items():
        torch.testing.assert_close(parameters[name], expected, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")

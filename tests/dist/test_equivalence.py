"""Every kind of split trains like the unsharded model: numerical parity of the *generated
module* with a single-process run of the original model.

For each case a plan is generated into ``parallel_<model>.py``, run for 3 optimizer steps on
gloo ranks from the same seed, and compared with `run_reference` (same weights, same batches,
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
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from autopar.runtime.generated import import_generated
from autopar.codegen import generate
from autopar.codegen.generate import DEFAULT_OPTIMIZER
from autopar.runtime import read_records, run_reference
from tests.dist.harness import RankFailure, run_ranks
from tests.dist.plans import GLOBAL_BATCH, GPT, LLAMA, MODELS, TinyModel, boundary_stages, make_plan

STEPS = 3
OPTIMIZER = {**DEFAULT_OPTIMIZER, "eps": 1e-6}  # see the module docstring


@dataclass(frozen=True)
class Case:
    """One parallel configuration: plan pins and how many ranks it needs."""

    name: str
    pins: dict = field(default_factory=dict)
    gpus_per_node: int | None = None
    models: tuple[str, ...] = ("gpt", "llama_hf")

    def plan(self, model: TinyModel):
        pins = dict(self.pins)
        if pins.pop("boundary_stages", False):
            pins["stages"] = boundary_stages(model)
        if pins.pop("uneven_stages", False):
            blocks = model.block_names
            pins["stages"] = [model.prologue + blocks[:3], blocks[3:] + model.epilogue]
        recompute = pins.pop("recompute_blocks", None)
        if recompute:
            pins["recompute"] = {b: mode for b, mode in zip(model.block_names, recompute)}
        return make_plan(model, gpus_per_node=self.gpus_per_node, **pins)


CASES = [
    Case("dp2", dict(dp=2)),
    Case("zero1_dp2", dict(dp=2, zero=1)),
    Case("zero2_dp2", dict(dp=2, zero=2)),
    Case("zero3_dp4", dict(dp=4, zero=3)),
    Case("tp2", dict(tp=2)),
    Case("tp2_sp", dict(tp=2, sp=True)),
    Case("tp2_sp_mixed_split", dict(tp=2, sp=True, mixed_tp=True)),
    Case("pp2_gpipe", dict(pp=2, schedule="gpipe")),
    Case("pp2_1f1b", dict(pp=2, schedule="1f1b")),
    Case("pp2_interleaved_v2", dict(pp=2, schedule="interleaved_1f1b", chunks=2, boundary_stages=True)),
    Case("recompute_dp2", dict(dp=2, recompute_blocks=["full", "full", "selective", "selective"])),
    Case("dp2_tp2", dict(dp=2, tp=2)),
    Case("dp2_pp2", dict(dp=2, pp=2)),
    Case("tp2_pp2_sp", dict(tp=2, pp=2, sp=True)),
    Case("zero3_dp2_tp2_pp2", dict(dp=2, tp=2, pp=2, zero=3, sp=True, schedule="interleaved_1f1b", chunks=2,
                                    boundary_stages=True, recompute_blocks=["none", "selective", "full", "none"],
                                    num_micro_batches=2)),
    # Beyond the list: hybrid sharding (ZeRO-3 inside a "node" of 2 ranks, replicated across 2).
    Case("zero3_hybrid_2x2", dict(dp=4, zero=3, hybrid=True), gpus_per_node=2),
    # Context parallelism: each strategy at cp 2 and 4, with TP + SP, and with data parallelism.
    Case("cp2_ulysses", dict(cp=2, cp_strategy="ulysses", zero=2)),
    Case("cp2_ring", dict(cp=2, cp_strategy="ring", zero=2)),
    Case("cp4_ulysses", dict(cp=4, cp_strategy="ulysses", zero=2), models=("gpt",)),  # tiny Llama: 2 KV heads
    Case("cp4_ring", dict(cp=4, cp_strategy="ring", zero=3)),
    Case("cp2_tp2_sp_ulysses", dict(cp=2, tp=2, sp=True, cp_strategy="ulysses", zero=2), models=("gpt",)),
    Case("cp2_tp2_ring", dict(cp=2, tp=2, cp_strategy="ring", zero=2)),
    Case("zero3_dp2_cp2_ring", dict(dp=2, cp=2, cp_strategy="ring", zero=3)),
    Case("cp2_pp2_ring", dict(cp=2, pp=2, cp_strategy="ring", zero=2)),
    Case("cp2_pp2_ulysses", dict(cp=2, pp=2, cp_strategy="ulysses", zero=2), models=("gpt",)),
    # Recomputation around CP attention: the recomputed forward repeats the ring passes and
    # all-to-alls, and selective recomputation keeps nothing inside ring attention.
    Case("cp2_ring_recompute", dict(cp=2, cp_strategy="ring", zero=2,
                                    recompute_blocks=["selective", "full", "selective", "none"])),
    Case("cp2_ulysses_recompute", dict(cp=2, cp_strategy="ulysses", zero=2,
                                       recompute_blocks=["full", "selective", "none", "selective"]), models=("gpt",)),
    # Gradient synchronisation algorithms on 4 ranks as 2 "nodes" x 2 (flat ring is dp2/zero3_dp4).
    Case("dp4_hierarchical", dict(dp=4, dp_sync="hierarchical"), gpus_per_node=2),
    Case("zero1_dp4_hierarchical", dict(dp=4, zero=1, dp_sync="hierarchical"), gpus_per_node=2),
    Case("dp4_halving_doubling", dict(dp=4, dp_sync="halving_doubling")),
    Case("dp4_parameter_server", dict(dp=4, dp_sync="ps"), gpus_per_node=2),
    Case("dp2_tp2_parameter_server", dict(dp=2, tp=2, dp_sync="ps"), gpus_per_node=2),
    # Heterogeneous clusters: uneven data-parallel shares (3:1 samples, losses weighted by them)
    # and an uneven pipeline split (3 blocks on the first stage, 1 on the second).
    Case("dp2_shares_3_1", dict(dp=2, dp_shares=[3, 1], zero=2)),
    Case("pp2_uneven_3_1", dict(pp=2, uneven_stages=True)),
]
IDS = [f"{model}-{case.name}" for model in MODELS for case in CASES if model in case.models]


def _run_generated_cases(rank: int, world_size: int, jobs: list[tuple[str, str, str, str]]) -> list[str]:
    """Run each generated module's ``main`` in this rank's (shared) process group."""
    torch.set_num_threads(1)  # ranks share the machine's cores, as torchrun's default arranges
    done = []
    for case_id, script, log_file, final in jobs:
        module = import_generated(script, f"generated_{case_id.replace('-', '_')}")
        try:
            module.main(["--steps", str(STEPS), "--seed", "0", "--log-file", log_file, "--save-final", final])
        except Exception as err:
            raise RuntimeError(f"case {case_id} failed on rank {rank}") from err
        done.append(case_id)
    return done


@dataclass
class Outcome:
    losses: list[float] | None = None
    parameters: dict[str, torch.Tensor] | None = None
    error: str | None = None


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, Outcome]:
    """Generate every case, run them grouped by world size, and collect losses and parameters."""
    root = tmp_path_factory.mktemp("equivalence")
    by_world: dict[int, list[tuple[str, str, str, str]]] = {}
    results: dict[str, Outcome] = {}
    for model_name, model in MODELS.items():
        for case in CASES:
            if model_name not in case.models:
                continue
            case_id = f"{model_name}-{case.name}"
            plan = case.plan(model)
            out = root / case_id
            files = generate(plan, model.path, out, optimizer=OPTIMIZER, gpus_per_node=case.gpus_per_node)
            by_world.setdefault(plan.world_size, []).append(
                (case_id, str(files.script), str(out / "run.jsonl"), str(out / "final.pt")))
    for world_size, jobs in sorted(by_world.items()):
        for attempt in range(2):
            try:
                run_ranks(_run_generated_cases, world_size, jobs, timeout_s=900)
                break
            except RankFailure as failure:
                # A rank killed by a signal (a rare abort inside gloo's transport on an
                # oversubscribed host) is retried once; any Python error fails the cases.
                if failure.killed and attempt == 0:
                    print(f"retrying world size {world_size}: {failure.args[0].splitlines()[1]}")
                    continue
                for case_id, *_ in jobs:
                    results.setdefault(case_id, Outcome(error=str(failure)))
                break
        for case_id, _, log_file, final in jobs:
            if case_id in results:
                continue
            if not Path(final).exists():
                results[case_id] = Outcome(error=f"{case_id} saved no parameters")
                continue
            results[case_id] = Outcome(losses=[r["loss"] for r in read_records(log_file)],
                                       parameters=torch.load(final))
    return results


@pytest.fixture(scope="module")
def references() -> dict[str, object]:
    return {name: run_reference(model.path, model.kwargs, GLOBAL_BATCH, STEPS, OPTIMIZER)
            for name, model in MODELS.items()}


@pytest.mark.parametrize("case_id", IDS)
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


@pytest.mark.parametrize("case", [c.name for c in CASES if "pp2" in c.name])
def test_tied_embedding_and_head_stay_identical_across_stages(case, outcomes):
    """GPT ties its LM head to the token embedding; pipeline stages hold one copy each, and the
    summed gradient keeps both copies equal, as the single tensor would be."""
    outcome = outcomes[f"gpt-{case}"]
    assert outcome.error is None, outcome.error
    torch.testing.assert_close(outcome.parameters["lm_head.weight"], outcome.parameters["wte.weight"],
                               rtol=0, atol=0)


@pytest.mark.parametrize("model", list(MODELS))
def test_planned_tp_splits_shard_the_blocks(model):
    """The planner's operator-wise split is what the TP cases exercise: Megatron's pairing on the
    fast link (every block linear split, column then row), part split and part replicated on the
    slow one."""
    tiny = MODELS[model]
    block = tiny.block_names[0]

    def block_styles(case: Case) -> list[str]:
        return [style for module, style in case.plan(tiny).tp_styles.items() if module.startswith(block + ".")]

    assert sorted(set(block_styles(Case("tp2", dict(tp=2))))) == ["colwise", "rowwise"]
    mixed = set(block_styles(Case("tp2_sp_mixed_split", dict(tp=2, sp=True, mixed_tp=True))))
    assert "colwise" in mixed and "replicate" in mixed

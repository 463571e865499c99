"""The equivalence suite's cases, generated and run once per test session.

Every case's plan is generated into ``parallel_<model>.py`` and run for `STEPS` optimizer steps
on gloo ranks from the same seed (one spawn of ranks per world size runs all of that size's
cases in sequence). Each run keeps what the tests compare: the loss of every step, every
parameter after the last step (gathered to full tensors), and the collectives each rank issued
in the second step's `train_step` (`count_collectives`), which tests/dist/test_collective_counts.py
holds against the prices. tests/dist/conftest.py runs it as a session fixture, so the
equivalence and collective-count tests share one run.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autopar.codegen import generate
from autopar.codegen.generate import DEFAULT_OPTIMIZER
from autopar.plans import Plan
from autopar.runtime import read_records, run_reference
from autopar.runtime.generated import import_generated
from autopar.runtime.measure import host_events
from autopar.solver.planner import Planner
from autopar.domain.mesh import Mesh
from tests.dist.harness import RankFailure, run_ranks
from tests.dist.plans import GLOBAL_BATCH, MODELS, TinyModel, boundary_stages, make_planner
from tests.tiers import selected

STEPS = 3
OPTIMIZER = {**DEFAULT_OPTIMIZER, "eps": 1e-6}  # see tests/dist/test_equivalence.py's docstring
COUNTED_STEP = 1  # the second step: past set-up and first-step initialisation, a steady one


@dataclass(frozen=True)
class Case:
    """One parallel configuration: plan pins and how many ranks it needs."""

    name: str
    pins: dict = field(default_factory=dict)
    gpus_per_node: int | None = None
    models: tuple[str, ...] = ("gpt", "llama_hf")

    def plan(self, model: TinyModel) -> Plan:
        return self.planner(model).run().plan

    def planner(self, model: TinyModel) -> Planner:
        """The planner pinned to this case (its `pricer` prices the plan it makes)."""
        pins = dict(self.pins)
        if pins.pop("boundary_stages", False):
            pins["stages"] = boundary_stages(model)
        if pins.pop("uneven_stages", False):
            blocks = model.block_names
            pins["stages"] = [model.prologue + blocks[:3], blocks[3:] + model.epilogue]
        recompute = pins.pop("recompute_blocks", None)
        if recompute:
            pins["recompute"] = {b: mode for b, mode in zip(model.block_names, recompute)}
        return make_planner(model, gpus_per_node=self.gpus_per_node, **pins)


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
# The default run (tests/tiers.py): every technique and combination kind above once, on GPT, and
# the tiny Llama (grouped-query attention, an untied head, Hugging Face's code) under each kind
# of split (data, tensor with its own operator-wise split, pipeline, context). The extended tier
# adds the remaining Llama cases and the GPT cases whose kinds a default case already combines
# (Ulysses alone and at cp4, which cp2 x tp2 Ulysses and cp4 ring run, a second cp x tp and cp x
# pp, Ulysses under recomputation, hierarchical sync under ZeRO-1, the parameter server beside tp, dp x tp and
# dp x pp and tp x pp, which the dp x tp x pp case runs together), GPT's mixed split and cp2 ring
# (the Llama runs them by default), GPT's plain tp2 (tp2_sp and the dp x tp x pp case split the
# same way) and 1F1B (the Llama's), per-block recomputation under dp (the dp x tp x pp and cp2 ring
# cases recompute block by block, full and selective), ZeRO-2 over dp2 (dp2_shares_3_1 runs it),
# dp x cp under ZeRO-3 (cp4 ring shards like it), the Llama's tp2 SP (its mixed split runs SP),
# GPipe (a schedule class beside the default tier's 1F1B and interleaved ones) and
# halving-doubling (its collective is test_gradient_sync.py's, its exchange the one the parameter
# server and hierarchical cases run by default).
EXTENDED_GPT = {"cp2_ulysses", "cp4_ulysses", "cp2_tp2_ring", "cp2_pp2_ulysses", "cp2_ulysses_recompute",
                "zero1_dp4_hierarchical", "dp2_tp2_parameter_server", "dp2_tp2", "dp2_pp2", "tp2_pp2_sp",
                "tp2_sp_mixed_split", "cp2_ring", "tp2", "pp2_1f1b", "zero3_dp2_cp2_ring", "pp2_gpipe",
                "dp4_halving_doubling", "recompute_dp2", "zero2_dp2"}
DEFAULT_LLAMA = {"zero3_dp4", "tp2_sp_mixed_split", "pp2_1f1b", "cp2_ring"}
DEFAULT_IDS = [f"gpt-{case.name}" for case in CASES if case.name not in EXTENDED_GPT] + \
    [f"llama_hf-{name}" for name in sorted(DEFAULT_LLAMA)]


def assert_trains_like(losses: list[float], parameters: dict[str, torch.Tensor], reference: Any) -> None:
    """A sharded run equal to one process (``reference``, a ReferenceRun): losses to rtol 1e-5,
    a loss that moved, and every parameter to rtol 1e-4 (test_equivalence.py's tolerances)."""
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(reference.losses, dtype=torch.float64), rtol=1e-5, atol=0)
    assert losses[0] != losses[-1]
    for name, expected in reference.parameters.items():
        torch.testing.assert_close(parameters[name], expected, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


def count_collectives(module: Any, step: int) -> dict[str, int]:
    """Wrap ``module.train_step`` so that its call for ``step`` runs under the torch profiler;
    returns the dict it fills: profiler event name -> calls (c10d and gloo events only).

    Only `train_step` is profiled: the step's other collectives, the logged loss's all-reduce
    (`global_loss`) and the peak memory's (`timed_step`), measure the run and are not priced."""
    from torch.profiler import ProfilerActivity, profile

    counts: dict[str, int] = {}
    inner, calls = module.train_step, []

    def train_step(*args: Any, **kwargs: Any) -> Any:
        calls.append(None)
        if len(calls) != step + 1:
            return inner(*args, **kwargs)
        with profile(activities=[ProfilerActivity.CPU]) as trace:
            result = inner(*args, **kwargs)
        counts.update(Counter(name for name, _, _ in host_events(trace) if "c10d" in name or "gloo" in name))
        return result

    module.train_step = train_step
    return counts


def _run_generated_cases(rank: int, world_size: int, jobs: list[tuple[str, str, str, str]]
                         ) -> dict[str, dict[str, int]]:
    """Run each generated module's ``main`` in this rank's (shared) process group; per case, the
    profiler events of collectives in the counted step's `train_step`."""
    torch.set_num_threads(1)  # ranks share the machine's cores, as torchrun's default arranges
    issued = {}
    for case_id, script, log_file, final in jobs:
        module = import_generated(script, f"generated_{case_id.replace('-', '_')}")
        issued[case_id] = count_collectives(module, COUNTED_STEP)
        try:
            module.main(["--steps", str(STEPS), "--seed", "0", "--log-file", log_file, "--save-final", final])
        except Exception as err:
            raise RuntimeError(f"case {case_id} failed on rank {rank}") from err
    return issued


@dataclass
class Outcome:
    """One case's run: what each test compares (or the error that stopped it)."""

    plan: Plan | None = None
    planner: Planner | None = None  # its pricer priced the plan
    losses: list[float] | None = None
    parameters: dict[str, torch.Tensor] | None = None
    issued: list[dict[str, int]] | None = None  # per rank: profiler event -> calls in the counted step
    error: str | None = None


def run_cases(root: Path, wanted: set[str] | None = None) -> dict[str, Outcome]:
    """Generate every case under ``root`` (those in ``wanted``, when given), run them grouped by
    world size, and collect each one's losses, final parameters and issued collectives."""
    by_world: dict[int, list[tuple[str, str, str, str]]] = {}
    results: dict[str, Outcome] = {}
    for model_name, model in MODELS.items():
        for case in CASES:
            case_id = f"{model_name}-{case.name}"
            if model_name not in case.models or (wanted is not None and case_id not in wanted):
                continue
            planner = case.planner(model)
            plan = planner.run().plan
            results[case_id] = Outcome(plan=plan, planner=planner)
            out = root / case_id
            files = generate(plan, model.path, out, optimizer=OPTIMIZER, gpus_per_node=case.gpus_per_node)
            by_world.setdefault(plan.world_size, []).append(
                (case_id, str(files.script), str(out / "run.jsonl"), str(out / "final.pt")))
    for world_size, jobs in sorted(by_world.items()):
        _run_world(world_size, jobs, results)
    return results


def run_pinned_cases(root: Path, cases: dict[str, tuple[TinyModel, dict]]) -> dict[str, Outcome]:
    """Plan each case (case id -> (model, `make_planner` pins)), generate it under ``root``, run
    them grouped by world size, and collect each one's outcome (as `run_cases`)."""
    by_world: dict[int, list[tuple[str, str, str, str]]] = {}
    results: dict[str, Outcome] = {}
    for case_id, (model, pins) in cases.items():
        planner = make_planner(model, **pins)
        plan = planner.run().plan
        results[case_id] = Outcome(plan=plan, planner=planner)
        out = root / case_id
        files = generate(plan, model.path, out, optimizer=OPTIMIZER)
        by_world.setdefault(plan.world_size, []).append(
            (case_id, str(files.script), str(out / "run.jsonl"), str(out / "final.pt")))
    for world_size, jobs in sorted(by_world.items()):
        _run_world(world_size, jobs, results)
    return results


def run_selected_cases(request: Any, tmp_path_factory: Any, cases: dict[str, tuple[TinyModel, dict]],
                       where: Path) -> dict[str, Outcome]:
    """`run_pinned_cases` of the cases (the ``case`` parameter) that this session's tests in the
    file ``where`` read through their ``runs`` fixture (tests/tiers.py)."""
    wanted = selected(request, "case", "runs", where)
    return run_pinned_cases(tmp_path_factory.mktemp(where.stem), {c: v for c, v in cases.items() if c in wanted})


def assert_outcome_trains_like(outcome: Outcome, model: TinyModel) -> None:
    """A case's run equal to one process of ``model`` (`assert_trains_like`)."""
    assert outcome.error is None, outcome.error
    reference = run_reference(model.path, model.kwargs, GLOBAL_BATCH, STEPS, OPTIMIZER)
    assert_trains_like(outcome.losses, outcome.parameters, reference)


def assert_issues_the_priced_collectives(case_id: str, outcome: Outcome) -> None:
    """One step's collectives, by kind, equal those priced for the case's plan (every send
    with its receive)."""
    assert outcome.error is None, outcome.error
    issued = issued_by_kind(outcome)
    assert issued.pop("recv", 0) == issued.get("send_recv", 0), f"{case_id}: a send without its receive: {issued}"
    priced = outcome.planner.pricer.issued_collectives(outcome.plan.layout())
    assert issued == priced, f"{case_id}: issued {issued}, priced {priced} ({outcome.plan.summary()})"


def _run_world(world_size: int, jobs: list[tuple[str, str, str, str]], results: dict[str, Outcome]) -> None:
    """Run one world size's cases in one spawn and fill their outcomes."""
    issued = None
    for attempt in range(2):
        try:
            issued = run_ranks(_run_generated_cases, world_size, jobs, timeout_s=900)
            break
        except RankFailure as failure:
            # A rank killed by a signal (a rare abort inside gloo's transport on an
            # oversubscribed host) is retried once; any Python error fails the cases.
            if failure.killed and attempt == 0:
                print(f"retrying world size {world_size}: {failure.args[0].splitlines()[1]}")
                continue
            for case_id, *_ in jobs:
                results[case_id].error = str(failure)
            break
    for case_id, _, log_file, final in jobs:
        outcome = results[case_id]
        if outcome.error is not None:
            continue
        if not Path(final).exists():
            outcome.error = f"{case_id} saved no parameters"
            continue
        outcome.losses = [r["loss"] for r in read_records(log_file)]
        outcome.parameters = torch.load(final)
        outcome.issued = [by_case[case_id] for by_case in issued]


# The c10d op of each collective call -> the kind the pricer names. A send and its receive make
# one exchange (`send_recv`), counted by its send; "recv" is checked against it.
C10D = {"c10d::allreduce_": "all_reduce", "c10d::_allgather_base_": "all_gather",
        "c10d::allgather_into_tensor_coalesced_": "all_gather", "c10d::_reduce_scatter_base_": "reduce_scatter",
        "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter", "c10d::alltoall_base_": "all_to_all",
        "c10d::send": "send_recv", "c10d::recv_": "recv"}


def issued_by_kind(outcome: Outcome) -> dict[str, int]:
    """Calls in the counted step on the pipeline group through rank 0, by kind (c10d ops that no
    kind names keep their event name, so they show up as unpriced)."""
    counts: Counter = Counter()
    for rank in Mesh.of(outcome.plan.layout()).group_ranks("pp"):
        for event, calls in outcome.issued[rank].items():
            if event.startswith("c10d::"):
                counts[C10D.get(event, event)] += calls
    return dict(counts)

"""The collectives a generated step issues are the ones its plan was priced with.

Every plan, per step: tests/dist/test_equivalence.py (`test_step_issues_the_priced_collectives`,
beside the equivalence runs it reads).

Tensor parallelism, per micro-batch (`test_priced_tp_collectives_are_issued`):
For each tensor-parallel plan of the equivalence suite (tp2, tp2_sp, tp2_sp_mixed_split, both
models) and a plan whose modules all stay replicated under sequence parallelism (the case the
pricer once divided by t and priced no gathers for), the generated module trains one step on 2
gloo ranks under the torch profiler, once at 2 and once at 4 micro-batches. Set-up and what a
step issues once (the logged loss, the optimizer's reductions of replicated gradients) are the
same in both runs, so their difference is 2 micro-batches' worth of collectives: what the pricer
prices per micro-batch (`IssuedCollectives.tp_collectives`), by kind.

How they are made equal: a split region (attention, MLP with paired matmuls) receives its input
as one replicated DTensor, so q, k and v share one reduction of their input gradient as the ILP
prices it (codegen's PrepareModuleInput, use_local_output=False); under SP that reduction is the
region's reduce-scatter and the row-parallel output's all-reduce its reduce-scatter (forward) and
all-gather (backward), and the pricer lists them so (`autopar.solver.tp_split.issued_collectives`).

A column-parallel linear outside a paired region gathers its output at once, in codegen and in
the ILP alike (`ILPSplitter._unpaired_columns`). Before that rule, at 40 µs per message the ILP
split Llama's q, k and v with no row-parallel partner and priced attention on head shards with
one gather, where codegen gathered all three outputs (60 all-gathers issued against 44 priced per
two micro-batches); now the ILP prices the three gathers and keeps the block replicated (36 and 36).

A fully recomputed layer issues its forward collectives again only up to the last tensor its
backward reads: non-reentrant checkpointing stops the re-run forward there, so a block's last
row-parallel output is not reduced twice (`autopar.solver.tp_split._recomputed_forward`; before
that rule the mixed-recompute interleaved plan dp2 x tp2 x pp2 was priced 44 reduce-scatters
and issued 42).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from autopar.codegen import generate
from autopar.config import PlanPins, SolverConfig
from autopar.runtime.generated import import_generated
from autopar.runtime.measure import host_events
from autopar.solver.planner import Planner
from autopar.solver.tp_split import ILPSplitter
from cost_models.step import PlanPricer, TrainSpec
from cost_models.topology import ClusterConfig, ClusterSpec
from tests.dist.harness import run_ranks
from tests.dist.plans import FAST_LINK_US, GLOBAL_BATCH, GPT, LLAMA, SLOW_LINK_US, TinyModel, _profile
from tests.tiers import selected, tiered

# Profiler event -> the collective the pricer names (functional collectives are what DTensor
# issues; each also shows as its c10d call, counted once here).
EVENTS = {"_c10d_functional::all_gather_into_tensor": "all_gather",
          "_c10d_functional::reduce_scatter_tensor": "reduce_scatter",
          "_c10d_functional::all_reduce": "all_reduce"}
# tp2 / tp2_sp / tp2_sp_mixed_split of the equivalence suite, and every module replicated (a
# link so slow that the operator-wise solver splits nothing).
REPLICATE_LINK_US = 1e6
CASES = [(model, sp, latency) for model in (GPT, LLAMA)
         for sp, latency in ((False, FAST_LINK_US), (True, FAST_LINK_US), (True, SLOW_LINK_US),
                             (True, REPLICATE_LINK_US))]
IDS = [f"{model.name}-{'sp' if sp else 'nosp'}-{latency:g}us" for model, sp, latency in CASES]


def _cluster(latency_us: float) -> ClusterSpec:
    return ClusterSpec.from_config(ClusterConfig(name="tiny_cpu", gpu="cpu", nodes=1, gpus_per_node=2,
                                                 intra_node_latency_us=latency_us, intra_node_bandwidth_GBps=1.5))


def _plan_and_price(model: TinyModel, sp: bool, latency_us: float):
    """The planner's plan at 2 micro-batches, its priced TP collectives, and the same plan at 4."""
    profile, cluster = _profile(model), _cluster(latency_us)
    train = TrainSpec(global_batch_size=GLOBAL_BATCH, precision="fp32", optimizer="adam")
    pins = PlanPins(tp=2, sequence_parallel=sp, micro_batch_size=GLOBAL_BATCH // 2)
    plan = Planner(profile, cluster, train, SolverConfig(time_limit_s=60, top_k=0), pins).run().plan
    priced = PlanPricer(profile, cluster, train, ILPSplitter(profile)).issued.tp_collectives(plan.layout())
    return plan, priced, plan.with_updates(micro_batch_size=GLOBAL_BATCH // 4, num_micro_batches=4)


def _count_step(rank: int, world_size: int, jobs: list[tuple[str, str]]) -> dict[str, dict[str, int]]:
    """Per script: collective -> count in a profiled run of one step (set-up included)."""
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    found = {}
    for script, folder in jobs:
        module = import_generated(script, f"counted_{Path(folder).name}")
        with profile(activities=[ProfilerActivity.CPU]) as trace:
            module.main(["--steps", "1", "--seed", "0", "--log-file", str(Path(folder) / "run.jsonl")])
        found[script] = dict(Counter(EVENTS[name] for name, _, _ in host_events(trace) if name in EVENTS))
    return found


# The default run counts GPT without SP and with every module replicated under SP, and Llama's
# mixed split at 40 µs (the case that found the unpaired-columns rule, SP on); the others repeat
# a layout these count.
DEFAULT_IDS = [f"gpt-nosp-{FAST_LINK_US:g}us", f"gpt-sp-{REPLICATE_LINK_US:g}us", f"llama_hf-sp-{SLOW_LINK_US:g}us"]
REPLICATED_IDS = [f"{model.name}-sp-{REPLICATE_LINK_US:g}us" for model in (GPT, LLAMA)]


@pytest.fixture(scope="module")
def counted(request, tmp_path_factory) -> dict[str, dict]:
    """Per case this session reads: the plan's priced collectives, and those issued by a one-step
    run, at 2 and 4 micro-batches (one spawn of 2 ranks for every case)."""
    root = tmp_path_factory.mktemp("counts")
    wanted = selected(request, "case_id", "counted", Path(__file__).resolve())
    jobs, cases = [], {}
    for case_id, (model, sp, latency) in zip(IDS, CASES):
        if case_id not in wanted:
            continue
        plan, priced, doubled = _plan_and_price(model, sp, latency)
        entry = {2: dict(plan=plan, priced=priced), 4: dict(plan=doubled)}
        for m in (2, 4):
            folder = root / f"{case_id.replace('.', '_')}-m{m}"
            files = generate(entry[m]["plan"], model.path, folder)
            jobs.append((str(files.script), str(folder)))
            entry[m]["script"] = str(files.script)
        cases[case_id] = entry
    runs = run_ranks(_count_step, 2, jobs, timeout_s=900)[0]
    for entry in cases.values():
        for m in (2, 4):
            entry[m]["run"] = runs[entry[m]["script"]]
    return cases


@pytest.mark.parametrize("case_id", tiered(IDS, DEFAULT_IDS))
def test_priced_tp_collectives_are_issued(case_id, counted):
    """2 micro-batches' collectives (a 4-micro-batch run minus a 2-micro-batch one) equal those
    priced for 2 micro-batches, by kind."""
    entry = counted[case_id]
    issued = {k: entry[4]["run"].get(k, 0) - entry[2]["run"].get(k, 0) for k in EVENTS.values()}
    priced = {k: entry[2]["priced"].get(k, 0) for k in EVENTS.values()}
    assert issued == priced, f"{case_id}: issued {issued}, priced {priced} ({entry[2]['plan'].summary()})"


@pytest.mark.parametrize("case_id", tiered(REPLICATED_IDS, DEFAULT_IDS))
def test_every_module_replicated_under_sp_is_priced_with_its_gathers(case_id, counted):
    """The issue's case: no module split, sequence parallelism on. Each block's replicated
    attention and MLP gather the sequence in forward and their gradient in backward, so
    all-gathers are issued (and priced), and no matrix is split."""
    model = {m.name: m for m in (GPT, LLAMA)}[case_id.split("-")[0]]
    entry = counted[case_id]
    assert set(entry[2]["plan"].tp_styles.values()) <= {"replicate"}
    assert entry[2]["priced"].get("all_gather", 0) >= 4 * model.blocks * 2

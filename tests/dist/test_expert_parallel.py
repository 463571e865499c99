"""Generated expert-parallel modules train like one process.

Property: a module `autopar.codegen` generates for a plan with ep > 1 (experts sharded over ep
consecutive data-parallel ranks, tokens dispatched and combined by all-to-all, FSDP over the
rest), run on 2 and on 4 gloo ranks for three AdamW steps, gives the per-step losses of the unsharded
model on one process (rtol 1e-5) and the same final parameters, the experts gathered back in
expert order (rtol 1e-4, atol 1e-5: fp32 sums in another order, through Adam's division by
sqrt(v), as tests/dist/test_equivalence.py justifies). The router's auxiliary loss is part of
the loss compared.

Models (tests/moe_model.py, 2 blocks, hidden 32): Mixtral-like (4 experts of ffn 64, top-2),
Qwen2-MoE-like (the same plus a shared expert; capacity factor 1, so tokens over an expert's
capacity are dropped, per sequence as in one process), DeepSeek-V3-like (16 experts of ffn 16,
top-4, multi-head latent attention with a key/value latent of 16) and Mixtral-like without the
aux loss (a pipeline then cuts it by modules). Cases, one spawn of ranks per world size, ZeRO-3
unless said:
- 2 ranks (each data-parallel rank its own expert group, so the expert-data-parallel groups hold
  one rank): Mixtral-like ep=2, Qwen2-MoE-like ep=2 ZeRO-2, DeepSeek-V3-like ep=2 ZeRO-2.
- 4 ranks, experts over dp: Mixtral-, Qwen2-MoE- and DeepSeek-V3-like ep=2 (experts also sharded
  over 2 expert-data-parallel ranks) and Mixtral-like ep=4 ZeRO-2 (each rank alone with its
  experts).
- 4 ranks, dp=2 x pp=2: Mixtral-like without expert parallelism, and Mixtral-, Qwen2-MoE- and
  DeepSeek-V3-like and aux-loss-free Mixtral-like with ep=2 (each stage's experts sharded over
  its 2 data-parallel ranks).
- 4 ranks, dp=2 (ep=2) x tp=2: Mixtral-, Qwen2-MoE- and DeepSeek-V3-like (experts whole on each
  tensor-parallel rank; MLA's key/value down-projection kept replicated).
- Hugging Face Mixtral, Qwen2-MoE and DeepSeek-V3 built from their transformers configs, whose
  experts route their own tokens (exchanged dropless, the counts first): Mixtral ep=2 on 2 ranks,
  DeepSeek-V3 ep=2 on 4 (dp=4), Mixtral dp=2 (ep=2) x tp=2, Qwen2-MoE dp=2 (ep=2) x pp=2, EP
  carved from dp x cp (Qwen2-MoE dp=2 x cp=2 with ep=4, one expert a rank), and Qwen2-MoE dp=2
  (ep=2) x tp=2 with sequence parallelism.
- Expert tensor parallelism (each expert's width over the TP pair): Mixtral-like ep=2 x tp=2,
  Hugging Face Mixtral ep=2 x tp=2 with SP, aux-loss-free Mixtral-like pp=2 x tp=2 without EP.
The all-to-alls every case with ep > 1 issues are those IssuedCollectives.ep_collectives prices. The
user-facing example examples/mixtral.py is compiled by `autopar compile` with plan.ep=2 on 2 CPU
gloo ranks, in fp32 and in bf16, and both modules train in the 2-rank spawn.

    pytest -q tests/dist/test_expert_parallel.py
"""
from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch

from autopar.cli import main as autopar_main
from autopar.codegen import generate
from autopar.codegen.generate import DEFAULT_OPTIMIZER
from autopar.config import PlanPins, SolverConfig
from autopar.model_file import load_model_file
from autopar.plans import Plan
from autopar.profile import profile_model
from autopar.runtime import read_records, run_reference
from autopar.runtime.generated import import_generated
from autopar.solver.planner import Planner
from cost_models.step import PlanPricer, TrainSpec
from cost_models.topology import ClusterConfig, ClusterSpec
from tests.dist.equivalence import COUNTED_STEP, count_collectives
from tests.dist.harness import run_ranks
from tests.tiers import session_items, tiered

pytestmark = [pytest.mark.dist]

MOE = Path(__file__).resolve().parents[1] / "moe_model.py"
TINY = dict(layers=2, hidden=32, heads=2, seq_len=16, vocab=64)
MODELS = {
    "mixtral": dict(TINY, experts=4, top_k=2, ffn=64),
    "qwen2_moe": dict(TINY, experts=4, top_k=2, ffn=64, shared_ffn=64, capacity_factor=1.0),  # drops tokens
    # multi-head latent attention: keys and values up-projected from a 16-wide latent
    "deepseek_v3": dict(TINY, experts=16, top_k=4, ffn=16, capacity_factor=4.0, kv_lora_rank=16),
    "mixtral_plain": dict(TINY, experts=4, top_k=2, ffn=64, aux_loss=False),  # a pipeline cuts it by modules
    # Hugging Face's own models from their transformers configs: experts that route their own
    # tokens, exchanged dropless (DeepSeek-V3's first layer is dense: one MoE layer of two).
    "hf_mixtral": dict(arch="mixtral"),
    "hf_qwen2_moe": dict(arch="qwen2_moe"),
    "hf_deepseek_v3": dict(arch="deepseek_v3"),
}
HF_ZOO = Path(__file__).resolve().parents[1] / "zoo" / "models" / "hf_zoo.py"
# All-to-alls per micro-batch, by hand: 4 per MoE layer (dispatch and combine, forward and
# backward), plus the per-expert counts a dropless exchange sends first in each forward.
EXCHANGES = {"mixtral": 4 * 2, "qwen2_moe": 4 * 2, "deepseek_v3": 4 * 2, "mixtral_plain": 4 * 2,
             "hf_mixtral": 5 * 2, "hf_qwen2_moe": 5 * 2, "hf_deepseek_v3": 5 * 1}
# (model, ep, ZeRO stage, ranks)
CASES = [("mixtral", 2, 3, 4), ("mixtral", 4, 2, 4), ("qwen2_moe", 2, 3, 4), ("deepseek_v3", 2, 3, 4),
         ("mixtral", 2, 3, 2), ("qwen2_moe", 2, 2, 2), ("deepseek_v3", 2, 2, 2),
         ("hf_mixtral", 2, 3, 2), ("hf_deepseek_v3", 2, 3, 4)]
# (model, ep, ZeRO stage, ranks, pp, tp): dp=2 x pp=2 (the aux loss carried across stages) and dp=2 x tp=2
PIPELINED = [("mixtral", 1, 3, 4, 2, 1), ("mixtral", 2, 3, 4, 2, 1), ("mixtral_plain", 2, 3, 4, 2, 1),
             ("qwen2_moe", 2, 3, 4, 2, 1), ("deepseek_v3", 2, 3, 4, 2, 1), ("hf_qwen2_moe", 2, 3, 4, 2, 1)]
TENSOR_PARALLEL = [("mixtral", 2, 3, 4, 1, 2), ("qwen2_moe", 2, 3, 4, 1, 2), ("deepseek_v3", 2, 3, 4, 1, 2),
                   ("hf_mixtral", 2, 3, 4, 1, 2)]
# (model, ep, ZeRO stage, ranks, pp, tp, cp): experts exchanged dropless, EP carved from dp x cp
CONTEXT_PARALLEL = [("hf_qwen2_moe", 4, 3, 4, 1, 1, 2)]
# (..., cp, sequence parallelism): dp=2 (ep=2) x tp=2 with the sequence split between the blocks' regions
SEQUENCE_PARALLEL = [("hf_qwen2_moe", 2, 3, 4, 1, 2, 1, True)]
# (..., sequence parallelism, expert TP): each expert's width split over the TP pair too
EXPERT_TP = [("mixtral", 2, 3, 4, 1, 2, 1, False, True), ("hf_mixtral", 2, 3, 4, 1, 2, 1, True, True),
             ("mixtral_plain", 1, 3, 4, 2, 2, 1, False, True)]
# The default run (tests/tiers.py) keeps a case of every kind above: experts over 2 and 4 ranks,
# over expert-data-parallel groups, token dropping, latent attention, Hugging Face's routed
# experts, a pipeline cut from the graph and by modules, TP (with MLA's replicated projection),
# SP, CP and expert TP; the extended tier adds the same kinds on the other models.
EXTENDED_CASES = {("qwen2_moe", 2, 3, 4), ("deepseek_v3", 2, 3, 4), ("hf_deepseek_v3", 2, 3, 4),
                  # token dropping and latent attention run by default beside TP (their tp2 cases)
                  ("qwen2_moe", 2, 2, 2), ("deepseek_v3", 2, 2, 2),
                  # Hugging Face's routed experts run by default under expert TP (hf_mixtral's etp case)
                  ("hf_mixtral", 2, 3, 2),
                  ("mixtral", 1, 3, 4, 2, 1), ("qwen2_moe", 2, 3, 4, 2, 1), ("deepseek_v3", 2, 3, 4, 2, 1),
                  ("qwen2_moe", 2, 3, 4, 1, 2), ("hf_mixtral", 2, 3, 4, 1, 2),
                  ("mixtral_plain", 1, 3, 4, 2, 2, 1, False, True),
                  # the same kinds again on another model (kept within CI's time)
                  ("mixtral", 2, 3, 2), ("hf_qwen2_moe", 2, 3, 4, 2, 1), ("mixtral", 2, 3, 4, 1, 2),
                  ("mixtral", 2, 3, 4, 1, 2, 1, False, True)}
GLOBAL_BATCH, STEPS = 8, 3
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mixtral.py"
# The numerical check at compile would spawn ranks of its own: the modules train in the spawn below.
EXAMPLE_OVERRIDES = ["cluster=cpu_gloo", "cluster.gpus_per_node=2", f"train.global_batch_size={GLOBAL_BATCH}",
                     "plan.ep=2", "check=off"]
PRECISIONS = ["fp32", "bf16"]
# Clipping active on every step (the tiny models' gradient norms are 0.53-0.82): the global norm
# must count every expert slice once (over EP and expert TP), or the clipped updates differ. (A
# far smaller bound shrinks gradients towards Adam's eps, where the order of sums shows.)
OPTIMIZER = {**DEFAULT_OPTIMIZER, "eps": 1e-6, "max_grad_norm": 0.25}
# The profiler's name for each exchange the process group runs (the functional op's own event also
# fires on the fake tensors a traced pipeline split exports, which exchange nothing).
ALL_TO_ALL_EVENT = "c10d::alltoall_base_"


def case_id(name: str, ep: int, zero: int, world: int, pp: int = 1, tp: int = 1, cp: int = 1, sp: bool = False,
            etp: bool = False) -> str:
    return (f"{name}_ep{ep}_zero{zero}_w{world}" + (f"_pp{pp}" if pp > 1 else "") + (f"_tp{tp}" if tp > 1 else "")
            + (f"_cp{cp}" if cp > 1 else "") + ("_sp" if sp else "") + ("_etp" if etp else ""))


def plan_cluster(world: int) -> ClusterSpec:
    return ClusterSpec.from_config(ClusterConfig(name="tiny_cpu", gpu="cpu", nodes=1, gpus_per_node=world))


def model_file(name: str) -> Path:
    return HF_ZOO if name.startswith("hf_") else MOE


@functools.cache
def moe_profile(name: str):
    """The fp32 profile of MODELS[name] at micro-batch 1, traced once for every case of it."""
    return profile_model(load_model_file(model_file(name)), MODELS[name], 1, "fp32")


@functools.cache
def reference_run(model_file: Path, kwargs: tuple, optimizer: tuple):
    """The model (kwargs and optimizer as items, to be hashable) trained on one process, once for
    every test of it."""
    return run_reference(model_file, dict(kwargs), GLOBAL_BATCH, STEPS, dict(optimizer))


def test_clipping_acts_on_every_step_of_the_references():
    for name in ("mixtral", "hf_mixtral"):
        reference = reference_run(model_file(name), tuple(MODELS[name].items()), tuple(OPTIMIZER.items()))
        assert min(reference.grad_norms) > 2 * OPTIMIZER["max_grad_norm"], name


def make_plan(name: str, ep: int, zero: int, world: int, pp: int = 1, tp: int = 1, cp: int = 1, sp: bool = False,
              etp: bool = False):
    cluster = plan_cluster(world)
    profile = moe_profile(name)
    pins = PlanPins(dp=world // (pp * tp * cp), tp=tp, pp=pp, cp=cp, ep=ep, zero_stage=zero, micro_batch_size=1,
                    cp_strategy="ring" if cp > 1 else None, sequence_parallel=sp if tp > 1 else None,
                    expert_tp=etp if tp > 1 else None)
    train = TrainSpec(global_batch_size=GLOBAL_BATCH, precision="fp32", optimizer="adam")
    return Planner(profile, cluster, train, SolverConfig(time_limit_s=60, top_k=0), pins).run().plan


def compile_example(precision: str, out: Path) -> Path:
    """`autopar compile` of the Mixtral-style example with experts over 2 ranks; its module."""
    assert autopar_main(["compile", str(EXAMPLE), *EXAMPLE_OVERRIDES, f"train.precision={precision}",
                         "--out-dir", str(out), "-q"]) == 0
    plan = Plan.load(out / "plan.json")
    assert (plan.ep, plan.dp, plan.precision) == (2, 2, precision)
    return out / "parallel_mixtral.py"


def _run(rank: int, world_size: int, jobs: list[tuple[str, str, str, str]]) -> dict[str, int]:
    """Run each generated module; per case, the all-to-alls this rank issued in the second step's
    `train_step` (forward and backward; past the first step, in which a pipeline stage split by
    modules runs its forward and backward once more to infer the shapes it sends)."""
    torch.set_num_threads(1)
    counted = {}
    for case, script, log_file, final in jobs:
        module = import_generated(script, f"generated_{case}")
        counted[case] = count_collectives(module, COUNTED_STEP)
        module.main(["--steps", str(STEPS), "--seed", "0", "--log-file", log_file, "--save-final", final])
    return {case: counts.get(ALL_TO_ALL_EVENT, 0) for case, counts in counted.items()}


def tier(cases: list[tuple], unpack: bool = False) -> list:
    """``cases`` as parameters, those in EXTENDED_CASES in the extended tier."""
    return tiered(cases, [case for case in cases if case not in EXTENDED_CASES], unpack=unpack)


def wanted_cases(request: pytest.FixtureRequest) -> set[str]:
    """The case ids this session's tests of `outcomes` read (skipped and deselected ones left out)."""
    found = set()
    for item in session_items(request, "outcomes", Path(__file__).resolve()):
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "case" in params:
            found.add(case_id(*params["case"]))
        elif "name" in params:
            found.add(case_id(params["name"], params["ep"], params["zero"], params["world"]))
        elif "precision" in params:
            found.add(f"example_{params['precision']}")
    return found


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("expert_parallel")
    wanted = wanted_cases(request)
    jobs: dict[int, list[tuple[str, str, str, str]]] = {}
    priced = {}
    every = CASES + PIPELINED + TENSOR_PARALLEL + CONTEXT_PARALLEL + SEQUENCE_PARALLEL + EXPERT_TP
    for name, ep, zero, world, pp, tp, cp, sp, etp in [(case + (1, 1, 1, False, False)[len(case) - 4:])
                                                        for case in every]:
        case = case_id(name, ep, zero, world, pp, tp, cp, sp, etp)
        if case not in wanted:
            continue
        plan = make_plan(name, ep, zero, world, pp, tp, cp, sp, etp)
        assert (plan.ep, plan.dp, plan.pp, plan.tp, plan.cp, plan.sequence_parallel, plan.expert_tp,
                plan.zero_stage) == (ep, world // (pp * tp * cp), pp, tp, cp, sp, etp, zero)
        out = root / case
        files = generate(plan, model_file(name), out, model_kwargs=MODELS[name], optimizer=OPTIMIZER,
                         gpus_per_node=world)
        assert ("apply_ep(" in files.script.read_text()) == (ep > 1)
        assert ('expert_tp=plan["expert_tp"]' in files.script.read_text()) == etp
        if tp > 1 and "kv_lora_rank" in MODELS[name]:
            # MLA's down-projection output is split into the latent and the rotary key (two parts,
            # autopar.solver.tp_fused); it feeds a norm, no row-parallel partner, so a split gathers
            # its output whole in the model's order (no FusedColwise), or it stays replicated.
            text = files.script.read_text()
            assert "attn.wkv_b" in text and "FusedColwise" not in text
            assert "attn.wkv_a" not in text or \
                '.attn.wkv_a": ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())' in text
        if pp > 1:  # the aux loss read by every block makes codegen cut the stages from an exported graph
            split = "tracer" if MODELS[name].get("aux_loss", True) and model_file(name) == MOE else "modules"
            assert f"PIPELINE_SPLIT = {split!r}" in files.script.read_text()
        pricer = PlanPricer(moe_profile(name), plan_cluster(world), TrainSpec(GLOBAL_BATCH, precision="fp32"))
        priced[case] = pricer.issued.ep_collectives(plan.layout()).get("all_to_all", 0)
        jobs.setdefault(world, []).append((case, str(files.script), str(out / "run.jsonl"), str(out / "final.pt")))
    for precision in PRECISIONS:
        if f"example_{precision}" not in wanted:
            continue
        out = root / f"example_{precision}"
        script = compile_example(precision, out)
        jobs.setdefault(2, []).append((f"example_{precision}", str(script), str(out / "run.jsonl"),
                                       str(out / "final.pt")))
        priced[f"example_{precision}"] = None
    issued: dict[str, list[int]] = {}  # case -> all-to-alls issued by each rank
    for world, world_jobs in sorted(jobs.items()):
        for rank_issued in run_ranks(_run, world, world_jobs, timeout_s=900):
            for case, count in rank_issued.items():
                issued.setdefault(case, []).append(count)
    return {case: ([r["loss"] for r in read_records(log)], torch.load(final), issued.get(case), priced[case])
            for world_jobs in jobs.values() for case, _, log, final in world_jobs}


def assert_trains_like_one_process(losses: list[float], parameters: dict, model_file: Path, kwargs: dict,
                                   optimizer: dict) -> None:
    """Per-step losses (rtol 1e-5) and final parameters (rtol 1e-4, atol 1e-5; see the module
    docstring) equal to the unsharded model's trained on one process, and training moved."""
    reference = reference_run(model_file, tuple(kwargs.items()), tuple(optimizer.items()))
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(reference.losses, dtype=torch.float64), rtol=1e-5, atol=0)
    assert set(parameters) == set(reference.parameters)
    for key, expected in reference.parameters.items():
        torch.testing.assert_close(parameters[key], expected, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, key=key: f"{key}: {m}")
    assert len(losses) == STEPS and all(math.isfinite(loss) for loss in losses) and losses[0] != losses[-1]


@pytest.mark.parametrize("name, ep, zero, world", tier(CASES, unpack=True))
def test_generated_expert_parallel_module_matches_one_process(name, ep, zero, world, outcomes):
    losses, parameters, _, _ = outcomes[case_id(name, ep, zero, world)]
    assert_trains_like_one_process(losses, parameters, model_file(name), MODELS[name], OPTIMIZER)


@pytest.mark.parametrize("name, ep, zero, world", tier(CASES, unpack=True))
def test_priced_all_to_alls_are_issued(name, ep, zero, world, outcomes):
    """The dispatch and combine all-to-alls the pricer counts per step (4 per MoE layer and
    micro-batch, 5 where the counts go first: EXCHANGES, by hand, x 8 / world micro-batches here)
    are those each rank's step issues, forward and backward (torch's profiler, one event per
    exchange of the process group)."""
    _, _, issued, priced = outcomes[case_id(name, ep, zero, world)]
    assert priced == EXCHANGES[name] * (GLOBAL_BATCH // world)
    assert issued == [priced] * world  # every rank is in an expert-parallel group of both layers


@pytest.mark.parametrize("case", tier([case for case in PIPELINED if case[1] > 1]), ids=lambda case: case_id(*case))
def test_priced_all_to_alls_are_issued_by_the_stages_of_a_pipeline(case, outcomes):
    """Under ep=2 x pp=2 each stage's ranks exchange the tokens of that stage's MoE layer only;
    the pricer counts one rank per stage (cost_models/issued.py): 4 all-to-alls x 2 layers x 4
    micro-batches (8 samples over dp=2, micro-batch 1), of which each rank issues its stage's
    half, whether the stages are cut from an exported graph or by modules."""
    name, ep, zero, world, pp, _ = case
    _, _, issued, priced = outcomes[case_id(*case)]
    assert priced == EXCHANGES[name] * (GLOBAL_BATCH // (world // pp))
    assert issued == [priced // pp] * world


@pytest.mark.parametrize("case", tier(PIPELINED), ids=lambda case: case_id(*case))
def test_pipelined_moe_model_trains_like_one_process(case, outcomes):
    """A model threading its auxiliary loss through the blocks, cut into pipeline stages, trains
    like one process: losses and final parameters (the aux loss of every stage's blocks counted).
    Split by modules, a stage handed on one activation and the running aux loss was lost at the
    boundary (losses 0.24% low at every step); codegen now sees, on fake tensors, that each block
    reads the previous block's second output and cuts the stages from the exported graph, which
    carries every value a later stage reads (autopar/codegen/stage_flow.py). With ep=2 the experts
    of each stage's MoE layer are sliced over the stage's 2 data-parallel ranks before the export,
    which traces their exchanges into the stage's graph; the experts, gathered back, end equal.
    Without an aux loss the stages are cut by modules, and each stage's experts are sharded as
    without a pipeline (apply_ep on the stage's copy of the model)."""
    losses, parameters, _, _ = outcomes[case_id(*case)]
    assert_trains_like_one_process(losses, parameters, model_file(case[0]), MODELS[case[0]], OPTIMIZER)


# bf16 by default: every module case above already holds fp32 to the tight tolerances.
@pytest.mark.parametrize("precision", tiered(PRECISIONS, ["bf16"]))
def test_compiled_moe_example_trains_like_one_process(precision, outcomes):
    """examples/mixtral.py as a user compiles it (`autopar compile ... plan.ep=2`, cluster=cpu_gloo)
    trains: finite losses that move, equal to the unsharded model's on one process, and so are
    the final parameters, experts gathered back (the generated module's own AdamW, eps 1e-8: the
    tiny model's gradients are far above it). A bf16 plan trains in fp32 on CPU ranks (compile
    says so), so it too must give the one-process fp32 values; what bf16 changes here is the
    traced profile and the plan's prices."""
    losses, parameters, _, _ = outcomes[f"example_{precision}"]
    assert_trains_like_one_process(losses, parameters, EXAMPLE, {}, DEFAULT_OPTIMIZER)


@pytest.mark.parametrize("case", tier(TENSOR_PARALLEL + SEQUENCE_PARALLEL), ids=lambda case: case_id(*case))
def test_expert_parallelism_beside_tensor_parallelism_trains_like_one_process(case, outcomes):
    """dp=2 (ep=2) x tp=2, ZeRO-3: the modules the operator-wise split shards (the routers, the
    position embedding and the LM head, its logits vocabulary-sharded into the loss; the shared
    expert's linears; of multi-head latent attention the query, key/value up- and output
    projections, while the key/value down-projection, whose output is split into the latent and
    the rotary key, stays replicated) are split over each tensor-parallel pair, the experts are
    not: each TP rank holds the E/ep experts of its expert-parallel group whole and exchanges the
    whole sequence's tokens with the same TP coordinate of the other data-parallel rank. Losses
    and final parameters equal one process (the router's auxiliary loss, a plain tensor beside
    the sharded logits, made a replicated DTensor for the loss), and every rank issues the
    all-to-alls priced per step: 4 x 2 layers x 4 micro-batches (the pricer counts one rank per
    tensor-parallel group). With sequence parallelism (Hugging Face Qwen2-MoE) the blocks' norms
    keep each rank's slice of the sequence and the MoE layer, a replicated region, gets the
    whole sequence gathered in: the same exchange, priced the same."""
    losses, parameters, issued, priced = outcomes[case_id(*case)]
    assert_trains_like_one_process(losses, parameters, model_file(case[0]), MODELS[case[0]], OPTIMIZER)
    assert priced == EXCHANGES[case[0]] * (GLOBAL_BATCH // 2)
    assert issued == [priced] * case[3]


@pytest.mark.parametrize("case", tier(CONTEXT_PARALLEL), ids=lambda case: case_id(*case))
def test_expert_parallelism_across_context_parallel_ranks_trains_like_one_process(case, outcomes):
    """Experts exchanged dropless route each token alone, so EP can be carved from dp x cp, as
    Megatron-Core's expert-data-parallel groups are: Hugging Face Qwen2-MoE on dp=2 x cp=2 with
    each of the 4 ranks holding one expert, each rank dispatching the tokens of its half of every
    sequence. Losses and final
    parameters equal one process (ring attention, ZeRO-3), and the all-to-alls are the ones
    priced: 5 per MoE layer and micro-batch, the tokens a rank holds being a cp-th of a sequence."""
    name, ep, zero, world, pp, tp, cp = case
    losses, parameters, issued, priced = outcomes[case_id(*case)]
    assert_trains_like_one_process(losses, parameters, model_file(name), MODELS[name], OPTIMIZER)
    assert priced == EXCHANGES[name] * (GLOBAL_BATCH // (world // cp))
    assert issued == [priced] * world


@pytest.mark.parametrize("case", tier(EXPERT_TP), ids=lambda case: case_id(*case))
def test_experts_split_over_tensor_parallel_ranks_train_like_one_process(case, outcomes):
    """Expert tensor parallelism: each expert's feed-forward width split over the TP pair (its
    [E, h, F] and [E, F, h] weights, or Hugging Face's fused [E, 2F, h] gate-up projection block by
    block and [E, h, F]), the partial outputs summed over the pair after the combine and the
    input's (and a routed module's gates') gradients summed in backward. Grouped experts with
    ep=2 x tp=2; Hugging Face Mixtral's routed experts with ep=2 x tp=2 and sequence parallelism;
    and the aux-loss-free model without EP in a pipeline of 2 stages x tp=2. Losses and final
    parameters (the experts gathered back over TP and EP) equal one process, and the all-to-alls
    issued are those priced (none without EP)."""
    name, ep, zero, world, pp, tp, cp, sp, etp = case
    losses, parameters, issued, priced = outcomes[case_id(*case)]
    assert_trains_like_one_process(losses, parameters, model_file(name), MODELS[name], OPTIMIZER)
    dp = world // (pp * tp * cp)
    assert priced == (EXCHANGES[name] * (GLOBAL_BATCH // dp) if ep > 1 else 0)
    assert issued == [priced // pp] * world

"""Expert parallelism in the plan: facts read off a traced MoE model, prices against hand counts,
the checks that refuse what cannot run, and the search's enumeration of ep."""
from __future__ import annotations

import functools
import math
from dataclasses import replace
from pathlib import Path

import pytest

from autopar.config import PlanPins, SolverConfig
from autopar.solver.space import ModelShape, enumerate_candidates
from cost_models.collectives import Collective, all_to_all_s
from cost_models.expert_parallel import ExpertFacts, all_to_alls, routing_pace
from cost_models.memory import trained_model_states
from autopar.domain.mesh import Mesh
from cost_models.step import ParallelLayout, PlanPricer, TrainSpec
from autopar.domain.techniques import LayoutFacts, problems
from cost_models.topology import ClusterConfig, ClusterSpec

pytestmark = pytest.mark.unit

MOE = Path(__file__).resolve().parents[1] / "moe_model.py"
# tests/moe_model.py at its defaults: 2 blocks, h=64, ffn=128, E=4, top-2, capacity factor 2;
# micro-batch 2 x 32 tokens.
H, FFN, E, K, B0, S, CF = 64, 128, 4, 2, 2, 32, 2.0
CAPACITY = math.ceil(CF * S * K / E)  # slots per expert and sequence (the model's own rule)
EXPERT_PARAMS = 2 * E * H * FFN  # w_in [E, h, ffn] and w_out [E, ffn, h]


@functools.lru_cache(maxsize=None)
def moe_profile(precision: str = "fp32", **kwargs):
    from autopar.model_file import load_model_file
    from autopar.profile import profile_model

    return profile_model(load_model_file(MOE), kwargs, micro_batch_size=B0, precision=precision)


def cluster(nodes: int = 2, per_node: int = 8) -> ClusterSpec:
    return ClusterSpec.from_config(ClusterConfig(name="t", gpu="H100-SXM", nodes=nodes, gpus_per_node=per_node))


def pricer(train: TrainSpec | None = None, nodes: int = 2) -> PlanPricer:
    return PlanPricer(moe_profile(), cluster(nodes), train or TrainSpec(global_batch_size=64, precision="fp32"))


def test_facts_of_a_traced_moe_model_match_its_definition():
    facts = ExpertFacts.of(moe_profile())
    assert sorted(facts.layers) == ["blocks.0", "blocks.1"]
    moe = facts.layers["blocks.0"]
    assert (moe.experts, moe.top_k, moe.expert_params, moe.tokens) == (E, K, EXPERT_PARAMS, B0 * S)
    # The block's input is the fp32 hidden state (plus the running aux-loss scalar, 4 bytes).
    assert moe.token_bytes == pytest.approx(4 * H + 4 / (B0 * S))
    # The experts' two bmm's dominate the block's matmul work: 2·(2·T·k·cf... ) is most of it.
    assert 0.5 < moe.expert_forward_share < 1 and 0.5 < moe.expert_backward_share < 1
    assert facts.common_divisor() == E
    # Grouped experts: the exchange moves every capacity slot of the [E, b·C, h] input.
    assert (moe.dispatch_rows, moe.dropless) == (E * B0 * CAPACITY, False)


def test_a_dense_model_has_no_experts():
    from tests.profiles import gpt

    assert not ExpertFacts.of(gpt()).has_experts


def test_routing_pace():
    assert routing_pace(1, 1.5, True) == 1.0  # one rank holds every expert: routing changes nothing
    assert routing_pace(4, 1.5, True) == 1.5  # dropless: the busiest rank's share
    assert routing_pace(4, 1.5, False) == 1.0  # grouped: every rank moves its capacity slots, filled or not
    assert all_to_alls("none") == 4 and all_to_alls("full") == 6


def test_mesh_blocks_cut_consecutive_data_parallel_ranks():
    mesh = Mesh(("tp", "dp"), (2, 4))  # dp group through rank 0: 0, 2, 4, 6
    assert mesh.block_ranks("dp", 2) == [0, 2]
    assert mesh.block_ranks("dp", 2, rank=5) == [5, 7]
    assert mesh.blocks("dp", 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_all_to_all_time_is_the_hand_count():
    train = TrainSpec(global_batch_size=64, precision="fp32", moe_imbalance=1.5)
    p = pricer(train)
    layout = ParallelLayout(dp=16, ep=4, micro_batch_size=4, num_micro_batches=1)
    layer = p.profile.layer("blocks.0")
    moe = p.experts.layers["blocks.0"]
    # Micro-batch 4 = twice the profiled 2: E x 2·b·C slots of token bytes, whatever the routing
    # (imbalance 1.5 is for dropless experts; these are grouped with the model's capacity).
    nbytes = 2 * E * B0 * CAPACITY * moe.token_bytes
    group = p.cluster.group_links([0, 1, 2, 3])  # ep=4 consecutive data-parallel ranks, one node
    assert p.layer_prices._ep_time_s(layer, layout, 2.0, "none") == pytest.approx(4 * all_to_all_s(nbytes, group))
    assert p.layer_prices._ep_time_s(layer, layout, 2.0, "full") == pytest.approx(6 * all_to_all_s(nbytes, group))
    assert p.layer_prices._ep_time_s(layer, replace(layout, ep=1), 2.0) == 0.0
    assert p.layer_prices._ep_time_s(p.profile.layer("ln_f"), layout, 2.0) == 0.0


def test_an_expert_group_across_nodes_pays_the_network():
    layout = ParallelLayout(dp=16, ep=4, zero_stage=3, micro_batch_size=4)
    one_node, two_nodes = pricer(), PlanPricer(moe_profile(), cluster(8, 2), TrainSpec(64, precision="fp32"))
    assert one_node.groups.placement(layout, "ep").nodes == 1 and two_nodes.groups.placement(layout, "ep").nodes == 2
    layer = one_node.profile.layer("blocks.0")
    # Half of each rank's exchange leaves the node, through a NIC far slower than NVLink.
    assert two_nodes.layer_prices._ep_time_s(layer, layout, 2.0) > \
        2 * one_node.layer_prices._ep_time_s(layer, layout, 2.0)


def test_expert_states_are_divided_by_ep_and_sharded_over_the_expert_data_parallel_group():
    p = pricer()
    layer = p.profile.layer("blocks.0")
    dense = layer.param_count - EXPERT_PARAMS
    for zero, shard in ((0, 1), (3, 16)):
        layout = ParallelLayout(dp=16, ep=4, zero_stage=zero, micro_batch_size=4)
        states = p.layer_prices.states(layer, p.split(layer.name, layout, p.cluster.node_gpus[0]), layout)
        kwargs = dict(fsdp=p.sync.uses_fsdp(layout), pipelined=False)
        want = (trained_model_states(dense, "fp32", "adam", zero, shard, **kwargs).total_bytes
                + trained_model_states(EXPERT_PARAMS / 4, "fp32", "adam", zero, max(1, shard // 4),
                                       **kwargs).total_bytes)
        assert states.total_bytes == pytest.approx(want)
    # ZeRO-0 by hand: fp32 weights, gradients and two Adam moments, 16 bytes a parameter.
    zero0 = ParallelLayout(dp=16, ep=4, micro_batch_size=4)
    split = p.split(layer.name, zero0, p.cluster.node_gpus[0])
    assert p.layer_prices.states(layer, split, zero0).params_bytes == pytest.approx(4 * (dense + EXPERT_PARAMS / 4))


def test_estimate_shows_the_all_to_alls_and_the_dispatch_buffer():
    p = pricer()
    base = ParallelLayout(dp=16, zero_stage=3, micro_batch_size=2, num_micro_batches=2)
    with_ep = p.estimate(replace(base, ep=4))
    without = p.estimate(base)
    assert without.time_breakdown["ep_comm"] == 0.0
    # 2 MoE layers x 2 micro-batches x 4 all-to-alls each, at the profiled micro-batch.
    layer = p.profile.layer("blocks.0")
    assert with_ep.time_breakdown["ep_comm"] == \
        pytest.approx(2 * 2 * p.layer_prices._ep_time_s(layer, replace(base, ep=4), 1.0))
    # Buffers: FSDP's two gathered layers hold a quarter of the experts (fp32, 4 bytes a
    # parameter), and the dispatch buffer holds one layer's received tokens and their outputs.
    gpu = p.cluster.node_gpus[0]
    moe = p.experts.layers["blocks.0"]
    buffers = {ep: p.layer_prices._buffers(replace(base, ep=ep), 1.0, gpu) for ep in (1, 4)}
    assert buffers[1]["zero3_gathered_params"] - buffers[4]["zero3_gathered_params"] == \
        pytest.approx(2 * 4 * EXPERT_PARAMS * 3 / 4)
    assert buffers[4]["ep_dispatch"] == pytest.approx(2 * E * B0 * CAPACITY * moe.token_bytes)
    assert "ep_dispatch" not in buffers[1]


@pytest.mark.parametrize("ep, words", [(3, "must divide dp"), (8, "must divide the 4 experts")])
def test_layouts_expert_parallelism_cannot_run_are_refused(ep, words):
    p = pricer()
    with pytest.raises(ValueError, match=words):
        p.estimate(ParallelLayout(dp=16, ep=ep, zero_stage=3, micro_batch_size=4))


def test_ep_where_the_generated_code_does_not_run_it_is_refused():
    p = pricer()
    with pytest.raises(ValueError, match="pin zero_stage=2 or 3"):
        p.estimate(ParallelLayout(dp=16, ep=2, zero_stage=1, micro_batch_size=4))
    with pytest.raises(ValueError, match="with cp=2 is generated for experts exchanged dropless"):
        p.estimate(ParallelLayout(dp=8, cp=2, ep=2, zero_stage=3, micro_batch_size=8))
    assert not problems(ParallelLayout(dp=8, tp=2, ep=2, zero_stage=3, micro_batch_size=8), LayoutFacts(experts=E))
    # Beside sequence parallelism each TP rank still dispatches the whole sequence (the MoE layer
    # is a replicated region SP gathers the sequence into), so the exchange is priced the same.
    with_sp = ParallelLayout(dp=8, tp=2, ep=2, zero_stage=3, micro_batch_size=8, sequence_parallel=True)
    assert not problems(with_sp, LayoutFacts(experts=E))
    layer = p.profile.layer("blocks.0")
    ep_time_s = p.layer_prices._ep_time_s
    assert ep_time_s(layer, with_sp, 4.0) == ep_time_s(layer, replace(with_sp, sequence_parallel=False), 4.0) > 0


def test_ep_on_a_model_without_experts_is_refused():
    from tests.profiles import gpt

    p = PlanPricer(gpt(), cluster(1), TrainSpec(global_batch_size=16))
    with pytest.raises(ValueError, match="needs a model with experts"):
        p.estimate(ParallelLayout(dp=8, ep=2, micro_batch_size=2))


def test_the_search_enumerates_ep_dividing_dp_and_the_experts():
    shape = ModelShape.from_profile(moe_profile())
    assert shape.experts == E
    found = list(enumerate_candidates(shape, 16, 8, 64, SolverConfig(), PlanPins()))
    eps = {(c.dp, c.ep) for c in found}
    assert {(16, 1), (16, 2), (16, 4), (8, 1), (2, 2)} <= eps  # dp=2: tp·pp=8
    assert all(c.dp % c.ep == 0 and E % c.ep == 0 for c in found)
    assert all(c.cp == 1 and not c.sequence_parallel and c.zero_stage >= 2 and not c.hybrid_shard
               for c in found if c.ep > 1)
    assert any(c.pp > 1 for c in found if c.ep > 1) and any(c.tp > 1 for c in found if c.ep > 1)  # ep x pp, ep x tp
    assert not any(c.ep == 8 for c in found)
    pinned = list(enumerate_candidates(shape, 16, 8, 64, SolverConfig(), PlanPins(ep=2)))
    assert pinned and {c.ep for c in pinned} == {2}


def test_a_dense_model_searches_ep_1_only():
    from tests.profiles import gpt

    found = enumerate_candidates(ModelShape.from_profile(gpt()), 8, 8, 16, SolverConfig(), PlanPins())
    assert {c.ep for c in found} == {1}


@pytest.mark.parametrize("pins, words", [
    (dict(ep=3), "does not divide the 4 experts"),
    (dict(ep=2, zero_stage=1), "cannot go with plan.zero_stage=1"),
    (dict(ep=2, cp=2), "cannot go with plan.cp=2"),
])
def test_pinned_ep_the_model_or_the_generated_code_cannot_take_is_refused_in_words(pins, words):
    from autopar.errors import UserError
    from autopar.solver.planner import Planner

    cpu = ClusterSpec.from_config(ClusterConfig(name="t", gpu="cpu", nodes=1, gpus_per_node=4))
    with pytest.raises(UserError, match=words):
        Planner(moe_profile(), cpu, TrainSpec(8, precision="fp32"), SolverConfig(), PlanPins(**pins)).run()


def test_pinned_ep_needs_a_data_parallel_degree_it_divides_that_divides_the_batch():
    from autopar.errors import UserError
    from autopar.solver.planner import Planner

    cpu = ClusterSpec.from_config(ClusterConfig(name="t", gpu="cpu", nodes=1, gpus_per_node=4))
    with pytest.raises(UserError, match=r"\(dp=4\): none is divisible by ep and divides the global batch 6"):
        Planner(moe_profile(), cpu, TrainSpec(6, precision="fp32"), SolverConfig(), PlanPins(ep=2, pp=1, tp=1)).run()
    with pytest.raises(UserError, match=r"\(dp=4 or 2 or 1\): none is divisible by ep and divides the global batch 6"):
        Planner(moe_profile(), cpu, TrainSpec(6, precision="fp32"), SolverConfig(), PlanPins(ep=4)).run()
    plan = Planner(moe_profile(), cpu, TrainSpec(8, precision="fp32"), SolverConfig(), PlanPins(ep=2)).run().plan
    assert (plan.ep, plan.dp, plan.tp, plan.pp) == (2, 4, 1, 1) and plan.zero_stage >= 2


def test_gpt_with_a_pinned_ep_is_refused_in_words():
    from autopar.errors import UserError
    from autopar.solver.planner import Planner
    from tests.profiles import gpt

    with pytest.raises(UserError, match="this model has none"):
        Planner(gpt(), cluster(1), TrainSpec(16), SolverConfig(), PlanPins(ep=2)).run()


def test_a_plan_without_expert_parallelism_says_why():
    from autopar.solver.planner import Planner

    cpu = ClusterSpec.from_config(ClusterConfig(name="t", gpu="cpu", nodes=1, gpus_per_node=4))
    # A batch of 3 splits over neither 4 nor 2 data-parallel ranks (pp=1 or 2): no plan can shard the experts.
    result = Planner(moe_profile(), cpu, TrainSpec(3, precision="fp32"), SolverConfig(), PlanPins()).run()
    assert result.plan.ep == 1
    why = [b for b in result.binding if b.constraint.startswith("expert parallelism")]
    assert why and "no data-parallel degree an expert-parallel degree divides divides the global batch 3" \
        in why[0].constraint
    assert "train.global_batch_size=4" in why[0].relaxing
    # A batch of 6 splits over 2 data-parallel ranks beside tp=2 or pp=2: the best such plan is priced.
    result = Planner(moe_profile(), cpu, TrainSpec(6, precision="fp32"), SolverConfig(), PlanPins()).run()
    why = [b for b in result.binding if b.constraint.startswith("expert parallelism")]
    assert result.plan.ep == 1 and why and "dp=2" in why[0].relaxing and "ep=2" in why[0].relaxing
    # A pin expert parallelism cannot go with (ZeRO-1), on a batch that allows it: said.
    result = Planner(moe_profile(), cpu, TrainSpec(8, precision="fp32"), SolverConfig(), PlanPins(zero_stage=1)).run()
    why = [b for b in result.binding if b.constraint.startswith("expert parallelism")]
    assert why and ("pins exclude it" in why[0].constraint)
    # Tensor parallelism pinned: ep x tp runs, so the best plan with it is priced.
    result = Planner(moe_profile(), cpu, TrainSpec(8, precision="fp32"), SolverConfig(), PlanPins(tp=2)).run()
    assert result.plan.ep > 1 or any("tp=2" in b.relaxing and "ep=2" in b.relaxing for b in result.binding)


@pytest.mark.slow
def test_mixtral_8x7b_shape_on_8_dgx_h100_nodes_plans_expert_parallelism():
    """The issue's target: the Mixtral-8x7B shape (8 experts, top-2, h=4096, ffn 14336, 32
    layers; seq 4096, global batch 512) on 8 DGX H100 nodes picks ep > 1, its all-to-alls in
    the time breakdown (the test model: all heads as K/V, experts of two matrices)."""
    from autopar.config import compose_config
    from autopar.driver import run_plan, run_profile

    cfg = compose_config(["model.layers=32", "model.hidden=4096", "model.heads=32", "model.ffn=14336",
                          "model.experts=8", "model.top_k=2", "model.capacity_factor=1.0", "model.seq_len=4096",
                          "model.vocab=32000", "cluster=dgx_h100", "cluster.nodes=8", "train.global_batch_size=512"])
    plan = run_plan(MOE, cfg, profile=run_profile(MOE, cfg)).plan
    assert plan.ep > 1 and plan.solver.status == "OPTIMAL"
    assert plan.predicted.time_breakdown["ep_comm"] > 0


def test_a_traced_pipeline_split_with_experts_of_several_data_parallel_ranks_is_refused_at_codegen(tmp_path):
    """The test model threads its auxiliary loss through the blocks, so its stages are cut from an
    exported graph, where FSDP sees no experts module to shard over the expert-data-parallel
    group: dp=4 with ep=2 is refused in words (dp=ep=2 x pp=2 trains: tests/dist/test_expert_parallel.py)."""
    from autopar.codegen import generate
    from autopar.codegen.errors import CodegenError
    from autopar.solver.planner import Planner

    cpu = ClusterSpec.from_config(ClusterConfig(name="t", gpu="cpu", nodes=1, gpus_per_node=8))
    pins = PlanPins(dp=4, tp=1, pp=2, cp=1, ep=2, zero_stage=3, micro_batch_size=1)
    plan = Planner(moe_profile(), cpu, TrainSpec(8, precision="fp32"), SolverConfig(top_k=0), pins).run().plan
    assert (plan.dp, plan.pp, plan.ep) == (4, 2, 2)
    with pytest.raises(CodegenError, match="ep = dp"):
        generate(plan, MOE, tmp_path / "out", model_kwargs={})



HF_ZOO = Path(__file__).resolve().parents[1] / "zoo" / "models" / "hf_zoo.py"


def meta_model(model_file: Path, **kwargs):
    """The model a model file builds, on the meta device (no memory, no initialisation work)."""
    import torch

    from autopar.model_file import load_model_file

    with torch.device("meta"):
        return load_model_file(model_file).build_model(**kwargs)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_experts_that_route_their_own_tokens_are_exchanged_dropless(arch):
    """Hugging Face's experts modules, built from their transformers configs, take (hidden_states,
    top_k_index, top_k_weights): the routed exchange wraps them (dropless), and the generated
    code's copy of those input names is the cost model's. tests/moe_model.py's experts take the
    grouped tokens; a forward taking anything else blocks expert parallelism, naming both forms."""
    from autopar.sections import expert_parallel as section
    from autopar.trace.experts import experts_inputs
    from cost_models.expert_parallel import ROUTED_INPUTS, ExpertExchange, ep_blocker, exchange_kind, is_dropless

    assert section.ROUTED_INPUTS == ROUTED_INPUTS
    model = meta_model(HF_ZOO, arch=arch)
    found = experts_inputs(model)
    assert found and all(exchange_kind(inputs) == ExpertExchange.ROUTED for inputs in found.values())
    assert ep_blocker(found) is None and is_dropless(found)
    assert all(section.is_routed(fqn, model.get_submodule(fqn)) for fqn in found)
    grouped = experts_inputs(meta_model(MOE))
    assert sorted(grouped) == ["blocks.0.moe.experts", "blocks.1.moe.experts"]
    assert ep_blocker(grouped) is None and not is_dropless(grouped)
    blocked = ep_blocker({"layers.0.experts": ["x", "mask"]})
    assert "layers.0.experts.forward takes (x, mask)" in blocked and "top_k_index" in blocked


def test_the_planner_offers_expert_parallelism_only_for_experts_it_can_run():
    """Price only what runs: a Hugging Face Mixtral (traced from its transformers config) is
    offered every ep dividing dp and its experts, priced dropless (its busiest rank at
    train.moe_imbalance); the same profile with an experts forward the exchange cannot wrap is
    offered ep=1 only, a pinned ep > 1 is refused with the reason, and the plan says why it has
    none."""
    from autopar.errors import UserError
    from autopar.model_file import load_model_file
    from autopar.profile import profile_model
    from autopar.solver.planner import Planner

    profile = profile_model(load_model_file(HF_ZOO), {"arch": "mixtral"}, micro_batch_size=2, precision="fp32")
    facts = ExpertFacts.of(profile)
    moe = facts.layers["model.layers.0"]
    assert facts.common_divisor() == 4 and facts.ep_blocker is None
    assert moe.dropless and moe.dispatch_rows == moe.tokens * moe.top_k == 2 * profile.tokens_per_sample * 2
    assert {c.ep for c in enumerate_candidates(ModelShape.from_profile(profile), 4, 4, 8, SolverConfig(),
                                               PlanPins())} == {1, 2, 4}
    # Dropless experts route each token alone: EP is carved from dp x cp (4 ranks of dp=2 x cp=2);
    # grouped ones (a capacity per sequence) get none beside CP.
    assert {c.ep for c in enumerate_candidates(ModelShape.from_profile(profile), 4, 4, 8, SolverConfig(),
                                               PlanPins(cp=2, dp=2))} == {1, 2, 4}
    assert {c.ep for c in enumerate_candidates(ModelShape.from_profile(moe_profile()), 4, 4, 8, SolverConfig(),
                                               PlanPins(cp=2, dp=2))} == {1}
    unwrappable = replace(profile, experts_inputs={fqn: ["hidden_states", "router_logits"]
                                                   for fqn in profile.experts_inputs})
    blocker = ExpertFacts.of(unwrappable).ep_blocker
    assert "model.layers.0.mlp.experts.forward takes (hidden_states, router_logits)" in blocker
    assert {c.ep for c in enumerate_candidates(ModelShape.from_profile(unwrappable), 4, 4, 8, SolverConfig(),
                                               PlanPins())} == {1}
    assert any("router_logits" in problem for problem in problems(
        ParallelLayout(dp=4, ep=2, zero_stage=3, micro_batch_size=2), LayoutFacts(experts=4, ep_blocker=blocker)))
    cpu = ClusterSpec.from_config(ClusterConfig(name="t", gpu="cpu", nodes=1, gpus_per_node=4))
    train = TrainSpec(8, precision="fp32")
    with pytest.raises(UserError, match="router_logits"):
        Planner(unwrappable, cpu, train, SolverConfig(), PlanPins(ep=2)).run()
    result = Planner(unwrappable, cpu, train, SolverConfig(time_limit_s=10), PlanPins()).run()
    why = [b for b in result.binding if b.constraint.startswith("expert parallelism")]
    assert result.plan.ep == 1 and why and "router_logits" in why[0].constraint
    # Dropless: the busiest rank's load scales the exchange; tests/moe_model.py's grouped one does not.
    layout = ParallelLayout(dp=4, ep=2, zero_stage=3, micro_batch_size=2)
    uneven = [PlanPricer(profile, cpu, TrainSpec(8, precision="fp32", moe_imbalance=m)) for m in (1.0, 1.5)]
    layer = profile.layer("model.layers.0")
    assert uneven[1].layer_prices._ep_time_s(layer, layout, 1.0) > uneven[0].layer_prices._ep_time_s(layer, layout, 1.0)
    # By hand: 4 exchanges of the T·k rows, and one of the 4 experts' int64 counts first.
    even, group = uneven[0], uneven[0].groups.placement(layout, "ep")
    rows = even.groups.collective_s(Collective.ALL_TO_ALL, moe.dispatch_rows * moe.token_bytes, group)
    counts = even.groups.collective_s(Collective.ALL_TO_ALL, 8 * 4, group)
    assert even.layer_prices._ep_time_s(layer, layout, 1.0) == pytest.approx(4 * rows + counts)
    mixtral_layers = sum(1 for layer in profile.layers if facts.experts_of(layer.name))
    assert even.issued.ep_collectives(replace(layout, num_micro_batches=2)) == {"all_to_all": 5 * mixtral_layers * 2}


def test_the_experts_width_is_read_off_the_weights_beside_the_routers_width():
    """Expert TP splits each expert's feed-forward width F: the dim of each [E, a, b] weight that is
    not the hidden size (the router's [E, h] input width), in 1 block or 2 (a fused [gate; up]).
    The cost model reads it off the profile's shapes and the generated code off the module, alike;
    where a weight has no single hidden dim, or a bias, nothing is split."""
    import torch

    from autopar.sections.expert_parallel import _slice_width, router_width, width_split
    from cost_models.expert_parallel import feed_forward_width

    h, f, e = 32, 64, 4
    assert feed_forward_width([[e, 2 * f, h], [e, h, f]], h) == f  # Hugging Face: [E, out, in], gate and up fused
    assert feed_forward_width([[e, h, f], [e, f, h]], h) == f  # tests/moe_model.py: x @ W
    assert feed_forward_width([[e, h, h], [e, h, f]], h) == 0  # a fused projection as wide as the hidden size
    assert feed_forward_width([[e, h, f], [e, f]], h) == 0  # a bias: each slice would add it again
    assert feed_forward_width([[e, h, f], [e, f, h]], None) == 0  # no router to tell the hidden size
    for model_file, kwargs in ((HF_ZOO, {"arch": "mixtral"}), (MOE, {})):
        model = meta_model(model_file, **kwargs)
        for fqn, module in model.named_modules():
            if fqn.endswith("experts") and list(module.parameters(recurse=False)):
                shapes = [list(p.shape) for p in module.parameters(recurse=False)]
                hidden = router_width(model, fqn, shapes[0][0])
                width = feed_forward_width(shapes, hidden)
                split = width_split(fqn, module, 2, hidden)
                assert width and all(module.get_parameter(name).shape[dim] == parts * width
                                     for name, (dim, parts) in split.items())
    # A fused [gate; up] slice keeps each block's slice side by side: rank 1 of 2 holds gate[2:4], up[2:4].
    fused = torch.arange(8.0).view(1, 8, 1)  # gate = 0..3, up = 4..7
    assert _slice_width(fused, 1, 2, 2, 1).flatten().tolist() == [2.0, 3.0, 6.0, 7.0]


def test_expert_tensor_parallelism_is_priced_by_hand():
    """Under expert TP each TP rank holds and computes a tp-th of its experts, and the TP group sums
    the experts' partial results: per micro-batch one all-reduce of the E x C output rows in
    forward and one of the input's gradient in backward (a grouped module), again in a recomputed
    forward. The search offers it where tp divides the width, and never without TP."""
    from autopar.solver.tp_split import ILPSplitter

    p = PlanPricer(moe_profile(), cluster(), TrainSpec(global_batch_size=64, precision="fp32"),
                   ILPSplitter(moe_profile()))
    moe = p.experts.layers["blocks.0"]
    layer = p.profile.layer("blocks.0")
    base = ParallelLayout(dp=8, tp=2, ep=2, zero_stage=3, micro_batch_size=4)
    etp = replace(base, expert_tp=True)
    assert not problems(etp, LayoutFacts(experts=E, expert_width=FFN))
    assert "needs tp > 1" in problems(replace(etp, tp=1, dp=16), LayoutFacts(experts=E, expert_width=FFN))[0]
    assert "pin expert_tp=false" in problems(etp, LayoutFacts(experts=E, expert_width=0))[0]
    group = p.groups.placement(etp, "tp")
    rows = 2 * E * B0 * CAPACITY * moe.token_bytes  # micro-batch 4: twice the profiled rows
    sums = {option: forwards * p.groups.collective_s(Collective.ALL_REDUCE, rows, group)
            for option, forwards in (("none", 2), ("full", 3))}
    for option, want in sums.items():
        ep_time_s = p.layer_prices._ep_time_s
        assert ep_time_s(layer, etp, 2.0, option) == pytest.approx(ep_time_s(layer, base, 2.0, option) + want)
    # A tp-th of the experts' compute: (pace / tp - 1) of it, pace 1 for grouped experts.
    split = p.split(layer.name, etp, p.cluster.node_gpus[0])
    expert_s = (moe.expert_forward_share * split.compute.forward_s + moe.expert_backward_share
                * split.compute.backward_s) * 2.0
    assert p.layer_prices._ep_wait_s(layer, split, etp, 2.0) == pytest.approx(-0.5 * expert_s)
    dense, experts = p.layer_prices._rank_params(layer, split, etp)
    assert experts == pytest.approx(p.layer_prices._rank_params(layer, split, base)[1] / 2) \
        and dense == p.layer_prices._rank_params(layer, split, base)[0]
    shape = ModelShape.from_profile(moe_profile())
    assert shape.expert_width == FFN
    assert {c.expert_tp for c in enumerate_candidates(shape, 4, 4, 8, SolverConfig(), PlanPins(tp=2))} == {False, True}
    assert {c.expert_tp for c in enumerate_candidates(shape, 4, 4, 8, SolverConfig(), PlanPins(tp=1))} == {False}


def test_a_pinned_expert_tp_that_cannot_run_is_refused_in_words():
    from autopar.errors import UserError
    from autopar.solver.planner import Planner
    from tests.profiles import gpt

    with pytest.raises(UserError, match="this model has none"):
        Planner(gpt(), cluster(1), TrainSpec(16), SolverConfig(), PlanPins(expert_tp=True)).run()
    with pytest.raises(UserError, match="plan.tp=1 cannot do"):
        Planner(moe_profile(), cluster(1), TrainSpec(16, precision="fp32"), SolverConfig(),
                PlanPins(expert_tp=True, tp=1)).run()
    unsplittable = replace(moe_profile(), param_shapes={
        name: (shape[:2] if name.endswith("w_out") else shape) for name, shape in moe_profile().param_shapes.items()})
    with pytest.raises(UserError, match="one of a, b the hidden size"):
        Planner(unsplittable, cluster(1), TrainSpec(16, precision="fp32"), SolverConfig(),
                PlanPins(expert_tp=True)).run()


def test_routing_pace_from_measured_tokens_per_expert():
    """By hand: experts r·E/ep ... sit on rank r; the busiest rank's tokens over the mean rank's."""
    assert routing_pace(2, 1.7, True, (30, 10, 0, 0)) == 2.0  # ranks hold 40 and 0 of 40
    assert routing_pace(4, 1.7, True, (30, 10, 0, 0)) == 3.0  # the busiest holds 30 of a mean 10
    assert routing_pace(2, 1.7, True, (10, 0, 0, 10)) == 1.0  # each rank holds 10
    assert routing_pace(2, 1.7, False, (30, 10, 0, 0)) == 1.0  # grouped experts: every slot moves anyway
    assert routing_pace(2, 1.7, True) == 1.7  # nothing measured: train.moe_imbalance


def test_tokens_per_expert_are_measured_from_a_router_checkpoint(tmp_path):
    """train.router_checkpoint: the Hugging Face Mixtral's weights are loaded from a state dict
    and its experts' (token, choice) pairs counted over example batches. The counts equal those
    read independently off the model's own router logits (output_router_logits, top-2 of each
    token's scores), and the planner prices the busiest rank from them: its wait is
    (pace - 1) of the experts' compute, the pace computed by hand from the counts."""
    import torch

    from autopar.config import compose_config
    from autopar.driver import run_plan
    from autopar.errors import ConfigError
    from autopar.model_file import load_model_file, make_batch
    from autopar.trace.routing import measure_expert_load

    model_file = load_model_file(HF_ZOO)
    torch.manual_seed(3)
    model = model_file.build_model(arch="mixtral")
    checkpoint = tmp_path / "router.pt"
    torch.save(model.state_dict(), checkpoint)
    load = measure_expert_load(model_file, {"arch": "mixtral"}, checkpoint, batch_size=2, batches=3)
    expected = {}
    with torch.no_grad():
        for index in range(3):
            torch.manual_seed(index)
            batch = make_batch(model_file, 2, {"arch": "mixtral"})
            logits = model(input_ids=batch["input_ids"], output_router_logits=True).router_logits
            for layer, scores in enumerate(logits):
                counts = torch.bincount(scores.topk(2, dim=-1).indices.flatten(), minlength=4)
                expected[f"model.layers.{layer}.mlp.experts"] = \
                    expected.get(f"model.layers.{layer}.mlp.experts", 0) + counts
    assert load == {fqn: counts.tolist() for fqn, counts in expected.items()}
    assert all(sum(counts) == 3 * 2 * 16 * 2 for counts in load.values())  # batches x samples x tokens x top-2
    cfg = compose_config(["model.arch=mixtral", "cluster=cpu_gloo", "cluster.gpus_per_node=4", "plan.ep=2",
                          "plan.dp=4", "plan.zero_stage=3", "train.precision=fp32", "train.global_batch_size=8",
                          f"train.router_checkpoint={checkpoint}", "train.router_batches=3",
                          "train.micro_batch_size=2"])
    plan = run_plan(HF_ZOO, cfg).plan
    assert plan.expert_load == load
    first = load["model.layers.0.mlp.experts"]
    pace = max(sum(first[:2]), sum(first[2:])) / (sum(first) / 2)
    from cost_models.expert_parallel import ExpertFacts
    pricer = PlanPricer(moe_profile_hf(), ClusterSpec.from_config(ClusterConfig(name="t", gpu="cpu", gpus_per_node=4)),
                        TrainSpec(8, precision="fp32", expert_load=tuple((f, tuple(c)) for f, c in load.items())))
    moe = ExpertFacts.of(pricer.profile).layers["model.layers.0"]
    assert pricer.layer_prices._pace(moe, plan.layout()) == pytest.approx(pace)
    with pytest.raises(ConfigError, match="is not a file"):
        measure_expert_load(model_file, {"arch": "mixtral"}, tmp_path / "missing.pt", 2, 1)
    with pytest.raises(ConfigError, match="does not match the model"):
        measure_expert_load(model_file, {"arch": "mixtral", "layers": 3}, checkpoint, 2, 1)


@functools.lru_cache(maxsize=None)
def moe_profile_hf():
    from autopar.model_file import load_model_file
    from autopar.profile import profile_model

    return profile_model(load_model_file(HF_ZOO), {"arch": "mixtral"}, micro_batch_size=2, precision="fp32")

"""The rules of a plan's structure (autopar.domain.rules): each by hand, and the same problem named by
every stage that asks them (a plan file read back, the pricer, code generation)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from autopar.codegen import CodegenError
from autopar.codegen.generate import check_plan
from autopar.codegen.model_facts import inspect_model
from autopar.config import ClusterConfig
from autopar.domain import rules
from autopar.domain.layout import TrainSpec
from cost_models.validate import validate_layout
from cost_models.topology import ClusterSpec
from tests.dist.plans import GPT, make_plan


def test_batch_split_by_hand():
    assert rules.batch_split(2, 4, 2, 16) is None
    broken = rules.batch_split(2, 4, 2, 12)
    assert broken and "2×4×2 = 16 is not the global batch 12" in broken.problem


def test_expert_groups_divide_the_data_and_context_parallel_ranks():
    assert rules.ep_carving(4, 2, 2) is None and rules.ep_carving(1, 3, 1) is None
    broken = rules.ep_carving(3, 2, 2)
    assert broken and "ep=3 must divide dp x cp = 4" in broken.problem


def test_uneven_shares():
    assert rules.uneven_shares((), 2, 4, 2) is None
    assert rules.uneven_shares((3, 1), 2, 2, 1) is None
    for shares in ((3, 2), (4, 0), (4,)):  # sum, an empty rank, one share for two ranks
        broken = rules.uneven_shares(shares, 2, 2, 1)
        assert broken and "sum to dp x micro_batch_size = 4" in broken.problem
    broken = rules.uneven_shares((3, 1), 2, 2, 2)
    assert broken and "need pp=1" in broken.problem


def test_mesh_axes():
    assert rules.mesh_axes(("tp", "cp", "pp", "dp")) is None
    assert rules.mesh_axes(("dp", "tp", "pp", "cp")) is None
    for order in (("tp", "dp"), ("tp", "tp", "pp", "dp"), ("tp", "cp", "pp", "dp", "ep")):
        assert rules.mesh_axes(order) is not None


def test_stage_partition_names_what_is_wrong():
    names = ["a", "b", "c", "d"]
    assert rules.stage_partition([["a", "b"], ["c", "d"]], names) is None
    missing = rules.stage_partition([["a"], ["c", "d"]], names)
    assert missing and "(missing: b)" in missing.problem
    stranger = rules.stage_partition([["a", "b"], ["c", "d", "e"]], names)
    assert stranger and "(not a layer: e)" in stranger.problem
    swapped = rules.stage_partition([["c", "d"], ["a", "b"]], names)
    assert swapped and "in model order" in swapped.problem
    assert rules.stage_partition([["a", "b", "c", "d"], []], names) is not None  # an empty stage
    pinned = rules.stage_partition([["a"]], names, "plan.stages")
    assert pinned and pinned.problem.startswith("plan.stages must") and "a ... d" in pinned.fix


def test_stage_count_and_recompute():
    assert rules.stage_count([["a"], ["b"], ["c"], ["d"]], 2, 2) is None
    broken = rules.stage_count([["a"], ["b"]], 2, 2)
    assert broken and "2 stages given for pp=2 × chunks=2" in broken.problem
    assert rules.recompute_choices("full", None) is None
    assert rules.recompute_choices({"a": "selective"}, ["a", "b"]) is None
    unknown_option = rules.recompute_choices({"a": "some"}, ["a"])
    assert unknown_option and "recompute 'some' is not one of none, selective, full" in unknown_option.problem
    stray = rules.recompute_choices({"z": "full"}, ["a", "b"], "plan.layer_recompute")
    assert stray and stray.problem == "plan.layer_recompute names unknown layers: z"


@pytest.fixture(scope="module")
def pipelined():
    """A valid dp2 x pp2 plan of the tiny GPT and the facts code generation reads of its model."""
    plan = make_plan(GPT, dp=2, pp=2)
    assert plan.problems() == []
    return plan, inspect_model(GPT.path, dict(GPT.kwargs))


def _broken_plans(plan):
    """One rule broken at a time, each with the rule's own verdict on it."""
    names, stages = plan.layer_names, plan.stages
    reordered = [list(stages[1]), list(stages[0])]
    unknown = {names[0]: "full", "not_a_layer": "full"}
    return [
        (replace(plan, global_batch_size=plan.global_batch_size + 2),
         rules.batch_split(plan.dp, plan.micro_batch_size, plan.num_micro_batches, plan.global_batch_size + 2)),
        (replace(plan, stages=reordered), rules.stage_partition(reordered, names)),
        (replace(plan, stages=[[*stages[0], *stages[1]]]), rules.stage_count([[*stages[0], *stages[1]]], 2, 1)),
        (replace(plan, mesh_order=["tp", "dp", "pp", "dp"]), rules.mesh_axes(["tp", "dp", "pp", "dp"])),
        (replace(plan, recompute=unknown), rules.recompute_choices(unknown, names)),
    ]


def test_every_stage_names_the_same_problem(pipelined):
    """A plan file read back, the pricer and code generation refuse a broken plan with the rule's
    own words: the rule is written once."""
    plan, facts = pipelined
    cluster = ClusterSpec.from_config(ClusterConfig(name="t", gpu="cpu", nodes=1, gpus_per_node=plan.world_size))
    for broken, verdict in _broken_plans(plan):
        assert verdict is not None
        assert verdict.problem in broken.problems()
        with pytest.raises(ValueError) as priced:
            validate_layout(broken.layout(), cluster, TrainSpec(global_batch_size=broken.global_batch_size,
                                                                precision="fp32"), broken.layer_names)
        assert str(priced.value) == verdict.problem
        with pytest.raises(CodegenError) as generated:
            check_plan(broken, facts)
        assert verdict.problem in str(generated.value) and verdict.fix in str(generated.value)

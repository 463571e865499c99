"""The pricer's collaborators built alone, from their explicit dependencies (no PlanPricer): each
answers exactly what the pricer that owns the same collaborators answers, and the stage starts,
recompute options and token weighting a layout asks of the model are read off the profile alone."""
from __future__ import annotations

import pytest

from autopar.domain.layout import ParallelLayout, TrainSpec
from cost_models.breakdowns import EstimateAssembler
from cost_models.compute import ComputeModel
from cost_models.dp_sync import GradientSync
from cost_models.expert_parallel import ExpertFacts
from cost_models.issued import IssuedCollectives
from cost_models.layer_cost import LayerPrices
from cost_models.layer_split import LayerSplits
from cost_models.memory import state_bytes_per_param
from cost_models.pipeline import evaluate
from cost_models.placement import LayoutGroups
from cost_models.ranks import PipelineRanks
from cost_models.step import PlanPricer
from cost_models.structure import ModelStructure
from cost_models.topology import ClusterConfig, ClusterSpec, NodeGroupConfig
from tests.profiles import gpt, planner_splitter

TRAIN = TrainSpec(global_batch_size=16)
OPTIONS = ("none", "selective", "full")
LAYOUTS = [ParallelLayout(dp=8, micro_batch_size=2, num_micro_batches=1, zero_stage=3),
           ParallelLayout(dp=2, tp=2, pp=2, micro_batch_size=2, num_micro_batches=4, sequence_parallel=True,
                          recompute="full"),
           ParallelLayout(dp=2, cp=2, tp=2, micro_batch_size=2, num_micro_batches=4, zero_stage=2,
                          recompute="selective")]


def mixed() -> ClusterSpec:
    """Four H100s and four A100s: pipeline ranks and data-parallel ranks of two speeds."""
    return ClusterSpec.from_config(ClusterConfig(name="mixed", gpus_per_node=4, inter_node_bandwidth_GBps=25,
                                                 node_groups=[NodeGroupConfig("H100-SXM", 1),
                                                              NodeGroupConfig("A100-80GB", 1)]))


@pytest.fixture(scope="module")
def alone():
    """Every collaborator wired by hand, as PlanPricer wires its own."""
    profile, cluster = gpt(), mixed()
    compute = ComputeModel(profile)
    groups = LayoutGroups(cluster)
    grads_bytes = state_bytes_per_param(TRAIN.precision, TRAIN.optimizer)[1]
    sync = GradientSync(groups, compute, profile.layers, grads_bytes, profile.micro_batch_size, TRAIN.precision)
    structure = ModelStructure(profile, compute)
    experts = ExpertFacts.of(profile)
    splits = LayerSplits(profile, compute, groups, planner_splitter(profile))
    ranks = PipelineRanks(cluster, groups, splits, profile.layers)
    prices = LayerPrices(profile, cluster, TRAIN, compute, groups, sync, structure, experts, splits, ranks)
    issued = IssuedCollectives(profile, TRAIN, compute, structure, groups, sync, experts, splits, ranks, prices,
                               OPTIONS)
    assembler = EstimateAssembler(profile, cluster, TRAIN, groups, sync, splits, ranks, prices, compute.dtype)
    pricer = PlanPricer(profile, cluster, TRAIN, planner_splitter(profile), recompute_options=OPTIONS)
    return dict(profile=profile, structure=structure, splits=splits, ranks=ranks, prices=prices, issued=issued,
                assembler=assembler, pricer=pricer)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_collaborators_alone_answer_as_the_pricer_does(alone, layout):
    pricer, prices = alone["pricer"], alone["prices"]
    assert alone["ranks"].device_facts(layout) == pricer.ranks.device_facts(layout)
    reference = alone["ranks"].reference_gpu(layout)
    assert alone["issued"].per_step(layout) == pricer.issued_collectives(layout)
    for layer in alone["profile"].layers:
        split = alone["splits"].split(layer.name, layout, reference)
        assert split == pricer.split(layer.name, layout, reference)
        assert prices.layer_time_parts(layer, split, layout, 1.0, OPTIONS, reference) == \
            pricer.layer_prices.layer_time_parts(layer, split, layout, 1.0, OPTIONS, reference)
        assert prices.per_step_parts(layer, split, layout, 1.0, reference) == \
            pricer.layer_prices.per_step_parts(layer, split, layout, 1.0, reference)
        assert prices.states(layer, split, layout) == pricer.layer_prices.states(layer, split, layout)
    # The assembler turns the pricer's own tables into the pricer's estimate.
    problem = pricer.partition_problem(layout)
    estimate = pricer.estimate(layout)
    partition = evaluate(problem, alone["structure"].stage_starts(layout),
                         alone["structure"].layer_options(layout, OPTIONS))
    assembled = alone["assembler"].assemble(layout, problem, partition, partition is not None,
                                            pricer.time_parts_rows(layout, reference),
                                            pricer.per_step_rows(layout, reference), pricer.fixed_time_s(layout))
    assert assembled == estimate


def test_the_structure_answers_what_a_layout_asks_of_the_model(alone):
    structure = alone["structure"]
    names = [layer.name for layer in structure.layers]
    assert names == ["wte", "wpe", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "ln_f", "lm_head"]
    # Two stages: the embeddings join the first half of the blocks, the head the second.
    assert structure.stage_starts(ParallelLayout(pp=2)) == [0, 4]
    assert structure.stage_starts(ParallelLayout(pp=2, stages=(tuple(names[:3]), tuple(names[3:])))) == [0, 3]
    per_layer = ParallelLayout(recompute={"blocks.0": "full", "blocks.1": "selective"})
    assert structure.layer_options(per_layer, OPTIONS) == [0, 0, 2, 1, 0, 0, 0, 0]
    with pytest.raises(ValueError):
        structure.layer_options(ParallelLayout(recompute="full"), ("none",))
    # GPT's loss is a mean over the targets it counts: weighed once the batch is split.
    assert structure.weighs_tokens(ParallelLayout(dp=4)) and not structure.weighs_tokens(ParallelLayout())


def test_a_tp_group_mixing_gpu_types_has_no_reference_gpu(alone):
    spanning = ParallelLayout(tp=8)
    assert alone["ranks"].device_facts(spanning) is None
    with pytest.raises(ValueError, match="mix GPU types"):
        alone["ranks"].reference_gpu(spanning)

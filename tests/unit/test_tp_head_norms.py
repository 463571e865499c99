"""Per-head norms on the rank's heads (autopar.solver.tp_head_norms): found from the traced
shapes, chosen by the ILP where they let the attention pair, priced as their weights' gradient
all-reduces, and counted as the collectives the generated step issues."""
from __future__ import annotations

import pytest

from autopar.solver.intra_op import IntraOpSolver
from autopar.solver.tp_head_norms import head_norm_reductions
from autopar.solver.tp_split import _GroupCosts
from cost_models.compute import compute_dtype
from cost_models.topology import ClusterConfig, ClusterSpec
from tests.profiles import planner_splitter, tp_split, traced

HIDDEN, HEADS, KV_HEADS, FFN = 256, 4, 2, 688
HEAD_DIM = HIDDEN // HEADS
SHAPE = dict(layers=2, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, ffn=FFN, vocab=1024, seq_len=128)


@pytest.fixture(scope="module")
def qwen3():
    return traced("llama_hf.py", "bf16", 1, family="qwen3", **SHAPE)


def _block(profile) -> str:
    return next(layer.name for layer in profile.layers if layer.is_block)


def test_the_per_head_norms_reductions_are_found_and_no_other(qwen3):
    """Each q_norm and k_norm reduces over the head's 64 features of its [b, s, heads, 64] view
    and holds one weight of 64: found, with its fp32 bytes. The block norms (over the hidden
    features) and the Llama without per-head norms give nothing."""
    found = head_norm_reductions(qwen3)
    by_module = {}
    for name, parameters in found.items():
        by_module.setdefault(next(op.module for op in qwen3.ops if op.name == name), []).append(parameters)
    assert by_module == {f"model.layers.{i}.self_attn.{n}_norm": [(4.0 * HEAD_DIM,)] for i in (0, 1) for n in "qk"}
    assert head_norm_reductions(traced("llama_hf.py", "bf16", 1, **SHAPE)) == {}


@pytest.mark.parametrize("tp", [2, 4])
def test_attention_pairs_with_its_norms_on_head_shards(qwen3, tp):
    key_value = "kv_group" if tp > KV_HEADS else "colwise"
    styles = {module.rsplit(".", 1)[-1]: style for module, style in tp_split(qwen3, _block(qwen3), tp).styles.items()}
    assert styles == {"q_proj": "colwise", "k_proj": key_value, "v_proj": key_value, "o_proj": "rowwise",
                      "q_norm": "head_norm", "k_norm": "head_norm", "gate_proj": "colwise", "up_proj": "colwise",
                      "down_proj": "rowwise"}
    # The norms' weights stay whole: only the two block norms and the two head norms are not split.
    split = tp_split(qwen3, _block(qwen3), tp)
    params = qwen3.layer(_block(qwen3)).param_count
    assert split.tp_sharded_param_fraction == pytest.approx((params - 2 * HIDDEN - 2 * HEAD_DIM) / params)


def test_the_head_norm_option_prices_its_gradient_all_reduces_and_never_costs_more(qwen3):
    """Solved with and without the option: with it the layer costs less (the norms no longer
    force q and k whole), and its price is the strategy's work on the heads plus one
    all-reduce of each norm weight's gradient."""
    block = _block(qwen3)
    spec = ClusterSpec.from_config(ClusterConfig(name="t", gpu="A100-80GB", nodes=1, gpus_per_node=2))
    costs = _GroupCosts(spec.node_gpus[0], compute_dtype(qwen3.precision), spec.group_links([0, 1]))
    splitter = planner_splitter(qwen3)
    found = head_norm_reductions(qwen3)
    with_norms = IntraOpSolver(qwen3, costs, 2, head_norms=found, index=splitter.index).solve(block)
    without = IntraOpSolver(qwen3, costs, 2, head_norms={}, index=splitter.index).solve(block)
    assert with_norms.time_s < without.time_s
    assert "head_norm" not in {style.value for style in without.module_style.values()}
    solver = IntraOpSolver(qwen3, costs, 2, head_norms=found, index=splitter.index)
    ops = [op for op in qwen3.ops if op.layer == block and op.phase == "forward"]
    reductions = [op for op in ops if op.name in found]
    assert len(reductions) == 2  # one mean per norm: the gradient's all-reduce is priced at it
    norms = solver._head_norm_modules(ops)
    assert [solver._head_norm_gradients(op, norms) for op in reductions] == [(4.0 * HEAD_DIM,)] * 2


def test_the_step_counts_each_norm_weights_gradient_all_reduce(qwen3):
    """reduce_partial_gradients sums each head norm's weight gradient once a step (2 blocks x 2
    norms); FSDP's per-micro-batch reduce-scatter sums them every micro-batch instead."""
    from autopar.config import PlanPins, SolverConfig
    from autopar.solver.planner import Planner
    from cost_models.step import TrainSpec

    train = TrainSpec(global_batch_size=8, precision="bf16", optimizer="adam")
    counts = {}
    for name, pins in (("tp2", PlanPins(tp=2, dp=1, pp=1, cp=1, micro_batch_size=2)),
                       ("dp2_tp2_zero3", PlanPins(tp=2, dp=2, pp=1, cp=1, zero_stage=3, micro_batch_size=2))):
        cluster = ClusterSpec.from_config(ClusterConfig(name="t", gpu="A100-80GB", nodes=1,
                                                        gpus_per_node=pins.dp * pins.tp))
        planner = Planner(qwen3, cluster, train, SolverConfig(time_limit_s=30, top_k=0), pins)
        layout = planner.run().plan.layout()
        counts[name] = (planner.pricer.issued.partial_gradient_collectives(layout), layout.num_micro_batches)
    assert counts["tp2"] == ({"all_reduce": 4}, 4)
    assert counts["dp2_tp2_zero3"] == ({"all_reduce": 4 * 2}, 2)

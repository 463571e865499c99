"""Tensor parallelism by propagation: Megatron's pairing falls out of the graph, with its
collectives, its sharded FLOPs and parameters; the same pairing as autopar's intra-op ILP."""
from __future__ import annotations

import subprocess
import sys

import pytest

from cost_models.hardware import get_gpu
from cost_models.tp_sharding import GATHER, PropagationSplitter, map_view, propagate
from tests.profiles import B, H, S, SBH_BYTES, gpt, traced

MEGATRON_BLOCK = {"attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise",
                  "attn.out_proj": "rowwise", "mlp.fc_in": "colwise", "mlp.fc_out": "rowwise"}


def test_gpt_block_gets_megatrons_pairing_and_collectives():
    split = PropagationSplitter(gpt()).split("blocks.2", 4)
    assert split.styles == {f"blocks.2.{module}": style for module, style in MEGATRON_BLOCK.items()}
    # Shoeybi et al. §3: two all-reduces of b·s·h forward (after out_proj, fc_out), two backward
    # (the gradients of the attention and MLP inputs).
    assert split.comm == (("all_reduce", 2 * SBH_BYTES),) * 4 and split.forward_comm == 2


def test_sharded_work_is_every_gemm_and_attention_of_a_block():
    profile = gpt()
    run = propagate(profile, 4)
    forward = [op for op in profile.ops if op.layer == "blocks.0" and op.phase == "forward"]
    heavy = {op.name for op in forward if op.op_class in ("gemm", "attention")}
    assert heavy <= run.sharded_work
    assert not any(op.op_class == "norm" and op.name in run.sharded_work for op in forward)
    gpu = get_gpu("A100-80GB")
    one = PropagationSplitter(profile).split("blocks.0", 1, gpu=gpu).compute
    four = PropagationSplitter(profile).split("blocks.0", 4, gpu=gpu)
    assert four.compute.forward_s == pytest.approx(
        four.replicated_forward_s + (one.forward_s - four.replicated_forward_s) / 4)


def test_split_parameters_are_all_but_norms_and_row_parallel_biases():
    split = PropagationSplitter(gpt()).split("blocks.0", 2)
    params = 12 * H * H + 13 * H
    replicated = 4 * H + 2 * H  # two LayerNorms (weight, bias), out_proj and fc_out biases
    assert gpt().layer("blocks.0").param_count == params
    assert split.tp_sharded_param_fraction == pytest.approx((params - replicated) / params)


def test_embedding_and_head_are_vocabulary_parallel():
    splitter = PropagationSplitter(gpt())
    wte, head = splitter.split("wte", 2), splitter.split("lm_head", 2)
    assert wte.styles == {"wte": "vocab_parallel"} and wte.tp_sharded_param_fraction == 1.0
    assert wte.comm == (("all_reduce", 2 * SBH_BYTES),)  # partial lookups summed
    assert head.styles == {"lm_head": "colwise"}
    # The loss over vocabulary-sharded logits exchanges only row statistics (not b·s·V logits).
    forward = [nbytes for _, nbytes in head.comm[:head.forward_comm]]
    assert sum(forward) < 0.05 * B * S * 512 * 2
    assert splitter.split("wpe", 2).styles == {}  # positions are looked up by arange: replicated


def test_same_pairing_as_the_intra_op_ilp():
    """The propagation and autopar's CP-SAT operator-wise solver agree on GPT's block."""
    from autopar.solver.tp_split import ILPSplitter
    from cost_models.topology import ClusterConfig, ClusterSpec

    profile = gpt()
    spec = ClusterSpec.from_config(ClusterConfig(name="t", gpu="A100-80GB", nodes=1, gpus_per_node=4))
    group = spec.group_links([0, 1, 2, 3])
    ilp = ILPSplitter(profile).split("blocks.0", 4, group, spec.node_gpus[0])
    ours = PropagationSplitter(profile).split("blocks.0", 4, group, spec.node_gpus[0])
    assert ours.styles == ilp.styles
    # Same collectives; the ILP also counts the layer norm's statistics with its output (<1%).
    assert [op for op, _ in ours.comm] == [op for op, _ in ilp.comm]
    assert sum(n for _, n in ours.comm) == pytest.approx(sum(n for _, n in ilp.comm), rel=0.01)


def test_llama_with_grouped_query_attention():
    """HF Llama (RMSNorm, RoPE, GQA repeat_kv, SwiGLU): q/k/v/gate/up column, o/down row."""
    profile = traced("llama_hf.py", "bf16", 1, layers=2, hidden=256, heads=4, kv_heads=2, ffn=688, vocab=1024,
                     seq_len=128)
    block = next(layer.name for layer in profile.layers if layer.is_block)
    split = PropagationSplitter(profile).split(block, 2)
    styles = {module.rsplit(".", 1)[-1]: style for module, style in split.styles.items()}
    assert styles == {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise",
                      "gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}
    assert [op for op, _ in split.comm] == ["all_reduce"] * 4


@pytest.mark.parametrize("state,shape,out,tp,expected", [
    (2, [2, 256, 256], [2, 256, 4, 64], 4, 2),      # split hidden into heads: heads sharded
    (2, [2, 256, 4, 64], [2, 4, 256, 64], 4, 1),    # transpose(1, 2) moves it
    (2, [2, 256, 4, 64], [2, 256, 256], 4, 2),      # heads and head_dim merged back: hidden
    (1, [512, 256], [2, 256, 256], 4, 2),           # a (b·s, h) GEMM output viewed as (b, s, h)
    (2, [2, 256, 256], [2, 256, 3, 64], 2, GATHER),  # 3 heads cannot split over 2 ranks
    (1, [1, 2, 128, 64], [1, 2, 1, 128, 64], 2, 1),  # unsqueeze before GQA's repeat_kv
    (1, [1, 2, 2, 128, 64], [1, 4, 128, 64], 2, 1),  # kv heads x repeats merged: still heads
    (None, [2, 3], [6], 2, None),
])
def test_views_carry_the_sharded_dim(state, shape, out, tp, expected):
    assert map_view(state, shape, out, tp) == expected


def test_cost_models_never_imports_autopar():
    code = ("import sys, cost_models, cost_models.calibrate; "
            "sys.exit(any(m == 'autopar' or m.startswith('autopar.') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_a_block_hands_on_one_bf16_activation_of_b_s_h():
    """SBH_BYTES, the unit these tests count collectives in, is what the traced blocks exchange:
    one bf16 [b, s, h] tensor enters and leaves each block (2 bytes per element)."""
    block = gpt().layer("blocks.1")
    assert block.input_bytes == block.output_bytes == 2 * SBH_BYTES

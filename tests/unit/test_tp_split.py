"""The planner's operator-wise TP split (autopar.solver.tp_split.ILPSplitter), the one PlanPricer
prices and codegen emits: Megatron's pairing falls out of the graph, with its collectives, its
sharded FLOPs and parameters."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.profiles import B, H, S, SBH_BYTES, gpt, tp_split, traced

MEGATRON_BLOCK = {"attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise",
                  "attn.out_proj": "rowwise", "mlp.fc_in": "colwise", "mlp.fc_out": "rowwise"}


def test_gpt_block_gets_megatrons_pairing_and_collectives():
    block = tp_split(gpt(), "blocks.2", 4)
    assert block.styles == {f"blocks.2.{module}": style for module, style in MEGATRON_BLOCK.items()}
    # Shoeybi et al. §3: two all-reduces of b·s·h forward (after out_proj, fc_out), two backward
    # (the gradients of the attention and MLP inputs); the ILP also counts the layer norms'
    # statistics with their outputs (under 1% more bytes).
    comm, forward = block.collectives(sequence_parallel=False)
    assert [kind for kind, _ in comm] == ["all_reduce"] * 4 and forward == 2
    assert [nbytes for _, nbytes in comm] == pytest.approx([2 * SBH_BYTES] * 4, rel=0.01)


def test_sharded_work_divides_by_t_and_the_rest_stays_whole():
    """A block's forward at tp 4 is its replicated ops plus a quarter of everything else."""
    one, four = tp_split(gpt(), "blocks.0", 1), tp_split(gpt(), "blocks.0", 4)
    assert four.replicated_forward_s < 0.2 * one.compute.forward_s  # norms, residuals: GEMMs and attention split
    assert four.compute.forward_s == pytest.approx(
        four.replicated_forward_s + (one.compute.forward_s - four.replicated_forward_s) / 4)


def test_split_parameters_are_all_but_norms_and_row_parallel_biases():
    block = tp_split(gpt(), "blocks.0", 2)
    params = 12 * H * H + 13 * H
    replicated = 4 * H + 2 * H  # two LayerNorms (weight, bias), out_proj and fc_out biases
    assert gpt().layer("blocks.0").param_count == params
    assert block.tp_sharded_param_fraction == pytest.approx((params - replicated) / params)


def test_tied_embedding_is_vocabulary_parallel_behind_its_column_parallel_head():
    """GPT ties wte to lm_head: the head splits column-wise (the vocabulary), so the embedding
    holds the same rows and looks up vocabulary-parallel: its partial lookups are summed."""
    head, wte = tp_split(gpt(), "lm_head", 2), tp_split(gpt(), "wte", 2)
    assert head.styles == {"lm_head": "colwise"}
    assert wte.tp_sharded_param_fraction == 1.0  # the tied tensor is counted once, at the embedding
    assert wte.collectives(sequence_parallel=False) == ((("all_reduce", 2 * SBH_BYTES),), 1)
    # The loss over vocabulary-sharded logits exchanges only row statistics (not b·s·V logits).
    comm, forward = head.collectives(sequence_parallel=False)
    assert sum(nbytes for _, nbytes in comm[:forward]) < 0.05 * B * S * 512 * 2


def test_llama_with_grouped_query_attention():
    """HF Llama (RMSNorm, RoPE, GQA repeat_kv, SwiGLU): q/k/v/gate/up column, o/down row."""
    profile = traced("llama_hf.py", "bf16", 1, layers=2, hidden=256, heads=4, kv_heads=2, ffn=688, vocab=1024,
                     seq_len=128)
    block = next(layer.name for layer in profile.layers if layer.is_block)
    styles = {module.rsplit(".", 1)[-1]: style for module, style in tp_split(profile, block, 2).styles.items()}
    assert styles == {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise",
                      "gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}


def test_cost_models_imports_only_the_plan_domain_of_autopar():
    """The cost models price a layout without the tracer, the solver or code generation: of
    autopar they load only the plan's domain (autopar.domain, which imports nothing above it)."""
    code = ("import sys, cost_models, cost_models.calibrate; "
            "sys.exit(any(m.startswith('autopar.') and m.split('.')[1] != 'domain' for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_a_block_hands_on_one_bf16_activation_of_b_s_h():
    """SBH_BYTES, the unit these tests count collectives in, is what the traced blocks exchange:
    one bf16 [b, s, h] tensor enters and leaves each block (2 bytes per element)."""
    block = gpt().layer("blocks.1")
    assert block.input_bytes == block.output_bytes == 2 * SBH_BYTES

"""Memory: the ZeRO paper's model states and the generated code's (FSDP2), and Megatron's
per-layer activation formulas (no parallelism, TP, TP+SP, recomputation) against what memory.py
computes from a traced GPT."""
from __future__ import annotations

import pytest

from cost_models.memory import (activation_bytes, megatron_layer_activation_bytes, model_states, optimizer_step_bytes,
                                state_bytes_per_param, trained_model_states)
from tests.profiles import A, B, H, S, SBH_BYTES, gpt, tp_split

GB = 1e9
# The traced profile also holds what Megatron's count leaves out: the attention's fp32
# log-sum-exp (b·a·s·4 bytes) and the layer norms' mean and rstd (b·s per norm and statistic).
EXTRA_BYTES = B * A * S * 4 + 2 * 2 * B * S * 2


@pytest.mark.parametrize("stage,expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_model_states(stage, expected_gb):
    """ZeRO paper §3 worked example: Ψ = 7.5B, N_d = 64, mixed-precision Adam (K = 12)."""
    states = model_states(7.5e9, "bf16", "adam", stage, 64)
    assert states.total_bytes / GB == pytest.approx(expected_gb, abs=0.05)


@pytest.mark.parametrize("stage,per_param", [(0, lambda n: 18), (1, lambda n: 10 + 12 / n), (2, lambda n: 2 + 16 / n),
                                              (3, lambda n: 16 / n)])
def test_generated_code_states_are_fsdp2s(stage, per_param):
    """What the generated code keeps per parameter and rank under mixed precision, as fake_memory
    measured it (FSDPMemTracker): fp32 parameters and gradients, AdamW's fp32 moments, ZeRO-1's
    fp32 slice copy, and the bf16 copy FSDP gathers for ZeRO-0..2 (ZeRO-3's two layers are a
    buffer of the step): the paper's 16Ψ total only for ZeRO-3."""
    states = trained_model_states(1e9, "bf16", "adam", stage, 8)
    assert states.total_bytes == pytest.approx(1e9 * per_param(8))
    assert states.params_bytes == 1e9 * 4 / (8 if stage >= 2 else 1)  # fp32 master weights


def test_generated_code_states_without_fsdp_and_in_fp32():
    """No FSDP (one data-parallel rank): autocast's bf16 weight copies are saved for backward
    (2Ψ), fp32 needs none; FSDP in fp32 still gathers a copy (measured: 4Ψ on a group of one)."""
    assert trained_model_states(1e9, "bf16", "adam", 0, 1, fsdp=False).total_bytes == 18e9
    assert trained_model_states(1e9, "fp32", "adam", 0, 1, fsdp=False).total_bytes == 16e9
    assert trained_model_states(1e9, "fp32", "adam", 0, 8).total_bytes == 20e9


def test_pipeline_stage_keeps_whole_gradients_and_gathered_copy():
    """Under torch's pipeline schedule FSDP neither reshards after backward nor reduces until the
    step's last micro-batch: a ZeRO-3 stage holds whole fp32 gradients and its bf16 copy
    (measured on a GPT stage with fake_memory: 32.55 MiB gradients for 8.14 MiB of sharded
    parameters on 4 ranks), the optimizer state stays sharded."""
    states = trained_model_states(1e9, "bf16", "adam", 3, 4, pipelined=True)
    assert (states.params_bytes, states.grads_bytes, states.optimizer_bytes, states.compute_copy_bytes) == \
        (1e9, 4e9, 2e9, 2e9)


@pytest.mark.parametrize("optimizer,stage,ranks,per_param", [
    ("adam", 0, 8, 4),            # foreach AdamW's sqrt(v) of every parameter
    ("adam", 2, 8, 4 / 8),        # of the rank's shard under FSDP
    ("adam", 3, 8, 4 / 8),
    ("adam", 1, 8, 4 + 2 * 4 / 8),  # ZeRO-1: the gathered fp32 vector, its slice's gradient and padded copy
    ("adam", 1, 1, 4),            # ZeRO-1 on one rank is plain AdamW
    ("sgd", 0, 8, 0),             # in-place updates
    ("sgd", 1, 8, 4 + 2 * 4 / 8),
])
def test_optimizer_step_transients(optimizer, stage, ranks, per_param):
    """What the step holds beside the states, per parameter on the rank; fake-tensor measurement
    of a ZeRO-1 rank (8 ranks, 102.9M parameters): 490.6 MiB = 5 bytes a parameter."""
    assert optimizer_step_bytes(1e9, optimizer, stage, ranks) == pytest.approx(1e9 * per_param)


def test_bytes_per_parameter_by_precision_and_optimizer():
    assert state_bytes_per_param("fp32", "adam") == (4, 4, 8)        # weights, grads, m and v
    assert state_bytes_per_param("bf16", "adam") == (2, 2, 12)       # + fp32 master weights
    assert state_bytes_per_param("fp16", "sgd") == (2, 2, 8)         # master + momentum
    assert state_bytes_per_param("fp32", "sgd_plain") == (4, 4, 0)
    stage2 = model_states(1e9, "fp32", "adam", 2, 4)
    assert (stage2.params_bytes, stage2.grads_bytes, stage2.optimizer_bytes) == (4e9, 1e9, 2e9)
    with pytest.raises(ValueError, match="Unknown optimizer 'lamb'"):
        state_bytes_per_param("bf16", "lamb")


def test_megatron_formula_values():
    s, b, h, a = 2048, 1, 4096, 32
    assert megatron_layer_activation_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)
    assert megatron_layer_activation_bytes(s, b, h, a, t=8) == s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8))
    assert megatron_layer_activation_bytes(s, b, h, a, t=8, sequence_parallel=True) == \
        s * b * h * (34 + 5 * a * s / h) / 8
    assert megatron_layer_activation_bytes(s, b, h, a, flash=True, dropout=False) == 32 * s * b * h


def block(tp: int):
    """GPT's block 1 under the planner's TP split at degree ``tp``."""
    return tp_split(gpt(), "blocks.1", tp).activations


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (4, False), (2, True), (4, True)])
def test_block_activation_matches_megatron_formula(tp, sp):
    """Megatron's sbh(34 + 5as/h), sbh(10 + 24/t + ...) and sbh(34 + ...)/t with flash attention
    (no 5as/h term) and without dropout (no 2 masks): our GPT's block, within 2%. Under sequence
    parallelism torch keeps the all-gathered inputs of the QKV and first MLP GEMMs whole (2sbh
    each, where Megatron keeps 2sbh/t and gathers again in backward): 4sbh(1 - 1/t) more, as
    measured on the generated code's tensors (autopar.runtime.fake_memory)."""
    expected = megatron_layer_activation_bytes(S, B, H, A, t=tp, sequence_parallel=sp, flash=True, dropout=False)
    if sp:
        expected += 4 * SBH_BYTES * (1 - 1 / tp)
    assert activation_bytes(block(tp), 1.0, tp, sp, 1, "none") == pytest.approx(expected, rel=0.02)


def test_full_recompute_keeps_only_the_layer_input():
    assert activation_bytes(block(1), 1.0, 1, False, 1, "full") == 2 * SBH_BYTES  # Korthikanti: 2sbh
    assert activation_bytes(block(4), 1.0, 4, True, 1, "full") == 2 * SBH_BYTES / 4  # SP splits the input


def test_selective_keeps_the_input_and_every_gemm_and_attention_output():
    """Hand count in sbh (16-bit): input x 2, q/k/v 6, attention output 2 (+ its fp32
    log-sum-exp), out_proj 2, fc_in 8, fc_out 2 = 22; element-wise outputs are recomputed.
    Under TP the column-parallel outputs (q/k/v, attention, fc_in: 16) divide by t, and each
    row-parallel output is kept twice (partial sums and the all-reduced copy)."""
    lse = B * A * S * 4
    assert activation_bytes(block(1), 1.0, 1, False, 1, "selective") == pytest.approx(22 * SBH_BYTES + lse)
    assert activation_bytes(block(2), 1.0, 2, False, 1, "selective") == \
        pytest.approx((16 * SBH_BYTES + lse) / 2 + (2 + 2 * 2 + 2 * 2) * SBH_BYTES)


def test_selective_under_ring_attention_keeps_no_attention_output():
    """Ring attention runs where the checkpoint policy keeps nothing: the hand count above less
    the attention output (2sbh) and its log-sum-exp: 20sbh, and under TP 14sbh / t + 10sbh."""
    assert activation_bytes(block(1), 1.0, 1, False, 1, "selective", keeps_attention=False) == \
        pytest.approx(20 * SBH_BYTES)
    assert activation_bytes(block(2), 1.0, 2, False, 1, "selective", keeps_attention=False) == \
        pytest.approx(14 * SBH_BYTES / 2 + (2 + 2 * 2 + 2 * 2) * SBH_BYTES)


@pytest.mark.parametrize("tp", [2, 4])
def test_selective_under_sequence_parallelism_keeps_whole_collective_outputs(tp):
    """TP+SP, selective: the checkpoint policy keeps collective outputs, so the two all-gathered
    GEMM inputs (2sbh each) and the two row-parallel partial sums (2sbh each) stay whole; the
    column-parallel outputs (16sbh + log-sum-exp), the layer input and the reduce-scattered
    copies (2sbh each) divide by t: sbh(8 + 22/t). fake_memory measured 19sbh for a GPT block at
    t = 2 (GPT-3 175B sizes)."""
    lse = B * A * S * 4
    norm_stats = 2 * 2 * B * S * 4  # the two norms' fp32 mean and rstd, kept whole with their output here
    expected = (16 * SBH_BYTES + lse + 6 * SBH_BYTES) / tp + 8 * SBH_BYTES
    selective = activation_bytes(block(tp), 1.0, tp, True, 1, "selective")
    assert selective == pytest.approx(expected + norm_stats, rel=0.01)
    # ... which is no less than keeping everything sbh(4 + 30/t): the planner must not pick it.
    assert selective >= activation_bytes(block(tp), 1.0, tp, True, 1, "none")


def test_activations_scale_with_micro_batch_and_divide_by_cp():
    acts = block(1)
    base = activation_bytes(acts, 1.0, 1, False, 1, "none")
    assert base == pytest.approx(32 * SBH_BYTES + EXTRA_BYTES)
    assert activation_bytes(acts, 3.0, 1, False, 1, "none") == pytest.approx(3 * base)
    assert activation_bytes(acts, 1.0, 1, False, 4, "none") == pytest.approx(base / 4)
    with pytest.raises(ValueError, match="recompute 'some'"):
        activation_bytes(acts, 1.0, 1, False, 1, "some")

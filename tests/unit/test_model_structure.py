"""cost_models.structure.ModelStructure built from a profile alone (no cluster, no layout): the
FSDP units codegen wraps, the tied head, the norms SP runs on the slice, the attention's sizes,
worked by hand for the GPT example (2 blocks of width 32, 4 heads, 16 tokens, micro-batch 2)."""
from __future__ import annotations

from pathlib import Path

import pytest

from autopar.model_file import load_model_file
from autopar.profile import profile_model
from cost_models.compute import ComputeModel
from cost_models.structure import ModelStructure

GPT = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"
KWARGS = {"layers": 2, "hidden": 32, "heads": 4, "seq_len": 16, "vocab": 64}
BATCH = 2


@pytest.fixture(scope="module")
def structure() -> ModelStructure:
    profile = profile_model(load_model_file(GPT), KWARGS, BATCH)
    return ModelStructure(profile, ComputeModel(profile))


def test_each_block_is_a_unit_and_the_embeddings_the_root(structure):
    names = [layer.name for layer in structure.layers]
    assert names == ["wte", "wpe", "blocks.0", "blocks.1", "ln_f", "lm_head"]
    # lm_head holds no parameter of its own (it reads wte's): it joins no unit.
    assert structure.fsdp_units(names) == ([["blocks.0"], ["blocks.1"], ["ln_f"]], ["wte", "wpe"])
    # A second pipeline stage holding the last block and the final norm: no root left.
    assert structure.fsdp_units(["blocks.1", "ln_f", "lm_head"]) == ([["blocks.1"], ["ln_f"]], [])
    assert structure.fsdp_unit_of("blocks.0") == (("blocks.0",), False)
    assert structure.fsdp_unit_of("wpe") == (("wte", "wpe"), True)
    assert structure.fsdp_unit_of("lm_head") == (("lm_head",), False)


def test_the_head_reads_the_embedding_it_does_not_hold(structure):
    assert structure.tied_layers() == {"lm_head": "wte"}


def test_a_blocks_two_layer_norms_run_on_the_sequence_slice(structure):
    assert sorted(structure.slice_norm_params("blocks.0")) == [
        "blocks.0.ln_1.bias", "blocks.0.ln_1.weight", "blocks.0.ln_2.bias", "blocks.0.ln_2.weight"]


def test_attention_sizes(structure):
    assert structure.heads == 4
    # Scores: batch 2 x 4 heads x 16 queries x 16 keys.
    assert structure.score_elements == BATCH * 4 * 16 * 16
    # Keys and values together are twice the queries (as many heads as the queries).
    for block in ("blocks.0", "blocks.1"):
        q, kv = structure.attention_bytes[structure.compute.kind(block)]
        assert q > 0 and kv == 2 * q
    # Each block: 4 x 32 x 32 attention (qkv and out) + 2 x 4 x 32 x 32 MLP weights, their
    # 3 x 32 + 32 + 4 x 32 + 32 biases and two norms' 4 x 32: 12,704 parameters.
    assert structure.largest_params == 12 * 32 * 32 + 3 * 32 + 32 + 4 * 32 + 32 + 4 * 32


def test_parameter_gradients_do_not_grow_with_the_micro_batch():
    """A wide block over a short sequence (h = 256, 4 tokens, fp32): its backward's largest
    temporaries are the MLP's two 4h x h weight gradients, 1 MiB each at any micro-batch. Scaled
    with the micro-batch as activations are (8 MiB each at 8), they refused plans that fit (a
    530B layer's two weight gradients are 6 GiB; at micro-batch 4 they were priced 25 GiB)."""
    hidden, vocab = 256, 64
    profile = profile_model(load_model_file(GPT), {"layers": 2, "hidden": hidden, "heads": 4, "seq_len": 4,
                                                   "vocab": vocab}, 1)
    wide = ModelStructure(profile, ComputeModel(profile))
    weight_gradient = 4 * hidden * hidden * 4
    block = wide.working_set(wide.layers[wide.layer_index["blocks.0"]])
    assert block.parameter_gradients == (weight_gradient, weight_gradient)
    assert 8 * block.activation_bytes < 2 * weight_gradient
    assert wide.largest_working_set(1) == wide.largest_working_set(8) == 2 * weight_gradient
    assert wide.largest_working_set(8, tp=2) == weight_gradient  # each rank computes its share
    # The head holds no parameter but computes the tied embedding's gradient, V x h.
    head = wide.working_set(wide.layers[wide.layer_index["lm_head"]])
    assert head.parameter_gradients[0] == vocab * hidden * 4

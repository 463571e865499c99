"""A loss computed in fp32 from 16-bit logits (examples/gpt.py `logits_fp32`, as Megatron-LM
computes its cross-entropy) is what the profile prices: autograd keeps the fp32 log-probabilities
for the backward, twice the bytes of 16-bit ones, and the loss's ops move the extra bytes."""
from __future__ import annotations

import torch

from autopar.model_file import build_model, load_model_file
from tests.profiles import EXAMPLES, traced

SHAPE = dict(layers=1, hidden=64, heads=4, seq_len=32, vocab=512)
BATCH = 2


def _lm_head(profile):
    return next(layer for layer in profile.layers if layer.name == "lm_head")


def test_the_model_returns_fp32_logits_from_bf16_weights():
    model = build_model(load_model_file(EXAMPLES / "gpt.py"), dict(SHAPE, logits_fp32=True)).to(torch.bfloat16)
    logits = model(torch.randint(0, SHAPE["vocab"], (BATCH, SHAPE["seq_len"])))
    assert logits.dtype == torch.float32


def test_fp32_logits_double_the_saved_log_probabilities_and_add_their_traffic():
    plain = traced("gpt.py", "bf16", BATCH, **SHAPE)
    fp32 = traced("gpt.py", "bf16", BATCH, **SHAPE, logits_fp32=True)
    logit_values = BATCH * SHAPE["seq_len"] * SHAPE["vocab"]
    # The log-softmax output autograd saves: 4 bytes a value instead of 2 (and the loss's scalars).
    extra = _lm_head(fp32).activation_bytes - _lm_head(plain).activation_bytes
    assert 2 * logit_values <= extra <= 2 * logit_values + 8
    # The cast reads 2 bytes a value and writes 4; the softmax and its backward move fp32 values.
    moved = lambda layer: layer.bytes_forward + layer.bytes_backward  # noqa: E731
    assert moved(_lm_head(fp32)) - moved(_lm_head(plain)) >= 6 * logit_values

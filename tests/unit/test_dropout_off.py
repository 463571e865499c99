"""contract.DropoutOff, what compile's check trains both runs under: every dropout of a forward
(nn.Dropout, F.dropout and its variants, attention's dropout_p, nn.MultiheadAttention's, a
stacked RNN's between its layers) draws nothing while it is active, and draws again once it is
not; other random draws are left alone."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from autopar.sections.contract import DropoutOff


def test_dropout_modules_and_functions_return_their_input():
    x = torch.randn(64, 64)
    dropout = nn.Dropout(0.5).train()
    with DropoutOff():
        assert torch.equal(dropout(x), x)
        assert torch.equal(F.dropout(x, p=0.5, training=True), x)
        assert torch.equal(F.dropout2d(x.view(4, 16, 8, 8), 0.5, True), x.view(4, 16, 8, 8))
        assert torch.equal(F.alpha_dropout(x, 0.5, True), x)
    assert not torch.equal(dropout(x), x)  # on again once the mode is left


def test_attention_dropout_is_off_by_position_or_keyword_and_in_multihead_attention():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    plain = F.scaled_dot_product_attention(q, k, v)
    with DropoutOff():
        assert torch.allclose(F.scaled_dot_product_attention(q, k, v, dropout_p=0.5), plain)
        assert torch.allclose(F.scaled_dot_product_attention(q, k, v, None, 0.5), plain)
    assert not torch.allclose(F.scaled_dot_product_attention(q, k, v, dropout_p=0.5), plain)
    attention = nn.MultiheadAttention(16, 4, dropout=0.5, batch_first=True)
    x = torch.randn(2, 8, 16)
    expected = attention.eval()(x, x, x)[0]
    attention.train()
    with DropoutOff():
        assert torch.allclose(attention(x, x, x)[0], expected)
    assert not torch.allclose(attention(x, x, x)[0], expected)


def test_dropout_between_stacked_recurrent_layers_is_off_padded_or_packed():
    torch.manual_seed(0)
    x = torch.randn(6, 3, 8)
    packed = nn.utils.rnn.pack_padded_sequence(x, [6, 4, 2])
    for layer in (nn.LSTM(8, 8, num_layers=2, dropout=0.5), nn.GRU(8, 8, num_layers=2, dropout=0.5),
                  nn.RNN(8, 8, num_layers=2, dropout=0.5)):
        expected, expected_packed = layer.eval()(x)[0], layer(packed)[0].data
        layer.train()
        with DropoutOff():
            assert torch.allclose(layer(x)[0], expected)
            assert torch.allclose(layer(packed)[0].data, expected_packed)
        assert not torch.allclose(layer(x)[0], expected)


def test_other_random_draws_are_left_as_they_are():
    x = torch.zeros(1000)
    with DropoutOff():
        noise = torch.rand_like(x)
    assert noise.std() > 0.1


def test_the_profile_lists_random_draws_other_than_dropout():
    """What DropoutOff leaves on is what the profile lists as random draws (compile's check then
    runs the plan without comparing it): the noise a block draws, once per op and module; dropout
    (nn.Dropout, attention's dropout_p) is not listed."""
    from pathlib import Path

    from autopar.model_file import load_model_file
    from autopar.profile import profile_model

    model_file = load_model_file(Path(__file__).resolve().parents[1] / "dist" / "models" / "with_dropout.py")
    assert profile_model(model_file, {"p": 0.2}, 2).random_draws == []
    assert profile_model(model_file, {"p": 0.2, "noise": 0.5}, 2).random_draws == \
        ["aten.randn_like in blocks.0", "aten.randn_like in blocks.1"]

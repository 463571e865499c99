"""Dropout priced as eager PyTorch runs it (autopar.trace.fused_dropout): the exported graph's
empty_like -> bernoulli_ -> div_ -> mul chain costs one kernel reading x and writing the output
and a one-byte mask, backward reads that mask at one byte, and autograd keeps one byte per
element for it (hand counts on a bf16 block: N = batch x tokens x 4h elements)."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from autopar.model_file import load_model_file
from autopar.profile import profile_model

HIDDEN, TOKENS, BATCH = 64, 32, 2
N = BATCH * TOKENS * 4 * HIDDEN  # elements of the dropped tensor

MODEL = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from torch import nn


    class Block(nn.Module):
        def __init__(self, hidden, dropout):
            super().__init__()
            self.up = nn.Linear(hidden, 4 * hidden)
            self.down = nn.Linear(4 * hidden, hidden)
            self.dropout = dropout

        def forward(self, x):
            h = self.up(x)
            if self.dropout:
                h = F.dropout(h, self.dropout, self.training)
            return x + self.down(h)


    class Net(nn.Module):
        def __init__(self, hidden, dropout):
            super().__init__()
            self.embed = nn.Embedding(128, hidden)
            self.blocks = nn.ModuleList(Block(hidden, dropout) for _ in range(2))

        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return x


    def build_model(hidden: int = 64, dropout: float = 0.0):
        return Net(hidden, dropout)


    def example_batch(batch_size: int):
        return {"tokens": torch.randint(0, 128, (batch_size, %d))}


    def loss_fn(out, batch):
        return out.float().pow(2).mean()
''' % TOKENS)


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    path = tmp_path_factory.mktemp("dropout") / "dropout_block.py"
    path.write_text(MODEL)
    model = load_model_file(Path(path))
    return {rate: profile_model(model, {"hidden": HIDDEN, "dropout": rate}, BATCH, "bf16") for rate in (0.0, 0.1)}


def _block_ops(profile):
    block = next(layer.name for layer in profile.layers if layer.is_block)
    return block, [op for op in profile.ops if op.layer == block]


def test_the_spelled_out_chain_costs_one_kernel(profiles):
    _, ops = _block_ops(profiles[0.1])
    chain = [op for op in ops if op.target.split(".")[1] in ("empty_like", "bernoulli_", "div_")]
    assert len(chain) == 3 and all(op.op_class == "view" and op.bytes_read == op.bytes_written == 0 for op in chain)
    mask = next(op for op in chain if op.target.startswith("aten.div_."))
    multiplies = [op for op in ops if mask.name in op.inputs]
    forward = [op for op in multiplies if op.phase == "forward"]
    backward = [op for op in multiplies if op.phase == "backward"]
    assert len(forward) == 1 and len(backward) == 1
    assert (forward[0].bytes_read, forward[0].bytes_written) == (2 * N, 2 * N + N)  # x in; output and mask out
    assert (backward[0].bytes_read, backward[0].bytes_written) == (2 * N + N, 2 * N)  # gradient and mask in


def test_autograd_keeps_one_byte_a_dropped_element(profiles):
    """With dropout the down projection keeps the dropped tensor (as it kept up's output
    without) and backward the mask: one byte more per element, not two."""
    block, _ = _block_ops(profiles[0.1])
    assert profiles[0.1].layer(block).activation_bytes - profiles[0.0].layer(block).activation_bytes == N


def test_the_draw_stays_a_random_draw(profiles):
    """Priced free, the draw is still a random draw to the tensor-parallel ILP: it may run on a
    rank's shard only inside a region the generated code seeds per rank (autopar.solver.intra_op)."""
    from autopar.solver.intra_op import draws_random

    _, ops = _block_ops(profiles[0.1])
    assert [draws_random(op) for op in ops].count(True) == 1
    assert draws_random(next(op for op in ops if op.target.startswith("aten.bernoulli_.")))

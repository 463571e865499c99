"""Model structure the way authors write it: which container holds the blocks, and what the
traced step says about splitting the sequence (context parallelism)."""
from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from autopar.model_file import load_model_file
from autopar.profile import profile_model
from autopar.trace.layers import find_block_container

ZOO = Path(__file__).resolve().parents[1] / "zoo" / "models"


def test_nanogpt_blocks_are_found_inside_its_module_dict():
    """nanoGPT keeps its blocks in ``transformer.h`` beside the embeddings in a ModuleDict that
    holds more parameters than the blocks alone; the blocks, not the ModuleDict's members, are
    the layers."""
    profile = profile_model(load_model_file(ZOO / "nanogpt.py"), {"layers": 3}, micro_batch_size=1, precision="fp32")
    assert profile.block_container == "transformer.h"
    assert [layer.name for layer in profile.layers] == [
        "transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1", "transformer.h.2",
        "transformer.ln_f", "lm_head"]
    assert [layer.name for layer in profile.blocks] == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]


def test_a_mixed_container_serves_only_when_no_stack_exists():
    """A Sequential of different layers (an MLP) is the container when nothing repeats."""
    mlp = nn.Module()
    mlp.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert find_block_container(mlp) == "net"
    mlp.stack = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))  # fewer parameters, but uniform
    assert find_block_container(mlp) == "stack"


def test_frozen_parameters_are_traced_without_gradients():
    """A fine-tuning set-up (frozen embedding and first block, a frozen positional table) is
    profiled; the frozen embedding gets no backward op, the trainable blocks do."""
    profile = profile_model(load_model_file(ZOO / "frozen.py"), {}, micro_batch_size=1, precision="fp32")
    real = load_model_file(ZOO / "frozen.py").build_model()
    assert profile.param_count == sum(p.numel() for p in real.parameters())
    backward = [op for op in profile.ops if op.phase == "backward"]
    assert not [op for op in backward if "embedding" in op.target]
    assert any(op.layer == "blocks.1" and "mm" in op.target for op in backward)

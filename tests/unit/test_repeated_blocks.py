"""Tracing a stack's identical blocks once: the profile built from three traced blocks and copies
of the second equals the profile of the whole model traced, field by field; blocks that differ
(in structure, or by a branch on their index) are all traced."""
from __future__ import annotations

from dataclasses import asdict

import pytest
from torch import nn

from autopar.model_file import build_fake, load_model_file
from autopar.model_profile import ModelProfile
from autopar.profile import profile_model
from autopar.trace.layers import find_block_containers
from autopar.trace.repeated_blocks import select_traced_blocks
from tests.conftest import write_model_file
from tests.tiers import tiered
from tests.zoo.harness import MODELS

LLAMA = {"layers": 6, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": 128, "seq_len": 16}
GPT = {"layers": 5, "hidden": 64, "heads": 4, "seq_len": 16, "vocab": 128}


def _both(path, kwargs: dict) -> tuple[ModelProfile, ModelProfile]:
    model_file = load_model_file(path)
    return (profile_model(model_file, kwargs, micro_batch_size=2, precision="fp32"),
            profile_model(model_file, kwargs, micro_batch_size=2, precision="fp32", trace_every_block=True))


def _fields(profile: ModelProfile) -> dict:
    data = asdict(profile)
    for name in ("seconds", "copied_blocks"):
        data.pop(name)
    return data


def _assert_same(copied: ModelProfile, whole: ModelProfile) -> None:
    """Every field equal; the first differing op named, for a readable failure."""
    for ours, theirs in zip(copied.ops, whole.ops):
        assert ours == theirs, f"first differing op: {ours} != {theirs}"
    assert len(copied.ops) == len(whole.ops)
    assert _fields(copied) == _fields(whole)


EXAMPLES = {"llama_hf": LLAMA, "gpt": GPT}  # examples/; the others are zoo models at 5 layers
CASES = tiered(["llama_hf", "gpt", "hf_bloom", "hf_mixtral", "hf_deepseek_v3", "nanogpt", "hf_gpt2", "hf_bert"],
               default={"llama_hf", "gpt", "hf_bloom", "hf_mixtral"})


@pytest.mark.parametrize("name", CASES)
def test_copied_blocks_profile_like_the_whole_model(examples_dir, name):
    """Ops (names, inputs, modules, bytes, FLOPs), layers, activations, stage boundaries, inputs
    and sequence mixers (BLOOM's attention by matmuls) equal a trace of every block, on Llama (HF
    SDPA, grouped KV), our GPT, BLOOM and mixture-of-experts models."""
    if name in EXAMPLES:
        path, kwargs = examples_dir / f"{name}.py", EXAMPLES[name]
    else:
        path, kwargs = MODELS[name].path, {**MODELS[name].kwargs, "layers": 5}
    copied, whole = _both(path, kwargs)
    assert copied.copied_blocks and not whole.copied_blocks
    assert len(copied.blocks) == kwargs["layers"]
    _assert_same(copied, whole)


MODEL = '''
import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, hidden, layer_idx, gated):
        super().__init__()
        self.layer_idx = layer_idx
        self.fc = nn.Linear(hidden, hidden)
        self.gate = nn.Linear(hidden, hidden) if gated else None

    def forward(self, x):
        y = self.fc(x)
        USE_OF_INDEX
        return x + y


class Net(nn.Module):
    def __init__(self, layers, hidden, gated_at):
        super().__init__()
        self.embed = nn.Embedding(32, hidden)
        self.blocks = nn.ModuleList(Block(hidden, i, i == gated_at) for i in range(layers))
        self.head = nn.Linear(hidden, 32)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model(layers=6, hidden=16, gated_at=-1):
    return Net(layers, hidden, gated_at)


def example_batch(batch_size, layers=6, hidden=16, gated_at=-1):
    tokens = torch.randint(0, 32, (batch_size, 9))
    return tokens[:, :-1], tokens[:, 1:]


def model_inputs(batch):
    return (batch[0],), {}


def loss_fn(output, batch):
    return F.cross_entropy(output.flatten(0, 1), batch[1].flatten())
'''
# A branch on the block's index (more work in block 3), or a use that is no branch (a scale).
BRANCHING = MODEL.replace("USE_OF_INDEX", "if self.layer_idx == 3:\n            y = torch.tanh(y) * y")
SCALED = MODEL.replace("USE_OF_INDEX", "y = y / (self.layer_idx + 1)")


def test_a_branch_on_the_block_index_traces_every_block(tmp_path):
    """``if self.layer_idx == 3`` in a block's code: the index attribute counts, every block
    differs, nothing is copied, and the profile counts the extra work of block 3 (a copy of
    block 1 would miss it)."""
    path = write_model_file(tmp_path, BRANCHING)
    copied, whole = _both(path, {})
    assert copied.copied_blocks == []
    _assert_same(copied, whole)
    assert copied.layer("blocks.3").num_ops > copied.layer("blocks.2").num_ops


def test_blocks_that_differ_split_the_runs(tmp_path):
    """A block with an extra submodule (a gate) in the middle of the stack splits it into two
    runs; a run of three is traced whole; the index attribute (not tested by the code) is left
    out of the comparison."""
    path = write_model_file(tmp_path, SCALED)
    build = build_fake(load_model_file(path), {"layers": 9, "gated_at": 3}, 1)
    selection = select_traced_blocks(build.model, find_block_containers(build.model))
    assert [run.blocks for run in selection.runs] == [tuple(f"blocks.{i}" for i in range(4, 9))]
    assert selection.left_out == {"blocks.6", "blocks.7"}
    copied, whole = _both(path, {"layers": 9, "gated_at": 3})
    assert copied.copied_blocks == ["blocks.6", "blocks.7"]
    _assert_same(copied, whole)


def test_narrowed_stack_keeps_names_and_is_restored(tmp_path):
    """While tracing, the stack holds its traced blocks under their own names; afterwards all."""
    from autopar.trace.repeated_blocks import narrowed

    path = write_model_file(tmp_path, SCALED)
    model = build_fake(load_model_file(path), {"layers": 6}, 1).model
    selection = select_traced_blocks(model, ["blocks"])
    with narrowed(model, selection):
        assert [name for name, _ in model.blocks.named_children()] == ["0", "1", "5"]
        assert len(model.blocks) == 3 and isinstance(model.blocks, nn.ModuleList)
    assert len(model.blocks) == 6


def test_profile_output_says_which_blocks_were_copied(examples_dir):
    """`autopar profile` says how many blocks were copied and how to trace them all."""
    from rich.console import Console

    from autopar.report.terminal import print_profile

    copied = profile_model(load_model_file(examples_dir / "gpt.py"), GPT, micro_batch_size=1, precision="fp32")
    console = Console(record=True, width=200)
    print_profile(copied, console)
    assert copied.copied_blocks == ["blocks.2", "blocks.3"]
    text = " ".join(console.export_text().split())
    assert "with 5 blocks, 2 of them copied from an identical traced block" in text
    assert "plan.trace_every_block=true traces every block" in text
    # The planner's progress prints the same words (one count, whichever command shows it).
    assert copied.traced_words() in text

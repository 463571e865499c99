"""A kept profile writes the copied blocks' ops by reference (autopar/kept_ops.py) and reads
back exactly the profile it was given: every op, in order, whatever differs from its source."""
from __future__ import annotations

from dataclasses import replace

import pytest

from autopar import profile_cache
from autopar.kept_ops import fold, unfold
from autopar.model_file import load_model_file
from autopar.model_profile import ModelProfile
from autopar.profile import profile_model
from autopar.serialize import compact_json


@pytest.fixture(scope="module")
def traced(examples_dir) -> ModelProfile:
    """A GPT whose blocks after the first are copies (traced once: repeat_of names the first)."""
    return profile_model(load_model_file(examples_dir / "gpt.py"),
                         {"layers": 6, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 128}, 1, "bf16")


def test_copied_blocks_fold_and_come_back_exactly(traced):
    repeats = {layer.name for layer in traced.layers if layer.repeat_of}
    assert len(repeats) == 5
    kept = fold(traced.ops, traced.layers)
    folded = [entry for entry in kept if isinstance(entry, list)]
    assert len(folded) == sum(op.layer in repeats for op in traced.ops)  # every op of every copy
    assert unfold(kept, traced.layers) == traced.ops


def test_an_op_that_differs_from_its_source_is_kept_whole(traced):
    copy = next(layer.name for layer in traced.layers if layer.repeat_of)
    at = next(i for i, op in enumerate(traced.ops) if op.layer == copy and op.flops)
    ops = list(traced.ops)
    ops[at] = replace(ops[at], flops=ops[at].flops + 1)
    ops[at + 1] = replace(ops[at + 1], inputs=[*ops[at + 1].inputs, "an_input_outside_the_block"])
    kept = fold(ops, traced.layers)
    assert kept[at] == ops[at]  # whole: its flops are not its source's
    assert unfold(kept, traced.layers) == ops


def test_a_repeat_of_a_repeat_is_kept_whole(traced):
    first, second, third = [layer for layer in traced.layers if layer.is_block][:3]
    layers = [replace(layer, repeat_of=second.name) if layer.name == third.name else layer for layer in traced.layers]
    kept = fold(traced.ops, layers)
    assert not any(isinstance(entry, list) and layers[entry[0]].name == third.name for entry in kept)
    assert unfold(kept, layers) == traced.ops


def test_the_kept_file_reads_back_the_profile_and_is_smaller(traced, tmp_path, monkeypatch):
    monkeypatch.setenv(profile_cache.CACHE_VARIABLE, str(tmp_path))
    written = profile_cache.store("0" * 32, traced)
    assert written is not None
    assert profile_cache._read(written) == traced
    assert written.stat().st_size < len(compact_json(traced)) / 2

"""Host time of tensor parallelism: the CPU issuing DTensor modules, which a GPU cannot outrun.

PyTorch issues every kernel from Python, so a step is never faster than its host side. A plain op
costs the host about the GPU's launch overhead (in the roofline already: `cost_models.compute`).
A module that tensor parallelism splits costs far more: its forward and backward go through
DTensor's dispatch (the input's redistribution, sharding propagation for each op, the output made
local again, and their backward), some twenty Python dispatches per module per micro-batch.

Ranks of TP plans measured on an H100 and an H200 with the other ranks' collectives faked
(benchmarks/measured/*_plan_check.jsonl: 0.3-1.1 s of predicted GPU work per step, 1.2-4.4x that
measured) spent 1.6-2.2 ms per DTensor module per micro-batch, forward and backward together,
whatever the module's size (a split module, or a norm run by sequence parallelism on its
slice): their GPUs idled while the host dispatched. Below that the
layer's GPU time stops mattering; above it (large layers, long sequences) the host runs ahead
and costs nothing. `DTENSOR_MODULE_HOST_S` is the median over those runs, refitted and checked
out of sample by tests/unit/test_cost_vs_gpu.py.
"""
from __future__ import annotations

import statistics
from typing import Iterable, Mapping

from autopar.domain.vocabulary import TPStyle

DTENSOR_MODULE_HOST_S = 1.92e-3  # seconds per DTensor module per micro-batch, forward + backward

# Styles whose module runs on DTensors (torch's Colwise/RowwiseParallel and their embedding
# forms, and a per-head norm on the rank's heads, as a sequence-parallel norm on its slice); a
# key/value group computes on plain local tensors.
DTENSOR_STYLES = frozenset({TPStyle.COLWISE.value, TPStyle.ROWWISE.value, TPStyle.VOCAB_PARALLEL.value,
                            TPStyle.HIDDEN_PARALLEL.value, TPStyle.HEAD_NORM.value})
FORWARD_SHARE = 0.5  # forward and backward each dispatch about half (an op and its backward)


def dtensor_modules(styles: Mapping[str, str]) -> int:
    """How many of a layer's modules run on DTensors under their TP styles (sequence
    parallelism's norms are counted by `cost_models.tp_layout.SPParts.norms`)."""
    return sum(str(style) in DTENSOR_STYLES for style in styles.values())


def host_s(modules: int, forward_passes: float = 1.0) -> float:
    """Host seconds of one micro-batch through ``modules`` DTensor modules, forward run
    ``forward_passes`` times (full recomputation runs it twice; selective, a fraction more)."""
    return DTENSOR_MODULE_HOST_S * modules * (FORWARD_SHARE * forward_passes + 1 - FORWARD_SHARE)


def fit_per_module_s(runs: Iterable[tuple[float, float, int]]) -> float:
    """The per-module host time a set of host-bound runs shows: the median over runs of
    (measured seconds - the step's priced optimizer seconds) / DTensor module micro-batches,
    each run given as (measured_s, optimizer_s, module micro-batches)."""
    return statistics.median((measured - optimizer) / count for measured, optimizer, count in runs)

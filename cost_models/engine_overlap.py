"""Megatron-Core's communication overlaps, as its published H100 runs enabled them
(`--tp-comm-overlap`, `--overlap-grad-reduce`, `--overlap-param-gather`; Megatron-LM's README of
2024, Megatron-Core r0.8): a pricing runtime (`train.tp_runtime=megatron_core`) for published runs
of that engine, not one autopar generates or chooses.

- Tensor parallelism with sequence parallelism: TransformerEngine's userbuffers split the
  all-gather before a column-parallel GEMM, and the reduce-scatter after a row-parallel one, into
  one chunk per TP rank, exchanged ring-wise while the GEMM works on the chunk in hand. One chunk
  of each exchange stays exposed; the others run under the GEMM (priced so where the GEMM takes
  longer than the exchange, as at the published runs' sizes), slowing it by the interference
  every overlapped collective costs (`cost_models.collectives.OVERLAP_INTERFERENCE`).
- The distributed optimizer's all-gather of the updated parameters (ZeRO-1) is issued bucket by
  bucket as the next forward reaches each bucket's layers: hidden behind that layer's forward
  like a prefetch.
- The gradient reduction overlapping backward is what autopar's own bucketed exchange prices
  already.
"""
from __future__ import annotations

from cost_models.collectives import OVERLAP_INTERFERENCE, exposed_s

MEGATRON_CORE = "megatron_core"


def tp_comm_exposed_s(comm_s: float, tp: int) -> float:
    """What a layer's TP collectives add when userbuffers overlap them with the GEMMs beside them."""
    hidden = comm_s * (tp - 1) / tp
    return comm_s - hidden + OVERLAP_INTERFERENCE * hidden


def param_gather_exposed_s(gather_s: float, forward_s: float) -> float:
    """What a layer's share of the parameter all-gather adds when the next forward prefetches it."""
    return exposed_s(gather_s, forward_s)

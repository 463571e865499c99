"""Dropout priced as eager PyTorch runs it: one kernel, a one-byte mask.

The exported graph spells ``F.dropout(x, p)`` out: ``empty_like(x)``, ``bernoulli_(1 - p)`` into
it, ``div_(1 - p)``, then ``mul(x, mask)``, the mask kept in x's dtype for backward's
``mul(grad, mask)``. On a GPU, eager PyTorch runs ``native_dropout`` instead: one kernel reads x and
writes the output and a boolean mask, and backward reads the gradient and that mask. Priced as
spelled out, a dropout costs four launches and about three and a half times the bytes (the
allocation priced as a write, the mask written twice and read at x's width): on Megatron-LM's
attention of 2021 (dropout on every a x s x s probability) that overstated a GPT-1.7B step on
A100s by a third.

`fuse_dropouts` rewrites each such chain's ops in place of the trace's: the allocation, the draw
and the division become free views (no launch, no bytes), the forward multiply reads x and writes
the output and the mask, each backward reader of the mask reads it at one byte, and the mask
autograd keeps is counted at one byte per element. The draw keeps its name: the tensor-parallel
ILP still knows it for a random draw (autopar.solver.intra_op.draws_random), split only inside a
region the generated code seeds per rank.
"""
from __future__ import annotations

import math
from dataclasses import replace

from autopar.model_profile import OpProfile

MASK_BYTES_PER_ELEMENT = 1  # native_dropout's mask is torch.bool


def fuse_dropouts(ops: list[OpProfile], saved_by_layer: dict[str, int]) -> list[OpProfile]:
    """``ops`` with every spelled-out dropout priced as one fused kernel; ``saved_by_layer``
    (bytes autograd keeps per layer) is corrected in place for the narrower masks."""
    by_name = {op.name: op for op in ops}
    readers: dict[str, list[str]] = {}
    for op in ops:
        for name in dict.fromkeys(op.inputs):
            readers.setdefault(name, []).append(op.name)
    rewritten: dict[str, OpProfile] = {}
    for draw in ops:
        chain = _chain(draw, by_name, readers)
        if chain is None:
            continue
        allocation, division, multiplies = chain
        elements = math.prod(allocation.output_shapes[0])
        traced_mask = allocation.bytes_written
        mask = elements * MASK_BYTES_PER_ELEMENT
        saved = mask if allocation.saved_for_backward_bytes else 0
        if saved:
            saved_by_layer[allocation.layer] = saved_by_layer.get(allocation.layer, 0) - (traced_mask - mask)
        rewritten[allocation.name] = _free(allocation, output_bytes=mask, saved_for_backward_bytes=saved)
        rewritten[draw.name] = _free(draw)
        rewritten[division.name] = _free(division)
        for op in multiplies:
            if op.phase == "forward":  # reads x, writes the output and the mask
                rewritten[op.name] = replace(op, bytes_read=op.bytes_read - traced_mask,
                                             bytes_written=op.bytes_written + mask)
            else:  # reads the gradient and the one-byte mask
                rewritten[op.name] = replace(op, bytes_read=op.bytes_read - traced_mask + mask)
    return [rewritten.get(op.name, op) for op in ops]


def _chain(draw: OpProfile, by_name: dict[str, OpProfile], readers: dict[str, list[str]]):
    """(allocation, division, multiplies) when ``draw`` is a dropout's ``bernoulli_`` into a fresh
    ``empty_like``, scaled by one in-place division that only multiplies read; else None."""
    if not draw.target.startswith("aten.bernoulli_.") or len(draw.inputs) != 1:
        return None
    allocation = by_name.get(draw.inputs[0])
    if allocation is None or not allocation.target.startswith("aten.empty_like.") or not allocation.output_shapes:
        return None
    if readers.get(allocation.name, []) != [draw.name] or len(readers.get(draw.name, [])) != 1:
        return None
    division = by_name[readers[draw.name][0]]
    if not division.target.startswith("aten.div_."):
        return None
    multiplies = [by_name[name] for name in readers.get(division.name, [])]
    if not multiplies or any(op.target != "aten.mul.Tensor" for op in multiplies):
        return None
    return allocation, division, multiplies


def _free(op: OpProfile, **changes) -> OpProfile:
    """The op as a view: no kernel, no bytes moved."""
    return replace(op, op_class="view", bytes_read=0, bytes_written=0, **changes)

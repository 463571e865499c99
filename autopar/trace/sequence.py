"""Which traced ops mix positions along the sequence, i.e. would compute something else when
context parallelism gives each rank only a shard of every sequence.

Context parallelism (codegen/sections/context_parallel.py) shards every [batch, sequence]
input, feeds the model its tokens' global positions, and replaces
``F.scaled_dot_product_attention`` (causal or full, without another mask) by ring or Ulysses
attention. Everything else runs per rank on the local tokens, which is right for position-wise
ops (linear layers, norms, activations, a loss on already shifted targets) and wrong for any op
whose output at one position reads others:

- attention written out (``softmax(Q K^T)`` over the sequence: eager attention, T5's biased
  attention), which the replacement never sees;
- attention through ``scaled_dot_product_attention`` with a mask other than the causal one;
- a shift along the sequence (a slice or pad that turns S positions into S±1: Hugging Face's
  ``labels=`` shifted inside the model, done per shard, drops a target per rank boundary);
- cumulative ops (cumsum, cumprod, ...) over activations along the sequence;
- convolutions over the sequence (kernels wider than one position);
- ``nn.MultiheadAttention`` (torch.nn's Transformer layers): its attention kernel is called from
  C++, so the Python-level replacement does not reach it.

The analysis reads the ops' shapes on the traced forward: a dimension of the traced sequence
length S is taken for the sequence. A coincidental S-sized dimension can only make it refuse CP
for a model that could have had it (safe), never the reverse for the rules above.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from autopar.trace.capture import BACKWARD, CapturedStep
from autopar.trace.ops import op_name

_SOFTMAX = {"_softmax", "softmax", "_safe_softmax", "_log_softmax", "log_softmax"}
_CUMULATIVE = {"cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"}
_SHIFTS = {"slice", "constant_pad_nd", "pad", "narrow", "roll"}
_SDPA_MASK_ARG = {  # ATen attention ops taking a mask, and the mask's argument index
    "_scaled_dot_product_flash_attention_for_cpu": 6,
    "_scaled_dot_product_efficient_attention": 3,
    "_scaled_dot_product_attention_math": 3,
    "scaled_dot_product_attention": 3,
}


@dataclass(frozen=True)
class SequenceMixer:
    """One op that reads other positions of the sequence."""

    module: str | None  # FQN of the module that ran it ("": the root); None: outside the model (loss_fn)
    op: str
    reason: str

    def describe(self) -> str:
        where = (f"module '{self.module}'" if self.module else
                 "the root module's own forward" if self.module == "" else "the loss (outside the model)")
        return f"{self.reason} ({self.op} in {where})"


def sequence_mixers(captured: CapturedStep, seq_len: int | None,
                    model: torch.nn.Module | None = None) -> list[SequenceMixer]:
    """Forward ops that mix positions along a sequence of ``seq_len`` tokens, one per
    (module, reason) in graph order; empty when the step has no sequence. With ``model``,
    attention inside ``nn.MultiheadAttention`` counts too: it calls the attention kernel from
    C++, past the Python function CP replaces."""
    if not seq_len or seq_len < 2:
        return []
    native = _native_attention_modules(model) if model is not None else set()
    found: dict[tuple[str | None, str], SequenceMixer] = {}
    for node in captured.graph_module.graph.nodes:
        if node.op != "call_function" or captured.node_phase.get(node.name) == BACKWARD:
            continue
        name = op_name(node.target).split(".")[-1]
        if name in ("default", "int", "Tensor", "dim"):
            name = op_name(node.target).split(".")[-2]
        module = captured.node_module.get(node.name)
        # A softmax in the loss (outside the model) is over the vocabulary, never attention: a
        # vocabulary as large as the sequence must not look like S x S scores.
        if module is None and name in _SOFTMAX:
            continue
        reason = _mixing_reason(name, node, seq_len)
        if reason is None and "scaled_dot_product" in name and _inside(module, native):
            reason = "attention inside nn.MultiheadAttention, which context parallelism does not replace"
        if reason:
            found.setdefault((module, reason), SequenceMixer(module, name, reason))
    return list(found.values())


def _mixing_reason(name: str, node: torch.fx.Node, seq_len: int) -> str | None:
    out = _value(node)
    args = [_value(a) if isinstance(a, torch.fx.Node) else a for a in node.args]
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if first is None or not isinstance(out, torch.Tensor):
        return _sdpa_mask_reason(name, args, seq_len) if first is not None else None
    if name in _SOFTMAX:
        dim = _dim(args, 1, first)
        if first.dim() >= 2 and first.shape[dim] == seq_len and first.shape[-2] == seq_len:
            return "attention computed outside scaled_dot_product_attention (a softmax over the sequence)"
    # Integer cumulative ops are position bookkeeping (positions from a padding mask, Hugging
    # Face's packed-sequence check), which CP replaces by feeding the global positions and a
    # full padding mask; a floating-point one accumulates activations (a scan).
    if name in _CUMULATIVE and first.dtype.is_floating_point:
        dim = _dim(args, 1, first)
        if first.shape[dim] == seq_len:
            return "a cumulative op along the sequence"
    if name in _SHIFTS and first.dim() == out.dim():
        for d in range(first.dim()):
            if first.shape[d] == seq_len and out.shape[d] in (seq_len - 1, seq_len + 1):
                return "a shift along the sequence (e.g. labels shifted inside the model)"
        if name == "roll" and seq_len in first.shape:
            return "a shift along the sequence (roll)"
    if name == "convolution" and first.dim() == 3 and first.shape[-1] == seq_len:
        weight = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
        if weight is not None and weight.shape[-1] > 1:
            return "a convolution over the sequence"
    return _sdpa_mask_reason(name, args, seq_len)


def _sdpa_mask_reason(name: str, args: list[Any], seq_len: int) -> str | None:
    index = _SDPA_MASK_ARG.get(name)
    if index is None or len(args) <= index or not isinstance(args[index], torch.Tensor):
        return None
    mask = args[index]
    query, key = args[0], args[1]
    # The one mask CP understands: causal over the local tokens (queries x keys, both S).
    if tuple(mask.shape[-2:]) == (seq_len, seq_len) and query.shape[-2] == key.shape[-2] == seq_len:
        return None
    return "attention with a mask other than the causal one"


def _native_attention_modules(model: torch.nn.Module) -> set[str]:
    return {name for name, module in model.named_modules() if isinstance(module, torch.nn.MultiheadAttention)}


def _inside(module: str | None, names: set[str]) -> bool:
    return module is not None and any(module == n or module.startswith(n + ".") for n in names)


def _dim(args: list[Any], index: int, tensor: torch.Tensor) -> int:
    dim = args[index] if len(args) > index and isinstance(args[index], int) else -1
    return dim % tensor.dim() if tensor.dim() else 0


def _value(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None

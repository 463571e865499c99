"""Losses averaged over the tokens they count: what splitting the batch must weigh by counts.

A language model's cross-entropy is a mean over its label tokens, and a masked LM (labels of
-100 outside the masked tokens, BERT's and ModernBERT's way) or a padded batch counts a
different number of tokens in each sample. A data-parallel rank (or a micro-batch, or a
context-parallel shard of the sequence) that averages over its own tokens weighs each of them
by its part's count, not the batch's: the loss and gradients differ from one process
(0.0005-0.005 on masked LMs). The exact value is the sum over the batch's counted tokens
divided by their global count, what Hugging Face's ``num_items_in_batch`` computes for gradient
accumulation.

ATen computes such a mean in one op, ``nll_loss_forward`` with reduction "mean", which also
returns the count (its ``total_weight``: the targets not equal to ``ignore_index``, weighted by
the class weights if any) and keeps it for backward. The profile finds that op here; the
generated step reads the count from the loss's autograd graph after each micro-batch's forward
(sections/token_loss.py), so no part of the model's or loss's code has to be known or rewritten.
"""
from __future__ import annotations

from autopar.trace.capture import CapturedStep

_MEAN_OVER_TARGETS = {"nll_loss_forward": 3, "nll_loss2d_forward": 3}  # op -> index of `reduction`
_MEAN = 1  # ATen's Reduction::Mean


def token_mean_loss(captured: CapturedStep) -> str | None:
    """The loss's mean over counted targets, described with its module, when the step computes
    exactly one (None: none, or several, whose counts one weight cannot carry)."""
    found = []
    for node, name, reduction in captured.forward_calls_of(_MEAN_OVER_TARGETS):
        if reduction is None:
            reduction = node.kwargs.get("reduction", _MEAN)
        if reduction == _MEAN:
            module = captured.node_module.get(node.name)
            found.append(f"{name} (a mean over the targets not ignored)" + (f" in module '{module}'" if module else ""))
    return found[0] if len(found) == 1 else None

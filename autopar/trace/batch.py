"""Statistics over the batch: what makes any split of it train another model.

Data parallelism, ZeRO and micro-batching each hand a forward a part of the global batch, and
context parallelism a part of every sequence; that is exact for a model whose samples do not
see each other (docs/model_contract.md). Batch normalisation in training mode normalises
each feature by the mean and variance over the batch (and the sequence or the image), so on a
part of it those statistics, and the loss, are the part's: a ResNet under dp=2 trained a loss
0.0783 off at its first step. The planner then keeps the whole batch in every forward: dp = cp =
1 and one micro-batch of the global batch (tensor and pipeline parallelism split the model, not
the batch).

The numerical check at compile finds this too, but only where the cluster is this machine's CPU
ranks; this rule holds wherever the plan is made.
"""
from __future__ import annotations

from autopar.trace.capture import CapturedStep

# ATen's batch-norm ops and the index of their `training` argument.
_BATCH_NORM_TRAINING_ARG = {"native_batch_norm": 5, "_native_batch_norm_legit": 5,
                            "_native_batch_norm_legit_functional": 5, "cudnn_batch_norm": 5,
                            "miopen_batch_norm": 5}


def batch_statistics(captured: CapturedStep) -> str | None:
    """Why a split of the batch would train another model (None: the samples never meet): the
    first forward batch norm in training mode, with its module."""
    for node, name, training in captured.forward_calls_of(_BATCH_NORM_TRAINING_ARG):
        if training is True:
            module = captured.node_module.get(node.name)
            return (f"batch normalisation in training mode ({name} in module '{module}') normalises over the batch, "
                    "so a part of it would be normalised by the part's statistics")
    return None

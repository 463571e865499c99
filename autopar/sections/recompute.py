"""Activation recomputation per layer: full (keep only the layer input) or selective."""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
from torch import nn

from autopar.sections.contract import holds_parameters
# Imported under another name: the generated file also has checkpoint variables (DCP checkpoints).
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts, noop_context_fn
from torch.utils.checkpoint import checkpoint as checkpointed

# Selective recomputation keeps what is expensive to redo (matrix products, attention and the
# tensor-parallel collectives) and recomputes the cheap element-wise work: the split the cost
# model prices (kept = GEMM and attention outputs).
_SAVED_OP_NAMES = (
    "aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm",
    "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
    "_c10d_functional.all_reduce", "_c10d_functional.all_gather_into_tensor",
    "_c10d_functional.reduce_scatter_tensor",
)


def _saved_ops() -> set:
    """The ops above that this torch build has (attention kernels differ between builds)."""
    ops = set()
    for name in _SAVED_OP_NAMES:
        namespace, _, op = name.partition(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None:
            ops.add(packet.default)
    return ops


_SAVED_OPS = _saved_ops()


# Set while code runs whose every op selective recomputation must rerun rather than keep.
_recomputed_regions: list[bool] = []


@contextlib.contextmanager
def never_kept_by_selective() -> Iterator[None]:
    """Ops run inside are recomputed by selective recomputation whatever their kind. Ring
    attention runs in here: its matrix products make fp32 scores quadratic in the sequence,
    which the policy above would keep (a Llama layer at 8192 tokens, cp 2: several GiB each).
    The region runs again in the recomputed forward, so forward and recomputation agree."""
    _recomputed_regions.append(True)
    try:
        yield
    finally:
        _recomputed_regions.pop()


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if _recomputed_regions:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


def apply_recompute(model: nn.Module, recompute: dict[str, str]) -> None:
    """Make each layer the plan recomputes keep only its inputs in forward and run again in backward.

    The layer's own ``forward`` is replaced by one that runs it under torch.utils.checkpoint, so
    the module, its name and its parameters' names stay as they are (a wrapper module would add
    a level to every name) and the hooks TP and FSDP put on the module run outside the
    recomputed region: FSDP gathers the parameters before the layer recomputes.

    Args:
        model: the model or pipeline stage; layers it does not hold are ignored.
        recompute: layer FQN -> "none" | "selective" | "full".
    """
    for name, mode in recompute.items():
        if mode == "none" or not holds_parameters(model, name):
            continue
        if mode not in ("full", "selective"):
            raise ValueError(f"unknown recompute mode {mode!r} for {name}")
        layer = model.get_submodule(name)
        layer.forward = recomputed(layer.forward, selective=mode == "selective")


def recomputed(forward: Callable[..., Any], selective: bool) -> Callable[..., Any]:
    """``forward`` run under non-reentrant activation checkpointing (with the selective policy
    above when ``selective``); same signature, so callers inspecting it see the layer's."""
    context_fn = _selective_context if selective else noop_context_fn

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpointed(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return run

"""Activation recomputation per layer: full (keep only the layer input) or selective."""
from __future__ import annotations

import collections
import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
from torch import nn

from autopar.sections.contract import holds_parameters
# Imported under another name: the generated file also has checkpoint variables (DCP checkpoints).
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts, noop_context_fn
from torch.utils.checkpoint import checkpoint as checkpointed

# Selective recomputation keeps what is expensive to redo (products with a weight, attention and
# the tensor-parallel collectives) and recomputes the rest: element-wise work, norms, and the
# products of two activations (an attention written out: its scores and weighted values), as
# Megatron-LM's selective recomputation reruns the attention core. The planner priced this split.
_SAVED_OP_NAMES = (
    "aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm",
    "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
    "_c10d_functional.all_reduce", "_c10d_functional.all_gather_into_tensor",
    "_c10d_functional.reduce_scatter_tensor",
)
_PRODUCT_OP_NAMES = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm")


def _ops(names: tuple[str, ...]) -> set:
    """The ops named that this torch build has (attention kernels differ between builds)."""
    ops = set()
    for name in names:
        namespace, _, op = name.partition(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None:
            ops.add(packet.default)
    return ops


_SAVED_OPS = _ops(_SAVED_OP_NAMES)
_PRODUCT_OPS = _ops(_PRODUCT_OP_NAMES)

# Autograd nodes that make an activation: products, attention and embedding lookups (what the
# planner does not count as computed from parameters alone).
_ACTIVATION_NODES = ("MmBackward", "AddmmBackward", "BmmBackward", "BaddbmmBackward", "AddbmmBackward", "MvBackward",
                     "AddmvBackward", "DotBackward", "GroupedMmBackward", "ConvolutionBackward", "EmbeddingBackward",
                     "EmbeddingBagBackward", "MkldnnRnnLayerBackward")
# A weight's history is a few casts and views; a longer one is an activation's.
_WEIGHT_HISTORY_NODES = 256


def _is_activation(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is computed from the layer's input rather than from parameters and
    constants alone: its autograd history reaches a product, an attention or an embedding, or a
    leaf that is not a parameter (a layer or stage input). Searched breadth-first, so the nearest
    such node ends the search (the residual stream leads through every earlier layer)."""
    if tensor.grad_fn is None:
        return tensor.requires_grad and not isinstance(tensor, nn.Parameter)
    queue, seen = collections.deque([tensor.grad_fn]), 0
    while queue:
        node = queue.popleft()
        seen += 1
        if seen > _WEIGHT_HISTORY_NODES:
            return True
        name = node.name()
        if name.endswith("AccumulateGrad"):
            if not isinstance(getattr(node, "variable", None), nn.Parameter):
                return True
            continue
        if name.startswith(_ACTIVATION_NODES) or "Attention" in name:
            return True
        queue.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return False


def _multiplies_activations(args: tuple) -> bool:
    """A product of two activations reading no weight: attention scores, weighted values."""
    tensors = [arg for arg in args if isinstance(arg, torch.Tensor)]
    activations = [_is_activation(tensor) for tensor in tensors]
    reads_weight = any(tensor.requires_grad and not activation for tensor, activation in zip(tensors, activations))
    return sum(activations) >= 2 and not reads_weight


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
    if op not in _SAVED_OPS or op in _PRODUCT_OPS and _multiplies_activations(args):
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


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

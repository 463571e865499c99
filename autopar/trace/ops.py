"""What each ATen op costs: its class (for the roofline), its FLOPs and the bytes it moves.

FLOPs come from PyTorch's own formulas (`torch.utils.flop_counter.flop_registry`), so totals
agree with `FlopCounterMode`. `EXTRA_FLOP_FORMULAS` adds the few ops PyTorch has no formula for
but which we meet when tracing on CPU (the CPU flash-attention kernels take the same arguments
as the CUDA ones); pass it as `FlopCounterMode(custom_mapping=...)` to compare like with like.
Ops with no FLOP formula are priced by the bytes they move; the ones whose class we do not know
either are listed in the profile's coverage report, never silently costed as zero.
"""
from __future__ import annotations

import inspect
import math
import operator
from typing import Any, Callable

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop, sdpa_flop, shape_wrapper

from autopar.model_profile import OpClass
from autopar.trace.grouped_mm import grouped_mm_flop

aten = torch.ops.aten


def rnn_layer_flop(input_shape: Any, input_weights: Any, hidden_weights: Any, *args: Any, **kwargs: Any) -> int:
    """FLOPs of one recurrent layer and direction over a sequence (ATen's CPU ``mkldnn_rnn_layer``,
    which ``nn.LSTM``/``GRU``/``RNN`` run as one op): each token multiplies the input by the
    gates' input weights and the previous state by their hidden weights (2 FLOPs a weight), the
    gates' elementwise work left out as small beside it."""
    tokens = math.prod(input_shape[:-1])
    return 2 * tokens * (math.prod(input_weights) + math.prod(hidden_weights))


def rnn_layer_backward_flop(input_shape: Any, input_weights: Any, hidden_weights: Any, *args: Any,
                            **kwargs: Any) -> int:
    """Backward of `rnn_layer_flop`: the inputs' and the weights' gradients, twice the forward."""
    return 2 * rnn_layer_flop(input_shape, input_weights, hidden_weights)


# Shape-level formulas, in the form FlopCounterMode(custom_mapping=...) expects.
EXTRA_FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    aten._grouped_mm: grouped_mm_flop,
    aten.mkldnn_rnn_layer: rnn_layer_flop,
    aten.mkldnn_rnn_layer_backward: rnn_layer_backward_flop,
    aten._scaled_dot_product_flash_attention_for_cpu: inspect.unwrap(sdpa_flop),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: inspect.unwrap(sdpa_backward_flop),
}
FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    **flop_registry, **{op: shape_wrapper(formula) for op, formula in EXTRA_FLOP_FORMULAS.items()}}

_ATTENTION_WORDS = ("attention", "flex_attention")
_NORM_OPS = {
    aten.native_layer_norm, aten.native_layer_norm_backward, aten.native_batch_norm,
    aten.native_batch_norm_backward, aten._native_batch_norm_legit, aten._native_batch_norm_legit_functional,
    aten._native_batch_norm_legit_no_training, aten.native_group_norm, aten.native_group_norm_backward,
    aten._fused_rms_norm, aten._fused_rms_norm_backward, aten._softmax, aten._softmax_backward_data,
    aten._log_softmax, aten._log_softmax_backward_data,
}
_MEMORY_OPS = {
    aten.clone, aten.copy_, aten._to_copy, aten.cat, aten.stack, aten.embedding,
    aten.embedding_dense_backward, aten.index, aten.index_put, aten.index_select, aten.gather,
    aten.scatter, aten.scatter_add, aten.slice_backward, aten.select_backward, aten.constant_pad_nd,
    aten.new_zeros, aten.new_ones, aten.new_empty, aten.zeros, aten.ones, aten.empty, aten.full,
    aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like, aten.arange, aten.scalar_tensor,
    aten.contiguous, aten.repeat, aten.roll, aten.flip, aten.tril, aten.triu, aten.masked_fill,
    aten.fill, aten.split_with_sizes, aten.unbind, aten.nll_loss_forward, aten.nll_loss_backward,
    aten.max_pool2d_with_indices, aten.max_pool2d_with_indices_backward, aten._unsafe_index,
    aten.cumsum, aten.sort, aten.topk, aten.bernoulli, aten.native_dropout,
    aten.native_dropout_backward, aten.lift_fresh_copy, aten.randint, aten.rand, aten.randn,
    aten.avg_pool2d, aten.avg_pool2d_backward, aten._adaptive_avg_pool2d,
    aten._adaptive_avg_pool2d_backward, aten.upsample_nearest2d,
    # selections by value and the CTC loss (autopar/data_dependent.py plans them)
    aten.nonzero, aten.masked_select, aten.masked_scatter, aten.index_add, aten._ctc_loss, aten._ctc_loss_backward,
}
# Losses reduce their (elementwise) input to a scalar: priced as reductions.
_LOSS_OPS = {
    aten.mse_loss, aten.mse_loss_backward, aten.l1_loss, aten.smooth_l1_loss, aten.smooth_l1_loss_backward,
    aten.huber_loss, aten.huber_loss_backward, aten.binary_cross_entropy, aten.binary_cross_entropy_backward,
    aten.binary_cross_entropy_with_logits, aten.nll_loss2d_forward, aten.nll_loss2d_backward,
}
# Reshape-like ops that never copy in the traces we see (the input is always contiguous there),
# and reads of a size or of one value (a value-dependent trace records them): no data moved.
_VIEW_LIKE = {aten._unsafe_view, aten.lift_fresh, aten.sym_size, aten.sym_numel, aten.sym_stride,
              aten.sym_storage_offset, aten._local_scalar_dense}


def packet_of(target: Any) -> Any:
    """The overload packet (e.g. aten.mm) of an OpOverload (aten.mm.default)."""
    return getattr(target, "overloadpacket", target)


def op_name(target: Any) -> str:
    """A stable printable name: 'aten.mm.default', 'getitem'."""
    if target is operator.getitem:
        return "getitem"
    return str(target)


def classify(target: Any) -> OpClass:
    """Which roofline class an fx call_function target belongs to."""
    if target is operator.getitem:
        return OpClass.VIEW
    packet = packet_of(target)
    name = str(packet)
    if any(word in name for word in _ATTENTION_WORDS):
        return OpClass.ATTENTION
    if packet in FLOP_FORMULAS:
        return OpClass.GEMM
    if getattr(target, "is_view", False) or packet in _VIEW_LIKE:
        return OpClass.VIEW
    if packet in _NORM_OPS:
        return OpClass.NORM
    if packet in _MEMORY_OPS:
        return OpClass.MEMORY
    tags = getattr(target, "tags", ())
    if torch.Tag.reduction in tags or packet in _LOSS_OPS:
        return OpClass.REDUCTION
    if torch.Tag.pointwise in tags:
        return OpClass.ELEMENTWISE
    return OpClass.OTHER


def flop_count(target: Any, args: tuple, kwargs: dict, out: Any) -> int | None:
    """FLOPs of one op from its argument and output values (fake tensors); None if no formula."""
    formula = FLOP_FORMULAS.get(packet_of(target))
    if formula is None:
        return None
    return int(formula(*args, **kwargs, out_val=out))


def schema_argument(target: Any, args: Any, kwargs: Any, names: tuple[str, ...]) -> tuple[bool, Any]:
    """(whether the op's schema has an argument named one of ``names``, that argument's value in
    this call: by position, by keyword, or the schema's default)."""
    for index, argument in enumerate(getattr(getattr(target, "_schema", None), "arguments", ())):
        if argument.name in names:
            return True, kwargs.get(argument.name, args[index] if index < len(args) else argument.default_value)
    return False, None


def attention_is_causal(target: Any, args: tuple, kwargs: dict) -> bool:
    """Whether an attention op runs with ``is_causal`` set (forward or backward): a fused kernel
    then skips the key blocks past each query block."""
    found, value = schema_argument(target, args, kwargs, ("is_causal",))
    return found and bool(value)

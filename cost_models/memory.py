"""Memory per rank: model states by ZeRO stage, activations by recomputation and split.

Model states for Ψ parameters on N_d data-parallel ranks (Rajbhandari et al. 2020, ZeRO, §3):
mixed-precision Adam keeps 2Ψ (16-bit weights) + 2Ψ (16-bit gradients) + KΨ with K = 12 (fp32
master weights, momentum, variance); ZeRO-1 divides the K part by N_d, ZeRO-2 also the
gradients, ZeRO-3 everything: (2+2+K)Ψ, 2Ψ+2Ψ+KΨ/N_d, 2Ψ+(2+K)Ψ/N_d, (2+2+K)Ψ/N_d.
fp32 training keeps 4Ψ weights, 4Ψ gradients and K = 8 (momentum, variance); SGD with momentum
has K = 4 (fp32) or 8 (mixed: master + momentum).

Activations come from the profile (bytes autograd saves per layer, which on a GPU matched
CUDA's allocator to 0.01% for our GPT) scaled to the micro-batch, then divided where the
parallel split applies them: tensor parallelism divides the tensors between column- and
row-parallel layers, sequence parallelism divides the rest too, context parallelism divides
everything by cp — the per-layer forms sbh(10 + 24/t) and sbh·34/t of Korthikanti et al. 2022
(Table 2) for Megatron's layer. Full recomputation keeps only the layer input; selective keeps
the GEMM and attention outputs and recomputes the cheap element-wise ops.
"""
from __future__ import annotations

from dataclasses import dataclass

STATE_BYTES_PER_PARAM = {
    # precision -> optimizer -> (weights, gradients, optimizer states K)
    "mixed": {"adam": (2, 2, 12), "sgd": (2, 2, 8)},
    "fp32": {"adam": (4, 4, 8), "sgd": (4, 4, 4)},
}


@dataclass(frozen=True)
class ModelStates:
    """Bytes of weights, gradients and optimizer states on one rank."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


def state_bytes_per_param(precision: str, optimizer: str) -> tuple[int, int, int]:
    kind = "fp32" if precision == "fp32" else "mixed"
    try:
        return STATE_BYTES_PER_PARAM[kind][optimizer]
    except KeyError:
        raise ValueError(f"Unknown optimizer '{optimizer}': use adam or sgd.") from None


def model_states(params: float, precision: str, optimizer: str, zero_stage: int, shard_ranks: int) -> ModelStates:
    """Model states of `params` parameters under a ZeRO stage sharded over `shard_ranks`."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {zero_stage}")
    weights, grads, states = state_bytes_per_param(precision, optimizer)
    n = max(1, shard_ranks)
    return ModelStates(params_bytes=params * weights / (n if zero_stage >= 3 else 1),
                       grads_bytes=params * grads / (n if zero_stage >= 2 else 1),
                       optimizer_bytes=params * states / (n if zero_stage >= 1 else 1))


@dataclass(frozen=True)
class ActivationSplit:
    """How a layer's saved activations divide under one parallel configuration.

    Attributes:
        tp_sharded_fraction: share of the saved bytes living between column- and row-parallel
            layers (divided by tp); the rest is replicated unless sequence parallelism is on.
        keep_fraction_selective: share kept under selective recomputation.
    """

    tp_sharded_fraction: float
    keep_fraction_selective: float


def activation_bytes(layer_bytes: float, input_bytes: float, scale: float, split: ActivationSplit, tp: int,
                     sequence_parallel: bool, cp: int, recompute: str) -> float:
    """Bytes one in-flight micro-batch keeps for one layer.

    Args:
        layer_bytes: the profile's saved bytes for the layer (profiled micro-batch, no split).
        input_bytes: the layer's input (what full recomputation checkpoints).
        scale: micro-batch size / profiled micro-batch size.
        split: the layer's TP sharding and selective-recompute fractions.
    """
    if recompute == "full":
        kept = input_bytes / (tp if sequence_parallel else 1)
    else:
        fraction = split.keep_fraction_selective if recompute == "selective" else 1.0
        saved = layer_bytes * fraction
        if sequence_parallel:
            kept = saved / tp
        else:
            sharded = min(saved, layer_bytes * split.tp_sharded_fraction)
            kept = sharded / tp + (saved - sharded)
    return scale * kept / cp


def megatron_layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                                    flash: bool = False, dropout: bool = True) -> float:
    """Korthikanti et al. 2022, Table 2 (16-bit): sbh(34 + 5as/h) without parallelism,
    sbh(10 + 24/t + 5as/(ht)) with TP, sbh(34 + 5as/h)/t with TP+SP. `flash` drops the 5as/h
    score term (not stored by fused attention); `dropout=False` drops the two sbh masks."""
    base = 34 - (0 if dropout else 2)
    scores = 0 if flash else 5 * a * s / h
    if t == 1:
        return s * b * h * (base + scores)
    if sequence_parallel:
        return s * b * h * (base + scores) / t
    return s * b * h * (10 - (0 if dropout else 2) + 24 / t + scores / t)

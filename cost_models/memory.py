"""Memory per rank: model states by ZeRO stage, activations by recomputation and split.

Model states for Ψ parameters on N_d data-parallel ranks (Rajbhandari et al. 2020, ZeRO, §3):
mixed-precision Adam keeps 2Ψ (16-bit weights) + 2Ψ (16-bit gradients) + KΨ with K = 12 (fp32
master weights, momentum, variance); ZeRO-1 divides the K part by N_d, ZeRO-2 also the
gradients, ZeRO-3 everything: (2+2+K)Ψ, 2Ψ+2Ψ+KΨ/N_d, 2Ψ+(2+K)Ψ/N_d, (2+2+K)Ψ/N_d.
fp32 training keeps 4Ψ weights, 4Ψ gradients and K = 8 (momentum, variance); SGD with momentum
has K = 4 (fp32: momentum) or 8 (mixed: fp32 master + momentum); plain SGD K = 0 / 4.

The generated code keeps its states as FSDP2 does (`trained_model_states`), which measured on
fake tensors differs from the paper's split (autopar.runtime.fake_memory): parameters and
gradients stay fp32 whatever the compute precision (MixedPrecisionPolicy gathers a bf16 copy to
compute with, reduce_dtype fp32), AdamW holds its two fp32 moments (K = 8); FSDP keeps
parameters sharded between uses from ZeRO-2 on (ZeRO-2 does not free the gathered copy between
forward and backward), ZeRO-1's ShardedAdamW also keeps an fp32 copy of the slice it updates.
The gathered compute copy is held from a layer's forward to its backward: the whole stage for
ZeRO-0..2 (FSDP all-gathers into a new buffer even on a shard group of one; without FSDP,
autocast's bf16 copies of the weights are saved for backward), two layers for ZeRO-3. Per
rank, mixed precision: ZeRO-0 18Ψ, ZeRO-1 10Ψ + 12Ψ/N_d, ZeRO-2 2Ψ + 16Ψ/N_d, ZeRO-3 16Ψ/N_d
(+ two layers' copies), against the paper's 16Ψ, 4Ψ + 12Ψ/N_d, 2Ψ + 14Ψ/N_d and 16Ψ/N_d.

Activations come from the profile: the bytes autograd saves for each layer's backward (on a GPU
they matched CUDA's allocator to 0.01% for our GPT, benchmarks/measured/), scaled to the
micro-batch and divided where the parallel split applies: tensors produced by tensor-parallel
(sharded) ops divide by t, the rest (layer norms, residual stream) only under sequence
parallelism; context parallelism divides everything by cp. For Megatron's layer this is
Korthikanti et al. 2022, Table 2: sbh(10 + 24/t + 5as/(ht)) with TP and sbh(34 + 5as/h)/t with
TP+SP (the 5as/h score term is absent with fused/flash attention, and the two sbh dropout masks
without dropout: our GPT saves 32·sbh in 16-bit units).

One difference from Megatron under sequence parallelism: Megatron keeps the sequence-sharded
input of its column-parallel GEMMs and all-gathers it again in backward; torch's (DTensor)
sequence parallelism, which the generated code uses, lets autograd keep the all-gathered input,
whole on every TP rank. Those tensors (the norms' outputs feeding QKV and the MLP's first GEMM:
4sbh of a GPT block) are `saved_full_bytes`, never divided by t: TP+SP keeps sbh(4 + 30/t).
Measured with fake tensors and PyTorch's MemTracker (autopar.runtime.fake_memory).

Recomputation (`LayerActivations`):
  none       everything autograd saves;
  selective  what the generated code's checkpoint policy keeps (autopar/sections/recompute.py,
             torch selective checkpointing): the layer input plus the output of every product
             with a weight and every attention kernel, recomputing the element-wise ops, norms
             and the like, and the products of two activations. With an attention written out
             that drops its a·s² scores and probabilities and reruns its core (Megatron's
             selective recomputation); with flash attention those are never stored. The policy
             also keeps collective outputs: a row-parallel GEMM's partial sums (whole) and their
             reduced copy, and under sequence parallelism the all-gathered GEMM inputs (whole):
             a GPT block keeps sbh(8 + 22/t) under TP+SP (fake_memory measured 19sbh at t = 2).
             Ring attention is plain matrix products whose quadratic fp32 scores the policy would
             keep, so the generated code recomputes it whole (nothing inside it kept);
  full       only the layer input (Korthikanti et al.: 2sbh per layer).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Any, Iterable

from autopar.domain.vocabulary import OPTIMIZERS, RECOMPUTE_OPTIONS, Recompute

FP32_BYTES = 4
STATE_BYTES_PER_PARAM = {
    # precision kind -> optimizer -> (weights, gradients, optimizer states K) bytes per parameter
    "mixed": {"adam": (2, 2, 12), "sgd": (2, 2, 8), "sgd_plain": (2, 2, 4)},
    "fp32": {"adam": (4, 4, 8), "sgd": (4, 4, 4), "sgd_plain": (4, 4, 0)},
}
KEPT_BY_SELECTIVE = ("gemm", "attention")


@dataclass(frozen=True)
class ModelStates:
    """Bytes of weights, gradients and optimizer states on one rank; ``compute_copy_bytes``:
    the parameters gathered in the compute precision, held from forward to backward (a buffer
    in the reported breakdown, counted with the states where the partition adds up memory)."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    compute_copy_bytes: float = 0.0

    @property
    def total_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.compute_copy_bytes


def state_bytes_per_param(precision: str, optimizer: str) -> tuple[int, int, int]:
    """(weights, gradients, optimizer states) bytes per parameter."""
    kind = "fp32" if precision == "fp32" else "mixed"
    try:
        return STATE_BYTES_PER_PARAM[kind][optimizer]
    except KeyError:
        raise ValueError(f"Unknown optimizer '{optimizer}': use one of {', '.join(OPTIMIZERS)}.") from None


def reduced_gradient_bytes(precision: str, grad_reduce_dtype: str) -> int:
    """Bytes per parameter a gradient reduction moves: fp32's when gradients are reduced in fp32
    (fp32 training; the generated module's FSDP2 reduce_dtype and fp32 exchange under mixed
    precision), else the 16-bit gradients as computed (`TrainSpec.grad_reduce_dtype`)."""
    return FP32_BYTES if precision == "fp32" or grad_reduce_dtype == "fp32" else 2


def model_states(params: float, precision: str, optimizer: str, zero_stage: int, shard_ranks: int) -> ModelStates:
    """Model states of `params` parameters under a ZeRO stage sharded over `shard_ranks`."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {zero_stage}")
    weights, grads, states = state_bytes_per_param(precision, optimizer)
    n = max(1, shard_ranks)
    return ModelStates(params_bytes=params * weights / (n if zero_stage >= 3 else 1),
                       grads_bytes=params * grads / (n if zero_stage >= 2 else 1),
                       optimizer_bytes=params * states / (n if zero_stage >= 1 else 1))


def trained_model_states(params: float, precision: str, optimizer: str, zero_stage: int, shard_ranks: int,
                         fsdp: bool = True, pipelined: bool = False) -> ModelStates:
    """Model states of `params` parameters as the generated code keeps them (see the module
    docstring): fp32 weights and gradients, fp32 optimizer state, sharded over `shard_ranks` by
    FSDP from ZeRO-2 on (weights, gradients) and ZeRO-1 on (optimizer state, plus ZeRO-1's fp32
    copy of the updated slice), and the compute-precision copy held from forward to backward.

    Args:
        fsdp: whether FSDP wraps the model (data or context parallelism with FSDP's gradient
            reduction); without it, mixed precision's copy is autocast's bf16 weights.
        pipelined: a pipeline stage (pp > 1): torch's schedule turns FSDP's resharding after
            backward and its gradient reduction off until the step's last micro-batch, so the
            stage keeps its gathered copy and accumulates whole fp32 gradients whatever the
            ZeRO stage (measured: FSDPMemTracker, fake_memory).
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {zero_stage}")
    weights, grads, states = state_bytes_per_param("fp32", optimizer)
    n = max(1, shard_ranks)
    mixed = precision != "fp32"
    held_whole = fsdp and pipelined
    if zero_stage == 3 and not held_whole:
        copy = 0.0  # two layers at a time: a buffer of the step (cost_models.step)
    elif fsdp:
        copy = params * (2 if mixed else 4)
    else:
        copy = params * 2 if mixed else 0.0
    return ModelStates(params_bytes=params * weights / (n if zero_stage >= 2 else 1),
                       grads_bytes=params * grads / (n if zero_stage >= 2 and not held_whole else 1),
                       optimizer_bytes=params * (states + (weights if zero_stage == 1 and n > 1 else 0))
                       / (n if zero_stage >= 1 else 1),
                       compute_copy_bytes=copy)


FOREACH_TEMPORARY = {"adam": 4}  # torch's foreach AdamW: sqrt(v) of every element it updates, fp32


def optimizer_step_bytes(params: float, optimizer: str, zero_stage: int, shard_ranks: int) -> float:
    """What the optimizer step holds beside the model states (without the compute copy, gone
    after backward), for `params` parameters on the rank (after TP), when activations are gone:
    torch's foreach AdamW computes sqrt(v) of all the elements it updates into a new fp32 list
    before dividing by it; ZeRO-1 (the generated ShardedAdamW) keeps its slice's fp32 gradient,
    then pads its updated slice and all-gathers the whole fp32 vector before copying it into the
    parameters, more than its update's list. Measured with fake tensors on a ZeRO-1 rank: the
    gathered vector and two slices, 490.6 MiB for 102.9M parameters on 8 ranks. With small
    activations (full recomputation, a short micro-batch) this moment, not backward, is the
    rank's peak."""
    n = max(1, shard_ranks)
    updated = params / n if zero_stage >= 1 else params
    update = FOREACH_TEMPORARY.get(optimizer, 0) * updated
    if zero_stage == 1 and n > 1:
        return 4 * updated + max(update, 4 * params + 4 * updated)
    return update


@dataclass(frozen=True)
class LayerActivations:
    """Bytes one micro-batch keeps for a layer at the profiled micro-batch size, split by what
    tensor parallelism shards.

    Attributes:
        saved_sharded_bytes: saved tensors produced by TP-sharded ops (÷ t).
        saved_replicated_bytes: the other saved tensors (÷ t only under sequence parallelism).
        selective_sharded_bytes, selective_replicated_bytes: the same under selective recompute.
        input_bytes: the layer input, all that full recomputation keeps (replicated).
        saved_full_bytes: saved tensors every TP rank holds whole even under sequence
            parallelism: the inputs of column-parallel GEMMs (all-gathered under SP).
        selective_full_bytes: kept whole under selective recompute with TP: row-parallel GEMMs'
            partial sums.
        selective_gathered_bytes: kept whole under selective recompute with TP+SP: the
            all-gathered inputs of column-parallel GEMMs (collective outputs).
        selective_attention_sharded_bytes, selective_attention_replicated_bytes: the attention
            outputs among the selective bytes, which ring attention does not keep (the generated
            code recomputes it whole).
        unwrapped_sharded_bytes, unwrapped_replicated_bytes: saved by the layer's ops that run
            outside its module (the loss a model file computes on the head's logits): no
            recomputation wrapper covers them, so every option keeps them (part of the saved
            totals above). On an H100, a 1B Llama recomputing every layer at micro-batch 8 kept
            its fp32 log-softmax (2.1 GB) that full recomputation was priced without.
    """

    saved_sharded_bytes: float
    saved_replicated_bytes: float
    selective_sharded_bytes: float
    selective_replicated_bytes: float
    input_bytes: float
    saved_full_bytes: float = 0.0
    selective_full_bytes: float = 0.0
    selective_gathered_bytes: float = 0.0
    unwrapped_sharded_bytes: float = 0.0
    unwrapped_replicated_bytes: float = 0.0
    selective_attention_sharded_bytes: float = 0.0
    selective_attention_replicated_bytes: float = 0.0

    def unwrapped_bytes(self, tp: int, replicated_divisor: int) -> float:
        return self.unwrapped_sharded_bytes / tp + self.unwrapped_replicated_bytes / replicated_divisor

    @property
    def saved_bytes(self) -> float:
        return self.saved_sharded_bytes + self.saved_replicated_bytes + self.saved_full_bytes


def layer_activations(layer: Any, forward_ops: Iterable[Any], sharded_outputs: AbstractSet[str] = frozenset(),
                      row_parallel: AbstractSet[str] = frozenset(), tp: int = 1,
                      gathered: AbstractSet[str] = frozenset(),
                      rerun_products: AbstractSet[str] = frozenset()) -> LayerActivations:
    """Account a layer's activations from its forward ops.

    Args:
        layer: the LayerProfile (activation_bytes, input_bytes).
        forward_ops: the layer's forward OpProfiles.
        sharded_outputs: names of ops whose outputs TP shards.
        row_parallel: names of row-parallel GEMMs: under TP they keep their partial output and
            the all-reduced copy (the checkpoint policy saves collective outputs too).
        tp: the TP degree (row-parallel doubling applies only when tp > 1).
        gathered: names of ops whose (replicated) output a column-parallel GEMM reads: under
            sequence parallelism that input is all-gathered and kept whole.
        rerun_products: products selective recomputation runs again rather than keeps
            (`cost_models.weights.selective_reruns`: products of two activations).
    """
    ops = list(forward_ops)
    total = float(layer.activation_bytes)
    sharded = min(float(sum(op.saved_for_backward_bytes for op in ops if op.name in sharded_outputs)), total)
    full = float(sum(op.saved_for_backward_bytes for op in ops
                     if op.name in gathered and op.name not in sharded_outputs))
    full = min(full, total - sharded) if tp > 1 else 0.0
    unwrapped = [op for op in ops if not runs_inside(op.module, layer.name)]
    unwrapped_sharded = float(sum(op.saved_for_backward_bytes for op in unwrapped if op.name in sharded_outputs))
    unwrapped_replicated = float(sum(op.saved_for_backward_bytes for op in unwrapped)) - unwrapped_sharded
    kept_sharded = kept_replicated = kept_full = kept_gathered = attention_sharded = attention_replicated = 0.0
    for op in ops:
        if tp > 1 and op.name in gathered and op.name not in sharded_outputs:
            kept_gathered += op.output_bytes
        if (op.op_class not in KEPT_BY_SELECTIVE or op.name in rerun_products
                or not runs_inside(op.module, layer.name)):
            continue
        if op.op_class == "attention":
            if op.name in sharded_outputs:
                attention_sharded += op.output_bytes
            else:
                attention_replicated += op.output_bytes
        if op.name in sharded_outputs:
            kept_sharded += op.output_bytes
        elif tp > 1 and op.name in row_parallel:
            kept_full += op.output_bytes  # the partial sums, whole on every rank
            kept_replicated += op.output_bytes  # the reduced copy (reduce-scattered under SP)
        else:
            kept_replicated += op.output_bytes
    kept_replicated += layer.input_bytes if total else 0.0
    kept = kept_sharded + kept_replicated + kept_full + kept_gathered
    if tp == 1 and kept > total > 0:  # never more than keeping everything (TP adds collective outputs)
        shrink = total / kept
        kept_sharded, kept_replicated, kept_full, kept_gathered, attention_sharded, attention_replicated = (
            kept_sharded * shrink, kept_replicated * shrink, kept_full * shrink, kept_gathered * shrink,
            attention_sharded * shrink, attention_replicated * shrink)
    return LayerActivations(saved_sharded_bytes=sharded, saved_replicated_bytes=total - sharded - full,
                            selective_sharded_bytes=kept_sharded, selective_replicated_bytes=kept_replicated,
                            input_bytes=float(layer.input_bytes) if total else 0.0, saved_full_bytes=full,
                            selective_full_bytes=kept_full, selective_gathered_bytes=kept_gathered,
                            unwrapped_sharded_bytes=unwrapped_sharded, unwrapped_replicated_bytes=unwrapped_replicated,
                            selective_attention_sharded_bytes=attention_sharded,
                            selective_attention_replicated_bytes=attention_replicated)


def runs_inside(module: str | None, layer: str) -> bool:
    """Whether an op ran inside the layer's module (what its recomputation wrapper reruns)."""
    return module is not None and (module == layer or module.startswith(layer + "."))


def activations_from_fraction(layer: Any, base: LayerActivations, sharded_fraction: float) -> LayerActivations:
    """A split given only as the share of saved bytes TP shards (splitters without per-op detail)."""
    total, kept = base.saved_bytes, base.selective_sharded_bytes + base.selective_replicated_bytes
    return LayerActivations(saved_sharded_bytes=total * sharded_fraction,
                            saved_replicated_bytes=total * (1 - sharded_fraction),
                            selective_sharded_bytes=kept * sharded_fraction,
                            selective_replicated_bytes=kept * (1 - sharded_fraction), input_bytes=base.input_bytes,
                            unwrapped_replicated_bytes=base.unwrapped_sharded_bytes + base.unwrapped_replicated_bytes)


def activation_bytes(acts: LayerActivations, scale: float, tp: int, sequence_parallel: bool, cp: int,
                     recompute: str, keeps_attention: bool = True) -> float:
    """Bytes one in-flight micro-batch keeps for one layer on one rank.

    Args:
        acts: the layer's activations at the profiled micro-batch.
        scale: micro-batch size / profiled micro-batch size.
        tp, cp: tensor- and context-parallel degrees.
        sequence_parallel: the replicated part is split along the sequence over the TP group.
        recompute: "none", "selective" or "full".
        keeps_attention: selective recomputation keeps attention's output (False under ring
            attention, which it recomputes whole).
    """
    replicated_divisor = tp if sequence_parallel else 1
    saved = acts.saved_sharded_bytes / tp + acts.saved_replicated_bytes / replicated_divisor + acts.saved_full_bytes
    unwrapped = acts.unwrapped_bytes(tp, replicated_divisor)
    if recompute == Recompute.FULL:  # a layer that saves less than its input is better left alone
        kept = min(saved, acts.input_bytes / replicated_divisor + unwrapped)
    elif recompute == Recompute.SELECTIVE:
        # What the checkpoint policy saves, even where that is more than the layer saves without
        # recomputation (under TP+SP it keeps whole collective outputs: sbh(8 + 22/t) against
        # sbh(4 + 30/t) for a GPT block, more from t = 2 on): the generated code wraps the layer anyway.
        gathered = acts.selective_gathered_bytes if sequence_parallel and tp > 1 else 0.0
        kept = (acts.selective_sharded_bytes / tp + acts.selective_replicated_bytes / replicated_divisor
                + acts.selective_full_bytes + gathered + unwrapped)
        if not keeps_attention:
            kept -= (acts.selective_attention_sharded_bytes / tp
                     + acts.selective_attention_replicated_bytes / replicated_divisor)
        if tp == 1:
            kept = min(saved, kept)
    elif recompute == Recompute.NONE:
        kept = saved
    else:
        raise ValueError(f"recompute '{recompute}' is not one of {', '.join(RECOMPUTE_OPTIONS)}")
    return scale * kept / cp


def ring_attention_extra_bytes(query_bytes: float, key_value_bytes: float, cp: int, element_bytes: float) -> float:
    """What ring attention (the generated `context_parallel.ring_attention`) keeps for backward
    beyond what the profiled attention kept, for a rank's queries and keys + values of
    `query_bytes` and `key_value_bytes` in the model's dtype (`element_bytes` an element).

    It runs in fp32: it keeps its queries, each of its cp K/V blocks (K and V expanded to the
    queries' heads: two query-sized tensors) and the outputs its cp - 1 merges multiply (two a
    merge), (4cp - 1) fp32 query-sized tensors; it keeps none of the model-dtype queries, keys,
    values and output the profiled attention kept (its log-sum-exps, 1% of that, left out)."""
    fp32_query = query_bytes * FP32_BYTES / element_bytes
    return (4 * cp - 1) * fp32_query - (2 * query_bytes + key_value_bytes)


def megatron_layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                                    flash: bool = False, dropout: bool = True) -> float:
    """Korthikanti et al. 2022, Table 2 (16-bit): sbh(34 + 5as/h) without parallelism,
    sbh(10 + 24/t + 5as/(ht)) with TP, sbh(34 + 5as/h)/t with TP+SP. `flash` drops the 5as/h
    score term (not stored by fused attention); `dropout=False` drops the two sbh masks (both
    in the replicated part)."""
    masks = 0 if dropout else 2
    scores = 0 if flash else 5 * a * s / h
    if t == 1:
        return s * b * h * (34 - masks + scores)
    if sequence_parallel:
        return s * b * h * (34 - masks + scores) / t
    return s * b * h * (10 - masks + 24 / t + scores / t)

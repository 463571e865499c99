"""Which of a profile's tensors come from parameters alone, and which products read no weight.

A weight's transpose or cast, a position table or a mask is computed from graph inputs alone
(parameters, buffers, the batch) without a product: the tensor-parallel ILP shards such tensors
with their parameter or treats them as constants, never as activations. A product (GEMM), an
attention or an embedding lookup makes an activation.

A product reading two activations and no weight (an attention written out: its scores and its
weighted values) is what selective recomputation reruns rather than keeps, as Megatron-LM's
reruns its attention core. The generated code's checkpoint policy makes the same decision at run
time from autograd history (autopar/sections/recompute.py), and the cost model prices it from
`activation_products`. torchtitan's op-level policy, which its published runs and the plans
autopar writes for it run, keeps matrix products (`aten.mm`) but every second one of a layer,
counted in forward order, and reruns every other product (`selective_reruns`).
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autopar.model_profile import ModelProfile, OpProfile


def parameter_sources(profile: "ModelProfile") -> tuple[set[str], dict[str, frozenset[str]]]:
    """The tensors computed from graph inputs alone (`parameter_derived`), and those of them a
    parameter flows into -> the parameters' FQNs (xIELU's ``softplus(self.alpha_p)``,
    DiffLlama's ``lambda_full``)."""
    sources: dict[str, frozenset[str]] = {name: frozenset([role.removeprefix("param:")])
                                          for name, role in profile.placeholders.items() if role.startswith("param:")}
    derived = set(profile.placeholders)
    for op in profile.ops:
        if (op.phase == "forward" and op.op_class not in ("gemm", "attention") and "embedding" not in op.target
                and all(name in derived for name in op.inputs)):
            derived.add(op.name)
            found = frozenset().union(*(sources.get(name, frozenset()) for name in op.inputs))
            if found:
                sources[op.name] = found
    return derived, sources


def parameter_derived(profile: "ModelProfile") -> set[str]:
    """Graph inputs, and forward ops computed from them alone without creating activations
    (weight transposes and casts, position ids, masks, rotary tables): they are sharded with
    their parameter or are cheap constants, never resharded as activations."""
    return parameter_sources(profile)[0]


def multiplies_activations(op: "OpProfile", derived: set[str], trainable: dict[str, frozenset[str]]) -> bool:
    """Whether ``op`` is a product of two activations that reads no weight (a causal mask added
    by the same ``baddbmm`` is a constant, not a weight)."""
    return (op.op_class == "gemm" and not any(name in trainable for name in op.inputs)
            and sum(name not in derived for name in op.inputs) >= 2)


def activation_products(profile: "ModelProfile",
                        sources: tuple[set[str], dict[str, frozenset[str]]] | None = None) -> frozenset[str]:
    """Names of the forward products of two activations that read no weight; ``sources``:
    `parameter_sources(profile)` where the caller has it."""
    derived, trainable = sources or parameter_sources(profile)
    return frozenset(op.name for op in profile.ops
                     if op.phase == "forward" and multiplies_activations(op, derived, trainable))


def selective_reruns(profile: "ModelProfile", runtime: str = "autopar",
                     sources: tuple[set[str], dict[str, frozenset[str]]] | None = None) -> frozenset[str]:
    """Names of the forward products selective recomputation reruns under ``runtime``
    (`autopar.domain.layout.TrainSpec.selective_runtime`)."""
    if runtime == "autopar":
        return activation_products(profile, sources)
    if runtime != "torchtitan_op":
        raise ValueError(f"unknown selective runtime {runtime!r}")
    counted: Counter = Counter()
    reruns = set()
    for op in profile.ops:
        if op.phase != "forward" or op.op_class != "gemm":
            continue
        if op.target == "aten.mm.default":
            counted[op.layer] += 1
            if counted[op.layer] % 2:  # the first, third, ... of the layer are kept
                continue
        reruns.add(op.name)
    return frozenset(reruns)

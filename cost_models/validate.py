"""Checks of a layout against a model and a cluster before it is priced: the training settings,
the degrees and batch arithmetic, and every technique's preconditions, each refused as a clear
ValueError naming the values that can run.

The plan's own structure is judged by autopar.domain.rules (the same rules a plan file read back,
code generation and the planner's pins ask); what a technique needs, by its registry entry
(autopar.domain.techniques).
"""
from __future__ import annotations

from typing import Any

from autopar.domain import rules
from autopar.domain.layout import ParallelLayout, TrainSpec
from autopar.domain.vocabulary import AXES, OPTIMIZERS, PRECISIONS, RECOMPUTE_OPTIONS, RUNTIME_CHOICES, unknown_choices
from cost_models.topology import ClusterSpec


def validate_train(train: TrainSpec, profile: Any) -> None:
    """Clear errors for training settings the cost model cannot price."""
    unknown = unknown_choices(train, {"precision": PRECISIONS, "optimizer": OPTIMIZERS, **RUNTIME_CHOICES})
    if unknown:
        raise ValueError(unknown[0])
    if train.global_batch_size < 1:
        raise ValueError(f"global batch size must be at least 1, got {train.global_batch_size}")
    if train.moe_imbalance < 1:
        raise ValueError(f"moe_imbalance is the busiest expert's tokens over the mean, at least 1; got "
                         f"{train.moe_imbalance}")
    if (train.precision == "fp32") != (profile.precision == "fp32"):
        raise ValueError(f"the profile was traced in {profile.precision} but training is {train.precision}: "
                         "profile the model in the training precision (bytes moved and saved differ)")


def validate(layout: ParallelLayout, model: Any, cluster: ClusterSpec, train: TrainSpec, heads: int | None = None,
             recompute_options: tuple[str, ...] = RECOMPUTE_OPTIONS) -> None:
    """The one check of a layout against a model (a ModelProfile: its layers, sequence length,
    precision) and a cluster, before pricing: the training settings, the degrees and batch
    arithmetic, and every technique's preconditions from its registry entry. `Plan.problems`
    checks a plan file's own consistency and codegen what the model file must offer; both ask
    the same registry.

    Raises:
        ValueError: what cannot run, with the values that can.
    """
    validate_train(train, model)
    experts = ep_blocker = dropless = width = None
    if layout.ep > 1 or getattr(layout, "expert_tp", False):
        from cost_models.expert_parallel import ExpertFacts

        facts = ExpertFacts.of(model)
        experts, ep_blocker, dropless = facts.common_divisor(), facts.ep_blocker, facts.dropless
        width = facts.common_width()
    validate_layout(layout, cluster, train, [layer.name for layer in model.layers], model.tokens_per_sample, heads,
                    recompute_options, experts, ep_blocker, dropless, width)


def validate_layout(layout: ParallelLayout, cluster: ClusterSpec, train: TrainSpec, layer_names: list[str] | int,
                    tokens_per_sample: int | None = None, heads: int | None = None,
                    recompute_options: tuple[str, ...] = RECOMPUTE_OPTIONS, experts: int | None = None,
                    ep_blocker: str | None = None, dropless_experts: bool | None = None,
                    expert_width: int | None = None) -> None:
    """Clear errors for layouts that cannot run, before pricing them (`experts`: the number every
    MoE layer's experts divide into, 0 for a model without experts, None: not checked;
    `ep_blocker`: why the generated exchange cannot wrap the experts, None: it can;
    `dropless_experts`: every MoE layer exchanged dropless; `expert_width`: what every MoE
    layer's experts' width divides into, 0: it cannot be split)."""
    names = None if isinstance(layer_names, int) else list(layer_names)
    num_layers = layer_names if isinstance(layer_names, int) else len(layer_names)
    for axis in AXES:
        if not isinstance(layout.degree(axis), int) or layout.degree(axis) < 1:
            raise ValueError(f"{axis} must be a positive integer, got {layout.degree(axis)!r}")
    if not isinstance(layout.ep, int) or layout.ep < 1:
        raise ValueError(f"ep must be a positive integer, got {layout.ep!r}")
    _raise_first(rules.ep_carving(layout.ep, layout.dp, layout.cp), rules.mesh_axes(layout.mesh_order))
    if layout.world_size != cluster.world_size:
        raise ValueError(f"dp×tp×pp×cp = {layout.dp}×{layout.tp}×{layout.pp}×{layout.cp} = {layout.world_size}, "
                         f"but the cluster has {cluster.world_size} GPUs")
    if layout.micro_batch_size < 1 or layout.num_micro_batches < 1:
        raise ValueError("micro_batch_size and num_micro_batches must be at least 1")
    _raise_first(rules.batch_split(layout.dp, layout.micro_batch_size, layout.num_micro_batches,
                                   train.global_batch_size),
                 rules.uneven_shares(layout.dp_shares, layout.dp, layout.micro_batch_size, layout.pp))
    if layout.chunks < 1:
        raise ValueError(f"chunks must be at least 1, got {layout.chunks}")
    if layout.pp * layout.chunks > num_layers:
        raise ValueError(f"{num_layers} layers cannot fill pp {layout.pp} × chunks {layout.chunks} stages")
    # Each technique's own conditions, from its registry entry (unknown or runtime-less values
    # are refused there with the values that can be chosen).
    from autopar.domain.techniques import LayoutFacts, problems

    found = problems(layout, LayoutFacts(heads=heads, tokens_per_sample=tokens_per_sample, experts=experts,
                                         ep_blocker=ep_blocker, dropless_experts=dropless_experts,
                                         expert_width=expert_width))
    if found:
        raise ValueError(found[0])
    _raise_first(rules.recompute_choices(layout.recompute, names, options=recompute_options))
    if layout.stages and names is not None:
        _raise_first(rules.stage_count(layout.stages, layout.pp, layout.chunks),
                     rules.stage_partition(layout.stages, names))


def _raise_first(*found: rules.Problem | None) -> None:
    """The pricer's way of refusing: the first rule broken, as a ValueError."""
    for problem in found:
        if problem:
            raise ValueError(problem.problem)

"""Expert parallelism's facts and prices: which layers hold experts, and what sharding them
over `ep` ranks costs.

Expert parallelism is carved from the data-parallel ranks, as Megatron-Core's expert-data-
parallel groups are: `ep` consecutive data-parallel ranks form an expert-parallel group that
holds one copy of every expert, each rank E / ep of them; the rest of the model sees dp
unchanged. Expert weights are therefore replicated over dp / ep ranks (the expert-data-parallel
group), which is what ZeRO shards their states over and what their gradients are summed over.

A layer holds experts when one of its parameters is stacked by expert: a name with an
`experts` component and at least three dimensions ([E, ...]); E is its first dimension. Top-k
is read off the layer's traced `topk` op (its output's last dimension). Sharding them needs
more: the generated exchange (codegen/sections/expert_parallel.py) treats an experts module's
one input as its tokens grouped by expert, so a model whose experts module routes inside its own
forward (Hugging Face's `forward(hidden_states, top_k_index, top_k_weights)`) has an
`ep_blocker` and is planned with ep=1 only: nothing generated would run it.

Per MoE layer and micro-batch (tokens T = b·s / cp on a rank, token bytes h·dtype, k experts
per token), with pace p (the most-loaded rank's share of the mean, `routing_pace`):
    dispatch and combine = 2 all-to-alls of p·T·k·h·dtype bytes in forward, 2 in backward
    (and 2 again in a recomputed forward), priced by `collectives.all_to_all_s` over the
    expert-parallel group: the off-node share leaves through the NIC;
    expert compute x p (the ranks wait for the most-loaded one);
    a dispatch buffer of 2·p·T·k·h·dtype (received tokens and their outputs, one layer at a
    time).
Model states: E / ep experts per rank, their optimizer states (ZeRO) sharded over the
expert-data-parallel group.

    facts = ExpertFacts.of(profile)
    facts.experts_of("blocks.0"), facts.common_divisor()
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autopar.profile import ModelProfile

# The traced op whose output's last dimension is the number of experts each token visits.
TOPK_TARGETS = ("aten.topk.default", "aten.topk")


@dataclass(frozen=True)
class MoELayer:
    """One layer kind with experts.

    Attributes:
        experts: experts per layer (E, the stacked parameters' first dimension).
        top_k: experts each token is sent to.
        expert_params: parameters of the stacked experts (all E).
        expert_forward_share, expert_backward_share: the experts' share of the layer's traced
            forward / backward FLOPs (0 when the profile has no per-op detail).
        token_bytes: bytes of one token's hidden state entering the layer (what is dispatched).
        tokens: tokens of the profiled micro-batch.
    """

    experts: int
    top_k: int
    expert_params: int
    expert_forward_share: float
    expert_backward_share: float
    token_bytes: float
    tokens: int


@dataclass(frozen=True)
class ExpertFacts:
    """The layers with experts, by layer name, and why expert parallelism cannot shard them
    (None: it can)."""

    layers: dict[str, MoELayer] = field(default_factory=dict)
    ep_blocker: str | None = None

    @classmethod
    def of(cls, profile: "ModelProfile") -> "ExpertFacts":
        tokens = profile.micro_batch_size * (profile.tokens_per_sample or 1)
        ops_by_layer: dict[str, list[Any]] = {}
        for op in profile.ops:
            ops_by_layer.setdefault(op.layer, []).append(op)
        layers = {}
        for layer in profile.layers:
            stacked = [name for name in layer.param_names if is_expert_param(name, profile.param_shapes.get(name, []))]
            if not stacked:
                continue
            experts = min(profile.param_shapes[name][0] for name in stacked)
            ops = ops_by_layer.get(layer.name, [])
            top_k = next((op.output_shapes[0][-1] for op in ops if op.target in TOPK_TARGETS and op.phase == "forward"
                          and op.output_shapes and op.output_shapes[0]), 1)
            modules = {name.rsplit(".", 1)[0] for name in stacked}
            layers[layer.name] = MoELayer(
                experts=int(experts), top_k=int(top_k),
                expert_params=sum(math.prod(profile.param_shapes[name]) for name in stacked),
                expert_forward_share=_flop_share(ops, modules, "forward", layer.flops_forward),
                expert_backward_share=_flop_share(ops, modules, "backward", layer.flops_backward),
                token_bytes=layer.input_bytes / max(1, tokens), tokens=tokens)
        return cls(layers, ep_blocker(getattr(profile, "experts_inputs", {})) if layers else None)

    def experts_of(self, layer_name: str) -> MoELayer | None:
        return self.layers.get(layer_name)

    @property
    def has_experts(self) -> bool:
        return bool(self.layers)

    def common_divisor(self) -> int:
        """The largest ep every MoE layer's experts divide into (0 without experts)."""
        return math.gcd(*(layer.experts for layer in self.layers.values())) if self.layers else 0


def is_expert_param(name: str, shape: list[int]) -> bool:
    """A parameter stacked by expert: an `experts` component in its name and [E, ...] with E
    leading a matrix per expert."""
    return "experts" in name.split(".") and len(shape) >= 3


def ep_blocker(experts_inputs: dict[str, list[str]]) -> str | None:
    """Why the generated all-to-alls cannot wrap these experts modules (FQN -> their forward's
    required inputs), or None: each must take one input, its tokens grouped by expert (the
    runtime refuses any other, expert_parallel.check_grouped_input)."""
    routing = {fqn: inputs for fqn, inputs in experts_inputs.items() if len(inputs) != 1}
    if not routing:
        return None
    fqn, inputs = min(routing.items())
    return (f"{fqn}.forward takes ({', '.join(inputs)}) and routes the tokens itself, while expert parallelism "
            "exchanges an experts module's one input, its tokens grouped by expert [E, tokens, ...]")


def _flop_share(ops: list[Any], modules: set[str], phase: str, total: int) -> float:
    if not total:
        return 0.0
    inside = sum(op.flops for op in ops if op.phase == phase and op.module
                 and any(op.module == m or op.module.startswith(m + ".") for m in modules))
    return min(1.0, inside / total)


def routing_pace(ep: int, imbalance: float, capacity_factor: float) -> float:
    """The most-loaded rank's tokens over the mean: what the expert-parallel group waits for.

    With one rank holding every expert (ep=1) the layer's work is the same however tokens are
    routed. Across ep ranks, dropless routing (capacity_factor 0) gives the busiest rank
    `imbalance` times the mean; a capacity factor c caps it at c (tokens beyond it are dropped,
    as Megatron-Core does without padding to capacity)."""
    if ep == 1:
        return 1.0
    return min(imbalance, capacity_factor) if capacity_factor > 0 else imbalance


def dispatch_bytes(moe: MoELayer, scale: float, cp: int, tp_shard: int, pace: float) -> float:
    """Bytes one rank sends in one all-to-all (dispatch or combine) for a micro-batch `scale`
    times the profiled one: its tokens x k at the busiest rank's pace (÷ cp; ÷ tp when sequence
    parallelism leaves each TP rank a slice of the tokens)."""
    return pace * moe.tokens * scale / cp / tp_shard * moe.top_k * moe.token_bytes


def all_to_alls(option: str) -> int:
    """All-to-alls per micro-batch: dispatch and combine forward, their gradients backward, and
    the forward's again where the layer is recomputed (full, or selective, which keeps GEMM
    outputs but not collectives')."""
    return 6 if option in ("full", "selective") else 4

"""Expert parallelism's facts and prices: which layers hold experts, and what sharding them
over `ep` ranks costs.

Expert parallelism is carved from the data-parallel ranks, as Megatron-Core's expert-data-
parallel groups are: `ep` consecutive data-parallel ranks form an expert-parallel group that
holds one copy of every expert, each rank E / ep of them; the rest of the model sees dp
unchanged. Expert weights are therefore replicated over dp / ep ranks (the expert-data-parallel
group), which is what ZeRO shards their states over and what their gradients are summed over.

A layer holds experts when one of its parameters is stacked by expert: a name with an
`experts` component and at least three dimensions ([E, ...]); E is its first dimension. Top-k
is read off the layer's traced `topk` op (its output's last dimension). The generated exchange
(autopar/sections/expert_parallel.py) reaches an experts module in one of two ways, read off
its forward (`ExpertExchange`): the tokens already grouped by expert with the model's own
capacity, or (Hugging Face's experts modules) the flat tokens with their chosen experts and
gates, exchanged dropless. A module taking anything else has an `ep_blocker` and is planned
with ep=1 only: nothing generated would run it.

Per MoE layer and micro-batch (rows R per rank: T·k for a dropless exchange, T = b·s / cp
tokens and k experts each; E·C for a grouped one, every capacity slot; token bytes h·dtype),
with pace p (the most-loaded rank's share of the mean, `routing_pace`: `train.moe_imbalance`
dropless, 1 grouped):
    dispatch and combine = 2 all-to-alls of p·R·h·dtype bytes in forward, 2 in backward
    (and 2 again in a recomputed forward), priced by `collectives.all_to_all_s` over the
    expert-parallel group: the off-node share leaves through the NIC;
    expert compute x p (the ranks wait for the most-loaded one);
    a dispatch buffer of 2·p·R·h·dtype (received rows and their outputs, one layer at a time).
Model states: E / ep experts per rank, their optimizer states (ZeRO) sharded over the
expert-data-parallel group.

    facts = ExpertFacts.of(profile)
    facts.experts_of("blocks.0"), facts.common_divisor()
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from autopar.domain.vocabulary import Recompute

if TYPE_CHECKING:
    from autopar.model_profile import ModelProfile

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
        dispatch_rows: rows of token_bytes one all-to-all moves for the profiled micro-batch:
            tokens x top_k for a dropless exchange, the experts' grouped input E x C (every
            capacity slot, filled or not) for a grouped one.
        dropless: exchanged dropless (`ExpertExchange.ROUTED`): the busiest rank's load follows
            the routing; a grouped exchange moves and computes the same rows however tokens route.
        modules: the FQNs of the layer's experts modules (measured loads are kept by them).
        width: the experts' feed-forward width, which expert tensor parallelism splits (0: the
            stacked weights cannot be split as a plain sum of slices, `feed_forward_width`).
    """

    experts: int
    top_k: int
    expert_params: int
    expert_forward_share: float
    expert_backward_share: float
    token_bytes: float
    tokens: int
    dispatch_rows: int = 0
    dropless: bool = True
    width: int = 0
    modules: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExpertFacts:
    """The layers with experts, by layer name, and why expert parallelism cannot shard them
    (None: it can)."""

    layers: dict[str, MoELayer] = field(default_factory=dict)
    ep_blocker: str | None = None

    @classmethod
    def of(cls, profile: "ModelProfile") -> "ExpertFacts":
        tokens = profile.micro_batch_size * (profile.tokens_per_sample or 1)
        experts_inputs = getattr(profile, "experts_inputs", {})
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
            dropless = is_dropless({m: inputs for m, inputs in experts_inputs.items() if m in modules}) \
                if experts_inputs else True
            rows = tokens * int(top_k) if dropless else _grouped_rows(ops, modules, int(experts)) or tokens * int(top_k)
            layers[layer.name] = MoELayer(
                experts=int(experts), top_k=int(top_k),
                expert_params=sum(math.prod(profile.param_shapes[name]) for name in stacked),
                expert_forward_share=_flop_share(ops, modules, "forward", layer.flops_forward),
                expert_backward_share=_flop_share(ops, modules, "backward", layer.flops_backward),
                token_bytes=layer.input_bytes / max(1, tokens), tokens=tokens, dispatch_rows=rows, dropless=dropless,
                modules=tuple(sorted(modules)),
                width=feed_forward_width([shape for name, shape in profile.param_shapes.items()
                                          if name.rsplit(".", 1)[0] in modules],
                                         router_width(profile.param_shapes, layer.param_names, stacked, int(experts))))
        return cls(layers, ep_blocker(experts_inputs) if layers else None)

    def experts_of(self, layer_name: str) -> MoELayer | None:
        return self.layers.get(layer_name)

    @property
    def has_experts(self) -> bool:
        return bool(self.layers)

    @property
    def dropless(self) -> bool:
        """Every MoE layer exchanged dropless: each token routed alone, whatever else this
        rank holds of its sequence (so expert parallelism can span context-parallel ranks)."""
        return bool(self.layers) and all(layer.dropless for layer in self.layers.values())

    def common_width(self) -> int:
        """The largest tp every MoE layer's experts' width divides into (0: some cannot be split)."""
        widths = [layer.width for layer in self.layers.values()]
        return math.gcd(*widths) if widths and all(widths) else 0

    def common_divisor(self) -> int:
        """The largest ep every MoE layer's experts divide into (0 without experts)."""
        return math.gcd(*(layer.experts for layer in self.layers.values())) if self.layers else 0


def feed_forward_width(shapes: list[list[int]], hidden: int | None) -> int:
    """The feed-forward width F of an experts module's weights (0 when it has none to split as a
    plain sum of slices): each weight [E, a, b] with one of a, b the hidden size (the width of
    the router scoring the experts, `router_width`) and the other F, in 1 or 2 blocks (a fused
    [gate; up] projection); a bias or any other shape has none. The generated code reads the
    same off the module (autopar/sections/expert_parallel.py, `width_split`)."""
    if not shapes or hidden is None or any(len(shape) != 3 or (shape[1] == hidden) == (shape[2] == hidden)
                                           for shape in shapes):
        return 0
    others = [shape[1] if shape[2] == hidden else shape[2] for shape in shapes]
    width = min(others)
    return width if all(other in (width, 2 * width) for other in others) else 0


def router_width(shapes: dict[str, list[int]], names: list[str], stacked: list[str], experts: int) -> int | None:
    """The hidden size the experts work in: the input width of the router scoring them, a
    [E, hidden] weight of the same layer outside the experts (None: none found)."""
    return next((shapes[name][1] for name in names if name not in stacked and len(shapes.get(name, [])) == 2
                 and shapes[name][0] == experts), None)


def is_expert_param(name: str, shape: list[int]) -> bool:
    """A parameter stacked by expert: an `experts` component in its name and [E, ...] with E
    leading a matrix per expert."""
    return "experts" in name.split(".") and len(shape) >= 3


class ExpertExchange(str, Enum):
    """How the generated expert parallelism reaches an experts module, read off its forward.

    GROUPED: ``forward(tokens)`` takes the tokens already grouped by expert, [E, C, ...], with a
        capacity of C slots the model chose; the exchange moves the whole fixed-size tensor.
    ROUTED: ``forward(hidden_states, top_k_index, top_k_weights)`` (Hugging Face's experts
        modules) takes the flat tokens and each one's chosen experts and gates; the exchange is
        dropless, each token-choice pair sent to its expert's rank, so its size follows the routing.
    """

    GROUPED = "grouped"
    ROUTED = "routed"


ROUTED_INPUTS = ("hidden_states", "top_k_index", "top_k_weights")


def exchange_kind(inputs: list[str] | tuple[str, ...]) -> ExpertExchange | None:
    """The exchange an experts module with these required forward inputs takes (None: neither)."""
    if len(inputs) == 1:
        return ExpertExchange.GROUPED
    if tuple(inputs) == ROUTED_INPUTS:
        return ExpertExchange.ROUTED
    return None


def ep_blocker(experts_inputs: dict[str, list[str]]) -> str | None:
    """Why the generated all-to-alls cannot wrap these experts modules (FQN -> their forward's
    required inputs), or None: each must take its tokens grouped by expert, or the flat tokens
    with their chosen experts and gates (`ExpertExchange`; the runtime refuses any other,
    autopar/sections/expert_parallel.py's `is_routed`)."""
    unknown = {fqn: inputs for fqn, inputs in experts_inputs.items() if exchange_kind(inputs) is None}
    if not unknown:
        return None
    fqn, inputs = min(unknown.items())
    return (f"{fqn}.forward takes ({', '.join(inputs)}), while expert parallelism exchanges either one input, the "
            f"tokens grouped by expert [E, tokens, ...], or ({', '.join(ROUTED_INPUTS)})")


def is_dropless(experts_inputs: dict[str, list[str]]) -> bool:
    """Whether the experts are exchanged dropless (every module ROUTED): the busiest rank's
    share then follows the routing."""
    return bool(experts_inputs) and all(exchange_kind(inputs) == ExpertExchange.ROUTED
                                        for inputs in experts_inputs.values())


def _grouped_rows(ops: list[Any], modules: set[str], experts: int) -> int:
    """Rows of a grouped experts module's input, [E, C, ...] -> E x C, from the first forward
    op inside it that reads a tensor led by E (0 when the profile has no per-op detail)."""
    for op in ops:
        if op.phase == "forward" and op.module \
                and any(op.module == m or op.module.startswith(m + ".") for m in modules):
            for shape in op.input_shapes:
                if len(shape) >= 3 and shape[0] == experts:
                    return int(shape[0] * shape[1])
    return 0


def _flop_share(ops: list[Any], modules: set[str], phase: str, total: int) -> float:
    if not total:
        return 0.0
    inside = sum(op.flops for op in ops if op.phase == phase and op.module
                 and any(op.module == m or op.module.startswith(m + ".") for m in modules))
    return min(1.0, inside / total)


def routing_pace(ep: int, imbalance: float, dropless: bool, load: tuple[int, ...] = ()) -> float:
    """The most-loaded rank's rows over the mean: what the expert-parallel group waits for.

    With one rank holding every expert (ep=1) the layer's work is the same however tokens are
    routed. Across ep ranks, a dropless exchange gives the busiest rank `imbalance` times the
    mean (`train.moe_imbalance`), or, with the tokens each expert received measured from a
    trained router (`load`, autopar/trace/routing.py), the busiest block of E / ep consecutive
    experts (as `apply_ep` places them) over the mean block. A grouped exchange moves every
    capacity slot, filled or not, so each rank receives and computes the same rows whatever the
    routing (its cost of routing is the slots it pads, already in `MoELayer.dispatch_rows`, and
    the tokens it drops)."""
    if ep == 1 or not dropless:
        return 1.0
    if load and sum(load) and len(load) % ep == 0:
        share = len(load) // ep
        blocks = [sum(load[rank * share:(rank + 1) * share]) for rank in range(ep)]
        return max(blocks) / (sum(blocks) / ep)
    return imbalance


def dispatch_bytes(moe: MoELayer, scale: float, cp: int, pace: float) -> float:
    """Bytes one rank sends in one all-to-all (dispatch or combine) for a micro-batch `scale`
    times the profiled one: its dispatched rows at the busiest rank's pace (÷ cp). Not ÷ tp
    under sequence parallelism: the generated MoE layer is a replicated region of its block, into
    which sequence parallelism gathers the whole sequence on every tensor-parallel rank."""
    return pace * moe.dispatch_rows * scale / cp * moe.token_bytes


def all_to_alls(option: str, dropless: bool = False) -> int:
    """All-to-alls per micro-batch: dispatch and combine forward, their gradients backward, and
    the forward's again where the layer is recomputed (full, or selective, which keeps GEMM
    outputs but not collectives'); a dropless exchange first sends its per-expert counts in each
    forward (`count_exchanges`)."""
    return 2 * forward_passes(option) + 2 + (count_exchanges(option) if dropless else 0)


def forward_passes(option: str) -> int:
    """Forwards an MoE layer runs per micro-batch under a recompute option: a recomputed one
    (full, or selective, which keeps GEMM outputs but not collectives') runs twice."""
    return 2 if option in (Recompute.FULL, Recompute.SELECTIVE) else 1


def count_exchanges(option: str) -> int:
    """The dropless exchange's count all-to-alls per micro-batch: one per forward (the
    recomputed one included), E integers a rank, so each rank knows the sizes it receives."""
    return forward_passes(option)


COUNT_BYTES = 8  # one int64 count per expert
GATE_BYTES = 4  # a routing weight (fp32, as routers compute them)


def expert_tp_sums(moe: MoELayer, scale: float, cp: int, option: str) -> list[tuple[int, float]]:
    """(count, bytes) of the all-reduces expert tensor parallelism issues per micro-batch over
    the TP group (codegen: `_ReduceFromTensorParallel` after the combine, `_CopyToTensorParallel`
    before the experts): the output's partial sums in each forward (again where the layer is
    recomputed) and the input's partial gradient in backward: the E x C rows of a grouped
    module; of a dropless one the T combined tokens, and in backward also its T x k gates."""
    rows = moe.dispatch_rows if not moe.dropless else moe.tokens
    sums = [(forward_passes(option) + 1, rows * scale / cp * moe.token_bytes)]
    if moe.dropless:
        sums.append((1, moe.tokens * moe.top_k * scale / cp * GATE_BYTES))
    return sums

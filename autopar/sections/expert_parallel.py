"""Expert parallelism: each MoE layer's experts sharded over ep consecutive data-parallel ranks,
tokens sent to their experts' ranks and back by all-to-all (GShard, Lepikhin et al. 2020).

The model's contract: a module named ``experts`` whose parameters are stacked by expert on dim 0
([E, ...]), with one of two forwards. The router, the gates and the load-balancing loss stay
outside it and run replicated, on each rank's own tokens. Each rank keeps E / ep experts (a
plain slice of dim 0), so the stacked weights are sharded Shard(0) over the expert-parallel group.

- Grouped, ``forward(tokens)``: the tokens already grouped by expert, [E, C, ...] in and out,
  at a capacity C the model chose. Around the experts' forward:
      dispatch: [E, C, h] -> all_to_all_single over the group -> [E/ep, ep·C, h]
                (rank j receives every rank's tokens for its experts)
      combine:  the inverse exchange of the experts' output.
- Routed, ``forward(hidden_states, top_k_index, top_k_weights)`` (Hugging Face's experts
  modules): exchanged dropless by `RoutedExchange`, with sizes that follow the routing.
`all_to_all_single_autograd` (torch's functional collectives) carries autograd: backward runs
the inverse exchanges.

Expert weights are replicated over the dp / ep ranks of the expert-data-parallel group: FSDP
shards them there (ZeRO-2/3) and averages their gradients over it. That gradient already sums
the tokens of the whole expert-parallel group, so `ExpertShards.scale_gradients` divides it by
ep more before the optimizer step, making it the one-process mean (FSDP's own divide factor
would do it in the reduction, but its PREMUL_SUM does not run on gloo).

Expert tensor parallelism (``expert_tp``) splits every expert's feed-forward width over the
tensor-parallel group, Megatron's MLP split applied per expert, separately from how attention is
split (`apply_expert_tp`). The experts' input is the same on every TP rank (TP leaves the MoE
layer replicated, and sequence parallelism gathers the sequence into it), so each rank computes
its slice's partial output: `_ReduceFromTensorParallel` sums it over the group after the
combine (a linear exchange, so the sum can come last, on fewer rows for a dropless one), and
`_CopyToTensorParallel` sums the input's (and a routed module's gates') partial gradients
in backward.

In a pipeline the same holds for each stage's experts. Stages cut from an exported graph
(pipeline.py) are graphs without the experts modules, so there the experts are sliced and
hooked before the export, which traces the exchanges into each stage's graph, and FSDP leaves
them alone (codegen allows that split only when dp = ep: each expert-data-parallel group is one
rank, so there is nothing to shard or average).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch._subclasses.fake_tensor import is_fake

EXPERTS_MODULE = "experts"
# An experts module that routes its own tokens (Hugging Face's); cost_models.expert_parallel
# reads the same names off the profile (this file is copied into the generated module, which
# imports nothing of autopar).
ROUTED_INPUTS = ("hidden_states", "top_k_index", "top_k_weights")


def expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """FQN -> experts module: modules named ``experts`` holding parameters stacked [E, ...]."""
    found = {}
    for name, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        if name.split(".")[-1] == EXPERTS_MODULE and params and all(p.dim() >= 3 for p in params):
            found[name] = module
    return found


def is_routed(fqn: str, module: nn.Module) -> bool:
    """Whether this experts module routes its own tokens (``forward(hidden_states, top_k_index,
    top_k_weights)``, exchanged by `RoutedExchange`) rather than taking them grouped by expert
    (``forward(tokens)`` [E, C, ...], exchanged by `_dispatch` / `_combine`); a refusal naming
    the fix for any other forward: exchanged another way, its inputs would be reshaped as
    something they are not and train another model. The planner reads the same from the profile
    (cost_models.expert_parallel.exchange_kind) and never plans ep > 1 for such a model; this
    guards a plan made from an older profile."""
    required = tuple(p.name for p in inspect.signature(module.forward).parameters.values()
                     if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    if required == ROUTED_INPUTS and getattr(module, "num_experts", None) is not None:
        return True
    if len(required) != 1:
        raise ValueError(f"{fqn}.forward takes ({', '.join(required)}), but expert parallelism exchanges either one "
                         f"input, the tokens grouped by expert [E, tokens, ...], or ({', '.join(ROUTED_INPUTS)}) of "
                         "a module with a num_experts attribute: compile a plan with plan.ep=1, or give the experts "
                         "module one of these forwards")
    return False


def _dispatch(x: torch.Tensor, group: dist.ProcessGroup, ep: int) -> torch.Tensor:
    """[E, C, ...] on each rank -> [E/ep, ep·C, ...]: this rank's experts, every rank's tokens."""
    experts, capacity = x.shape[0], x.shape[1]
    received = all_to_all_single_autograd(x.contiguous(), None, None, group)
    # Block i of `received` holds rank i's tokens for this rank's experts.
    blocks = received.view(ep, experts // ep, capacity, *x.shape[2:])
    return blocks.transpose(0, 1).reshape(experts // ep, ep * capacity, *x.shape[2:])


def _combine(y: torch.Tensor, group: dist.ProcessGroup, ep: int) -> torch.Tensor:
    """The inverse of `_dispatch`: [E/ep, ep·C, ...] -> [E, C, ...] in expert order."""
    local, tokens = y.shape[0], y.shape[1]
    blocks = y.view(local, ep, tokens // ep, *y.shape[2:]).transpose(0, 1).contiguous()
    sent = blocks.view(ep * local, tokens // ep, *y.shape[2:])
    return all_to_all_single_autograd(sent, None, None, group)


class RoutedExchange:
    """Dropless expert parallelism for an experts module that routes its own tokens,
    ``forward(hidden_states [T, h], top_k_index [T, k], top_k_weights [T, k])``.

    Each of the T·k (token, choice) pairs goes to the rank holding its expert, so the exchange's
    size follows the routing (no capacity, nothing dropped; the busiest rank sets the pace):
        1. the pairs are sorted by expert, hence by destination rank (experts r·E/ep ... are rank r's);
        2. the per-expert counts are exchanged first (one all-to-all of E integers), so each rank
           knows how many rows it receives from each other rank for each of its experts;
        3. the rows travel by an all-to-all of those uneven sizes (autograd: backward sends the
           gradients back the same way reversed);
        4. the module's own forward runs on the received rows, each with its one local expert
           and a gate of 1, its `num_experts` set to the E/ep experts this rank keeps;
        5. the outputs travel back by the inverse exchange, return to pair order, and are summed
           over each token's k choices with their gates, as the module itself sums them.
    On fake tensors (compile's full-scale step) there are no values to count, so every rank
    sends an even share: the shapes of balanced routing.
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, ep: int, experts: int):
        self.forward = module.forward  # the module's own (a bound method, before it is replaced)
        self.group, self.ep, self.experts = group, ep, experts
        self.local = experts // ep

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, k = top_k_index.shape
        chosen = top_k_index.reshape(-1)
        order = torch.argsort(chosen, stable=True)  # pairs by expert, so by destination rank
        sent = hidden_states[order // k]
        send_splits, receive_splits, local_index = self._splits(chosen, sent.shape[0])
        received = all_to_all_single_autograd(sent, receive_splits, send_splits, self.group)
        gates = torch.ones(received.shape[0], 1, dtype=top_k_weights.dtype, device=received.device)
        output = self.forward(received, local_index[:, None], gates)
        returned = all_to_all_single_autograd(output, send_splits, receive_splits, self.group)
        paired = returned[torch.argsort(order)].view(tokens, k, -1)  # back to (token, choice) order
        combined = (paired * top_k_weights[..., None].to(paired.dtype)).sum(1)
        return combined.to(hidden_states.dtype)

    def _splits(self, chosen: torch.Tensor, pairs: int) -> tuple[list[int], list[int], torch.Tensor]:
        """(rows sent to each rank, rows received from each rank, the local expert of each
        received row, in the order the rows arrive: by source rank, then by expert)."""
        if is_fake(chosen):
            share = [pairs // self.ep + (rank < pairs % self.ep) for rank in range(self.ep)]
            mine = share[dist.get_rank(self.group)]
            received = torch.arange(mine * self.ep, device=chosen.device) % self.local
            return share, [mine] * self.ep, received
        per_expert = torch.bincount(chosen, minlength=self.experts)
        from_each = torch.empty_like(per_expert)  # [ep, local]: source rank r's rows for each of my experts
        dist.all_to_all_single(from_each, per_expert, group=self.group)
        from_each = from_each.view(self.ep, self.local)
        send = per_expert.view(self.ep, self.local).sum(1).tolist()
        receive = from_each.sum(1).tolist()
        local_ids = torch.arange(self.local, device=chosen.device).repeat(self.ep)
        return send, receive, local_ids.repeat_interleave(from_each.reshape(-1))


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> dict[str, nn.Module]:
    """Shard every experts module's stacked weights over the expert-parallel group and wrap its
    forward in the dispatch and combine all-to-alls.

    Args:
        model: the unsharded model (before FSDP, which then shards what this leaves).
        ep_mesh: the 1-D expert-parallel mesh (ep consecutive data-parallel ranks).

    Returns:
        FQN -> experts module (`ExpertShards.of` names their sliced parameters).
    """
    ep, rank, group = ep_mesh.size(), ep_mesh.get_local_rank(), ep_mesh.get_group()
    modules = expert_modules(model)
    if not modules:
        raise ValueError(f"the plan shards experts over ep={ep} ranks, but the model has no module named "
                         f"'{EXPERTS_MODULE}' with parameters stacked by expert [E, ...]: compile a plan with "
                         "plan.ep=1, or stack the experts' weights in such a module")
    for fqn, module in modules.items():
        routed = is_routed(fqn, module)
        experts = 0
        for name, param in list(module.named_parameters(recurse=False)):
            if param.shape[0] % ep:
                raise ValueError(f"{param.shape[0]} experts cannot be split over ep={ep} ranks")
            experts, share = param.shape[0], param.shape[0] // ep
            local = nn.Parameter(param.detach()[rank * share:(rank + 1) * share].clone(),
                                 requires_grad=param.requires_grad)
            setattr(module, name, local)
        if routed:
            # The module's own forward, wrapped (an instance attribute: FSDP's hooks still run
            # around it, and the module keeps its FQN for checkpoints and recomputation).
            module.forward = RoutedExchange(module, group, ep, experts)
            setattr(module, "num_experts", experts // ep)  # what the experts' own loop reads
        else:
            # Forward hooks, so the module keeps its FQN (checkpoints, FSDP groups, recomputation).
            module.register_forward_pre_hook(lambda _, args: (_dispatch(args[0], group, ep), *args[1:]))
            module.register_forward_hook(lambda _, args, output: _combine(output, group, ep))
    return modules


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the tensor-parallel group (each rank
    holds a slice of the experts' width, so its input gradient is a partial sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Forward sums the slices' partial outputs over the tensor-parallel group; backward passes
    the (replicated) gradient on as it is."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        summed = x.contiguous().clone()
        dist.all_reduce(summed, group=group)
        return summed

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def router_width(model: nn.Module, fqn: str, experts: int) -> int | None:
    """The hidden size an experts module works in: the input width of the router that scores its
    ``experts`` experts, a [E, hidden] weight in the module around it (None: none found)."""
    parent = model.get_submodule(fqn.rsplit(".", 1)[0]) if "." in fqn else model
    owned = {id(p) for p in model.get_submodule(fqn).parameters()}
    return next((p.shape[1] for p in parent.parameters() if id(p) not in owned and p.dim() == 2
                 and p.shape[0] == experts), None)


def width_split(fqn: str, module: nn.Module, tp: int, hidden: int | None) -> dict[str, tuple[int, int]]:
    """Parameter name -> (dim, parts) of each stacked expert weight's feed-forward width: the
    dim that is not the hidden size (`router_width`), in ``parts`` blocks (2 for a fused
    [gate; up] projection, as Hugging Face stacks it), each split over ``tp`` ranks. Refused
    where the split would not be a plain sum of slices: a bias, a weight that is not [E, a, b]
    with one dim the hidden size and the other not, a width ``tp`` does not divide, or a norm
    after the experts (Hugging Face's has_post_expert_norm). cost_models.expert_parallel's
    `feed_forward_width` reads the same off the profile."""
    params = dict(module.named_parameters(recurse=False))
    refuse = f"{fqn} cannot split its experts' width over tp={tp}"
    if any(p.dim() != 3 or (p.shape[1] == hidden) == (p.shape[2] == hidden) for p in params.values()) \
            or hidden is None or getattr(module, "has_post_expert_norm", False):
        raise ValueError(f"{refuse}: each weight must be [E, a, b] with one of a, b the hidden size {hidden} (the "
                         "router's width), with no bias or norm after the experts; compile a plan with "
                         "plan.expert_tp=false")
    widths = {name: (1 if p.shape[2] == hidden else 2) for name, p in params.items()}  # the non-hidden dim
    width = min(p.shape[dim] for name, p in params.items() for dim in [widths[name]])
    split = {}
    for name, p in params.items():
        dim = widths[name]
        parts, rest = divmod(p.shape[dim], width)
        if rest or parts not in (1, 2) or width % tp:
            raise ValueError(f"{refuse}: {name} {list(p.shape)} is not 1 or 2 blocks of a width {width} that tp "
                             "divides; compile a plan with plan.expert_tp=false")
        split[name] = (dim, parts)
    return split


def _slice_width(param: torch.Tensor, dim: int, parts: int, tp: int, rank: int) -> torch.Tensor:
    """This rank's slice of each of the ``parts`` blocks along ``dim``, side by side."""
    blocks = param.chunk(parts, dim)
    share = blocks[0].shape[dim] // tp
    return torch.cat([block.narrow(dim, rank * share, share) for block in blocks], dim)


def apply_expert_tp(model: nn.Module, tp_mesh: DeviceMesh, shards: "ExpertShards | None") -> "ExpertShards":
    """Split every experts module's width over the tensor-parallel group (see the module
    docstring), after `apply_ep` made ``shards`` (None without expert parallelism): the sum of
    the partial outputs then comes after the combine, and each module holds E / ep experts.

    Returns:
        The experts' shards: ``shards``' expert-parallel slices, now also split over TP.
    """
    tp, rank, group = tp_mesh.size(), tp_mesh.get_local_rank(), tp_mesh.get_group()
    ep = shards.ep if shards else 1
    modules = expert_modules(model)
    split: dict[str, tuple[int, int]] = {}
    for fqn, module in modules.items():
        experts = next(module.parameters()).shape[0] * ep
        for name, (dim, parts) in width_split(fqn, module, tp, router_width(model, fqn, experts)).items():
            param = getattr(module, name)
            local = nn.Parameter(_slice_width(param.detach(), dim, parts, tp, rank).clone(),
                                 requires_grad=param.requires_grad)
            setattr(module, name, local)
            split[f"{fqn}.{name}"] = (dim, parts)
        module.register_forward_pre_hook(lambda _, args: tuple(
            _CopyToTensorParallel.apply(a, group) if torch.is_tensor(a) and a.is_floating_point() else a for a in args))
        module.register_forward_hook(lambda _, args, output: _ReduceFromTensorParallel.apply(output, group))
    if shards is None:
        return ExpertShards.of(modules, tp_mesh=tp_mesh, widths=split)
    return replace(shards, tp=tp, tp_group=group, widths=split)


@dataclass(frozen=True)
class ExpertShards:
    """This rank's slices of the stacked experts: the parameters holding them, by their FQN in
    the unsharded model (a pipeline stage's graph keeps no module to mark, so they are named),
    the expert-parallel group the experts are spread over (ep 1: none), and the tensor-parallel
    group their width is split over (`apply_expert_tp`; tp 1: none)."""

    names: frozenset[str]
    ep: int
    group: dist.ProcessGroup | None
    tp: int = 1
    tp_group: dist.ProcessGroup | None = None
    widths: dict[str, tuple[int, int]] = field(default_factory=dict)  # FQN -> (dim, parts) split over tp

    @classmethod
    def of(cls, modules: dict[str, nn.Module], ep_mesh: DeviceMesh | None = None, tp_mesh: DeviceMesh | None = None,
           widths: dict[str, tuple[int, int]] | None = None) -> "ExpertShards":
        """The shards `apply_ep` (over ``ep_mesh``) or `apply_expert_tp` (over ``tp_mesh``,
        splitting ``widths``) made of ``modules`` (FQN -> experts module)."""
        names = frozenset(f"{fqn}.{name}" for fqn, module in modules.items()
                          for name, _ in module.named_parameters(recurse=False))
        return cls(names, ep_mesh.size() if ep_mesh else 1, ep_mesh.get_group() if ep_mesh else None,
                   tp_mesh.size() if tp_mesh else 1, tp_mesh.get_group() if tp_mesh else None, dict(widths or {}))

    def __or__(self, other: "ExpertShards") -> "ExpertShards":
        return ExpertShards(self.names | other.names, self.ep, self.group, self.tp, self.tp_group,
                            {**self.widths, **other.widths})

    def full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """A parameter of the unsharded model: an expert slice gathered over the tensor-parallel
        group along its width, then over the expert-parallel group in expert order (every rank
        of both groups must call it), any other as it is."""
        if name not in self.names:
            return local
        if name in self.widths:
            dim, parts = self.widths[name]
            slices = [torch.empty_like(local) for _ in range(self.tp)]
            dist.all_gather(slices, local.contiguous(), group=self.tp_group)
            blocks = [piece.chunk(parts, dim) for piece in slices]  # [rank][part]
            local = torch.cat([torch.cat([blocks[r][part] for r in range(self.tp)], dim) for part in range(parts)], dim)
        if self.ep == 1:
            return local
        gathered = [torch.empty_like(local) for _ in range(self.ep)]
        dist.all_gather(gathered, local.contiguous(), group=self.group)
        return torch.cat(gathered)

    @torch.no_grad()
    def scale_gradients(self, named: Iterable[tuple[str, nn.Parameter]]) -> None:
        """Divide the experts' reduced gradients by ep (see the module docstring): once per step,
        after the last micro-batch's backward and before the optimizer step."""
        if self.ep == 1:
            return
        for name, param in named:
            if name in self.names and param.grad is not None:
                param.grad.div_(self.ep)


def shard_experts(modules: list[nn.Module], edp_mesh: DeviceMesh, reshard_after_forward: bool,
                  param_dtype: torch.dtype | None) -> None:
    """FSDP over the expert-data-parallel group for each experts module, before the blocks are
    wrapped (which then leave these parameters alone), in the blocks' mixed precision."""
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype \
        else MixedPrecisionPolicy()
    for module in modules:
        fully_shard(module, mesh=edp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)


def expert_meshes(dp_mesh: DeviceMesh, ep: int) -> tuple[DeviceMesh, DeviceMesh]:
    """(expert-parallel, expert-data-parallel) 1-D meshes cut from the data-parallel shard mesh:
    ep consecutive data-parallel ranks form an expert-parallel group (as the cost model places
    it, cost_models/expert_parallel.py)."""
    # Private, but the only route in torch 2.13 to sub-meshes sharing the root mesh FSDP needs.
    split = dp_mesh._unflatten(0, (dp_mesh.size() // ep, ep), ("edp", "ep"))
    return split["ep"], split["edp"]

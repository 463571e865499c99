"""Expert parallelism: each MoE layer's experts sharded over ep consecutive data-parallel ranks,
tokens sent to their experts' ranks and back by all-to-all (GShard, Lepikhin et al. 2020).

The model's contract: a module named ``experts`` whose parameters are stacked by expert on dim 0
([E, ...]) and whose forward takes the tokens already grouped by expert, [E, tokens, ...], and
returns [E, tokens, ...]. The router, the gates and the load-balancing loss stay outside it and
run replicated, on each rank's own tokens.

Each rank keeps E / ep experts (a plain slice of dim 0), so the stacked weights are sharded
Shard(0) over the expert-parallel group. Around the experts' forward:
    dispatch: [E, C, h] -> all_to_all_single over the group -> [E/ep, ep·C, h]
              (rank j receives every rank's tokens for its experts)
    combine:  the inverse exchange of the experts' output.
`all_to_all_single_autograd` (torch's functional collectives) carries autograd: backward runs
the inverse exchanges.

Expert weights are replicated over the dp / ep ranks of the expert-data-parallel group: FSDP
shards them there (ZeRO-2/3) and averages their gradients over it. That gradient already sums
the tokens of the whole expert-parallel group, so `scale_expert_gradients` divides it by ep
more before the optimizer step, making it the one-process mean (FSDP's own divide factor would
do it in the reduction, but its PREMUL_SUM does not run on gloo).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed._functional_collectives import all_to_all_single_autograd

EXPERTS_MODULE = "experts"
EP_DEGREE = "expert_parallel_degree"  # the attributes apply_ep marks an experts module with
EP_GROUP = "expert_parallel_group"


def expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """FQN -> experts module: modules named ``experts`` holding parameters stacked [E, ...]."""
    found = {}
    for name, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        if name.split(".")[-1] == EXPERTS_MODULE and params and all(p.dim() >= 3 for p in params):
            found[name] = module
    return found


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


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> dict[str, nn.Module]:
    """Shard every experts module's stacked weights over the expert-parallel group and wrap its
    forward in the dispatch and combine all-to-alls.

    Args:
        model: the unsharded model (before FSDP, which then shards what this leaves).
        ep_mesh: the 1-D expert-parallel mesh (ep consecutive data-parallel ranks).

    Returns:
        FQN -> experts module, each marked (`EP_DEGREE`) for `scale_expert_gradients`.
    """
    ep, rank, group = ep_mesh.size(), ep_mesh.get_local_rank(), ep_mesh.get_group()
    modules = expert_modules(model)
    if not modules:
        raise ValueError(f"the plan shards experts over ep={ep} ranks, but the model has no module named "
                         f"'{EXPERTS_MODULE}' with parameters stacked by expert [E, ...]: compile a plan with "
                         "plan.ep=1, or stack the experts' weights in such a module")
    for module in modules.values():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.shape[0] % ep:
                raise ValueError(f"{param.shape[0]} experts cannot be split over ep={ep} ranks")
            share = param.shape[0] // ep
            local = nn.Parameter(param.detach()[rank * share:(rank + 1) * share].clone(),
                                 requires_grad=param.requires_grad)
            setattr(module, name, local)
        # Forward hooks, so the module keeps its FQN (checkpoints, FSDP groups, recomputation).
        module.register_forward_pre_hook(lambda _, args: (_dispatch(args[0], group, ep), *args[1:]))
        module.register_forward_hook(lambda _, args, output: _combine(output, group, ep))
        setattr(module, EP_DEGREE, ep)
        setattr(module, EP_GROUP, group)
    return modules


def full_experts(model: nn.Module, name: str, local: torch.Tensor) -> torch.Tensor:
    """A parameter of the unsharded model: an experts module's slices gathered over its
    expert-parallel group in expert order (every rank of the group must call it), any other
    parameter as it is."""
    owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    ep = getattr(owner, EP_DEGREE, 1)
    if ep == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(ep)]
    dist.all_gather(parts, local.contiguous(), group=getattr(owner, EP_GROUP))
    return torch.cat(parts)


def shard_experts(modules: list[nn.Module], edp_mesh: DeviceMesh, reshard_after_forward: bool,
                  param_dtype: torch.dtype | None) -> None:
    """FSDP over the expert-data-parallel group for each experts module, before the blocks are
    wrapped (which then leave these parameters alone), in the blocks' mixed precision."""
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype \
        else MixedPrecisionPolicy()
    for module in modules:
        fully_shard(module, mesh=edp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)


@torch.no_grad()
def scale_expert_gradients(model: nn.Module, ep: int) -> None:
    """Divide the experts' reduced gradients by ep (see the module docstring): once per step,
    after the last micro-batch's backward and before the optimizer step."""
    for module in model.modules():
        if getattr(module, EP_DEGREE, None) == ep:
            for param in module.parameters():
                if param.grad is not None:
                    param.grad.div_(ep)


def expert_meshes(dp_mesh: DeviceMesh, ep: int) -> tuple[DeviceMesh, DeviceMesh]:
    """(expert-parallel, expert-data-parallel) 1-D meshes cut from the data-parallel shard mesh:
    ep consecutive data-parallel ranks form an expert-parallel group (as the cost model places
    it, cost_models/expert_parallel.py)."""
    # Private, but the only route in torch 2.13 to sub-meshes sharing the root mesh FSDP needs.
    split = dp_mesh._unflatten(0, (dp_mesh.size() // ep, ep), ("edp", "ep"))
    return split["ep"], split["edp"]

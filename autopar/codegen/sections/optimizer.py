"""The optimizer: AdamW, with its state sharded over data-parallel replicas for ZeRO-1."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def build_optimizer(parameters: list[nn.Parameter], settings: dict, zero1_group: dist.ProcessGroup | None
                    ) -> torch.optim.Optimizer | "ShardedAdamW":
    """AdamW over ``parameters``; with ``zero1_group`` each rank of it keeps 1/n of the state.

    Args:
        parameters: the parameters this rank updates (one pipeline stage's, possibly sharded).
        settings: lr, betas, eps, weight_decay.
        zero1_group: the data-parallel replicas sharing optimizer state (ZeRO-1), or None.
    """
    options = dict(lr=settings["lr"], betas=tuple(settings["betas"]), eps=settings["eps"],
                   weight_decay=settings["weight_decay"])
    if zero1_group is not None and dist.get_world_size(zero1_group) > 1:
        return ShardedAdamW(parameters, zero1_group, **options)
    return torch.optim.AdamW(parameters, **options)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local storage of a (possibly distributed) tensor; writes go through to it."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class ShardedAdamW:
    """ZeRO-1: AdamW whose moments live only for this rank's 1/n slice of the parameters.

    Gradients arrive already averaged over the group (replicated). Each rank flattens its
    parameters into one vector, updates its contiguous slice with an ordinary AdamW (element-
    wise, so identical to updating the whole vector), and one all-gather puts the updated slices
    back together on every rank.
    """

    def __init__(self, parameters: list[nn.Parameter], group: dist.ProcessGroup, **options):
        self.parameters = [p for p in parameters if p.requires_grad]
        self.group = group
        ranks, rank = dist.get_world_size(group), dist.get_rank(group)
        with torch.no_grad():
            flat = torch.cat([_local(p).detach().reshape(-1).float() for p in self.parameters])
        self.numel = flat.numel()
        self.shard_numel = -(-self.numel // ranks)  # ceil: the last slice is padded
        self.start = min(rank * self.shard_numel, self.numel)
        self.stop = min(self.start + self.shard_numel, self.numel)
        self.shard = nn.Parameter(flat[self.start:self.stop].clone())
        self.inner = torch.optim.AdamW([self.shard], **options)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        grads = [_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p)) for p in self.parameters]
        flat_grad = torch.cat([g.reshape(-1).float() for g in grads])
        self.shard.grad = flat_grad[self.start:self.stop].clone()
        self.inner.step()
        gathered = torch.empty(self.shard_numel * dist.get_world_size(self.group), dtype=self.shard.dtype,
                               device=self.shard.device)
        padded = torch.zeros(self.shard_numel, dtype=self.shard.dtype, device=self.shard.device)
        padded[: self.stop - self.start] = self.shard
        dist.all_gather_into_tensor(gathered, padded, group=self.group)
        offset = 0
        for p in self.parameters:
            local = _local(p)
            local.copy_(gathered[offset:offset + local.numel()].view_as(local))
            offset += local.numel()

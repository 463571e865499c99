"""The optimizer: AdamW, with its state sharded over data-parallel replicas for ZeRO-1."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def build_optimizer(parameters: list[nn.Parameter], settings: dict) -> torch.optim.Optimizer:
    """AdamW over ``parameters`` (one pipeline stage's, possibly sharded) with ``settings``
    (lr, betas, eps, weight_decay)."""
    # foreach (CUDA's default, forced here so CPU runs take the same path): one fused update per
    # group, and a DTensor op refuses plain tensors or another mesh's DTensors beside it.
    return torch.optim.AdamW(uniform_groups(parameters), foreach=True, **adamw_options(settings))


def build_zero1_optimizer(parameters: list[nn.Parameter], settings: dict, group: dist.ProcessGroup
                          ) -> torch.optim.Optimizer | "ShardedAdamW":
    """ZeRO-1: AdamW whose state each rank of ``group`` (the data-parallel replicas) keeps 1/n of."""
    if dist.get_world_size(group) > 1:
        return ShardedAdamW(parameters, group, **adamw_options(settings))
    return build_optimizer(parameters, settings)


def adamw_options(settings: dict) -> dict:
    return dict(lr=settings["lr"], betas=tuple(settings["betas"]), eps=settings["eps"],
                weight_decay=settings["weight_decay"])


def uniform_groups(parameters: list[nn.Parameter]) -> list[dict]:
    """``parameters`` as optimizer groups that each hold one kind: plain tensors, or DTensors of
    one mesh (what TP leaves replicated stays plain beside its sharded weights)."""
    groups: dict[Any, list[nn.Parameter]] = {}
    for parameter in parameters:
        kind = parameter.device_mesh if isinstance(parameter, DTensor) else None
        groups.setdefault(kind, []).append(parameter)
    return [{"params": members} for members in groups.values()]


# torch 2.13 renamed the flat collectives (the old names warn that they are deprecated); older
# releases, which the generated module also runs on, have only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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
        for p, value in zip(self.parameters, self._per_parameter(self._gather(self.shard))):
            _local(p).copy_(value)

    @torch.no_grad()
    def reload_parameters(self) -> None:
        """Take this rank's slice again from the parameters, after something else set them (a
        checkpoint, pretrained weights): the slice it updates is a copy taken at construction."""
        self.shard.copy_(torch.cat([_local(p).detach().reshape(-1).float() for p in self.parameters])[self.start:self.stop])

    def _gather(self, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's slice put back together: one flat vector of all parameters."""
        gathered = torch.empty(self.shard_numel * dist.get_world_size(self.group), dtype=shard.dtype,
                               device=shard.device)
        padded = torch.zeros(self.shard_numel, dtype=shard.dtype, device=shard.device)
        padded[: self.stop - self.start] = shard
        all_gather_single(gathered, padded, group=self.group)
        return gathered[: self.numel]

    def _per_parameter(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` cut into views shaped like each parameter's local storage."""
        views, offset = [], 0
        for p in self.parameters:
            local = _local(p)
            views.append(flat[offset:offset + local.numel()].view_as(local))
            offset += local.numel()
        return views

    @torch.no_grad()
    def flat_state_dict(self, fqns: list[str]) -> dict[str, Any]:
        """The state in plain AdamW's flattened form (``state.<fqn>.step|exp_avg|exp_avg_sq``,
        ``param_groups.<fqn>.<option>``), each moment shaped and placed like its parameter. The
        slices are gathered for it, so a ZeRO-1 checkpoint loads under any plan (and back).

        Args:
            fqns: each parameter's FQN, in the order of ``self.parameters``.
        """
        state = self.inner.state.get(self.shard, {})
        flat: dict[str, Any] = {}
        for name in ("exp_avg", "exp_avg_sq"):
            full = self._gather(state.get(name, torch.zeros_like(self.shard)).detach())
            for fqn, p, value in zip(fqns, self.parameters, self._per_parameter(full)):
                flat[f"state.{fqn}.{name}"] = _like(p, value.clone())
        step = state.get("step", torch.zeros((), dtype=torch.float32))
        options = {k: v for k, v in self.inner.param_groups[0].items() if k != "params"}
        for fqn in fqns:
            flat[f"state.{fqn}.step"] = step.clone()
            flat.update({f"param_groups.{fqn}.{k}": v for k, v in options.items()})
        return flat

    @torch.no_grad()
    def load_flat_state_dict(self, flat: dict[str, Any], fqns: list[str]) -> None:
        """Take this rank's slice of a state in the form `flat_state_dict` writes. Call it after
        loading the parameters: the slice this rank updates is a copy of them, taken again here."""
        self.reload_parameters()
        state: dict[str, torch.Tensor] = {"step": flat[f"state.{fqns[0]}.step"].detach().clone().float()}
        for name in ("exp_avg", "exp_avg_sq"):
            whole = torch.cat([_local(flat[f"state.{fqn}.{name}"]).reshape(-1).float() for fqn in fqns])
            state[name] = whole[self.start:self.stop].to(self.shard.device).clone()
        self.inner.state[self.shard] = state
        group = self.inner.param_groups[0]
        for k in group:
            if k != "params" and f"param_groups.{fqns[0]}.{k}" in flat:
                group[k] = flat[f"param_groups.{fqns[0]}.{k}"]


def _like(parameter: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as the same kind of tensor as ``parameter`` (a DTensor shard placed like it)."""
    if isinstance(parameter, DTensor):
        return DTensor.from_local(local, parameter.device_mesh, parameter.placements, run_check=False,
                                  shape=parameter.shape, stride=parameter.stride())
    return local

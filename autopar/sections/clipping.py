"""The optimizer step: learning-rate schedule, gradient clipping by the global norm, update.

The global norm is the L2 norm of the whole model's gradient, what one process computes with
``torch.nn.utils.clip_grad_norm_`` on the unsharded model. Each rank adds up the squares of the
gradient elements it is the one to count (`counts_here`): of the ranks holding the same elements
(copies over data-, tensor- or context-parallel ranks, the Replicate dims of a DTensor), the one
at coordinate 0 of every axis that copies it; different elements (Shard dims of a DTensor, other
pipeline stages, other experts or expert slices) count where they are. A weight tied across
pipeline stages (GPT's embedding and head, whose copies `TiedGradientSync` made equal) counts on
its first stage only. One all-reduce over the world sums them (float64); every gradient is then
scaled by min(1, max_norm / (norm + 1e-6)), as torch does.
"""
from __future__ import annotations

from typing import AbstractSet, Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from autopar.sections.mesh import axis_names, coordinate_on
from autopar.sections.optimizer import _local, learning_rate, set_learning_rate
from autopar.sections.pipeline import _layer_of


def step_optimizer(parallel: Any, training: Any, config: Any, step: int,
                   named: list[tuple[str, nn.Parameter]]) -> None:
    """Set step ``step``'s learning rate, clip the gradients (when training.optimizer's
    max_grad_norm > 0), and step; the norm and the rate are left on ``parallel`` (grad_norm, lr)
    for the step's record. An optimizer that reduces gradients itself (gradient_sync.py) clips
    between its reduction and its update (``before_step``)."""
    settings = training.optimizer
    lr = learning_rate(step, training.steps, settings)
    set_learning_rate(parallel.optimizer, lr)
    max_norm = float(settings.get("max_grad_norm", 0.0) or 0.0)
    clip: Callable[[], torch.Tensor] | None = None
    if max_norm > 0:
        skipped = tied_copies_counted_elsewhere(config, parallel.mesh)

        def clip() -> torch.Tensor:
            return clip_gradients(named, max_norm, parallel.mesh, parallel.experts, skipped)

    if getattr(parallel.optimizer, "reduces_gradients", False):
        norm = parallel.optimizer.step(before_step=clip)
    else:
        norm = clip() if clip is not None else None
        parallel.optimizer.step()
    parallel.grad_norm, parallel.lr = norm, lr


def tied_copies_counted_elsewhere(config: Any, mesh: DeviceMesh) -> set[str]:
    """Names of tied parameters this rank holds whose gradient counts on an earlier pipeline rank
    (the tied group's copies there are equal to this rank's after `TiedGradientSync`)."""
    if not config.dims.pp_enabled:
        return set()
    me = mesh["pp"].get_local_rank()
    skipped: set[str] = set()
    for names in config.tied_parameters:
        owners = {index % config.dims.pp for index, layers in enumerate(config.stages)
                  for name in names if _layer_of(name, layers) is not None}
        if owners and min(owners) != me:
            skipped.update(names)
    return skipped


@torch.no_grad()
def clip_gradients(named: list[tuple[str, nn.Parameter]], max_norm: float, mesh: DeviceMesh, experts: Any = None,
                   skipped: AbstractSet[str] = frozenset()) -> torch.Tensor:
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)) where norm is the global L2 norm
    (see the module docstring), with one all-reduce over every rank; returns the norm.

    Args:
        named: this rank's parameters under their FQNs in the unsharded model (ties under each).
        max_norm: the largest norm kept.
        mesh: the full DeviceMesh.
        experts: this rank's ExpertShards (expert or expert-width slices), or None.
        skipped: names counted on another pipeline rank (`tied_copies_counted_elsewhere`).
    """
    square_sum = torch.zeros((), dtype=torch.float64, device=_device(mesh))
    grads: dict[int, torch.Tensor] = {}
    counted: set[int] = set()  # a tensor under several names (a tie within one stage) counts once
    for name, parameter in named:
        grad = parameter.grad
        if grad is None:
            continue
        grads[id(parameter)] = grad
        if name in skipped or id(parameter) in counted:
            continue
        counted.add(id(parameter))
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            grad = grad.redistribute(grad.device_mesh, [Replicate() if p.is_partial() else p for p in grad.placements])
        if counts_here(mesh, _distinct_groups(name, grad, experts)):
            square_sum += torch.linalg.vector_norm(_local(grad), dtype=torch.float64).square()
    dist.all_reduce(square_sum)
    norm = square_sum.sqrt()
    coefficient = torch.clamp(max_norm / (norm.float() + 1e-6), max=1.0)
    for grad in grads.values():
        local = _local(grad)
        local.mul_(coefficient.to(local.device, local.dtype))
    return norm


def _device(mesh: DeviceMesh) -> torch.device:
    return torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" \
        else torch.device(mesh.device_type)


def _distinct_groups(name: str, grad: torch.Tensor, experts: Any) -> list[list[int]]:
    """Groups of global ranks through this one that hold different elements of ``grad``: each
    Shard dim of a DTensor, the expert-parallel group for an expert's slice, the
    tensor-parallel group for an expert's width slice."""
    groups: list[list[int]] = []
    if isinstance(grad, DTensor):
        sub = grad.device_mesh
        coordinate = coordinate_on(sub)
        for dim, placement in enumerate(grad.placements):
            if splits(placement):
                index: list[int | slice] = list(coordinate)
                index[dim] = slice(None)
                groups.append(sub.mesh[tuple(index)].reshape(-1).tolist())
    if experts is not None and name in experts.names:
        if experts.ep > 1:
            groups.append(dist.get_process_group_ranks(experts.group))
        if name in experts.widths and experts.tp > 1:
            groups.append(dist.get_process_group_ranks(experts.tp_group))
    return groups


def splits(placement: Any) -> bool:
    """Whether a DTensor placement divides the tensor among the ranks of its mesh dim: Shard, or
    FSDP's strided shard of a dim TP already split (a class of its own, not a Shard)."""
    return isinstance(placement, Shard) or hasattr(placement, "split_factor")


def counts_here(mesh: DeviceMesh, distinct: list[list[int]]) -> bool:
    """Whether this rank counts its elements of a gradient: along every mesh axis but pp, the
    rank at coordinate 0 (with this rank's other coordinates) is this one or holds different
    elements of it (is in a group of ``distinct``); otherwise that rank holds this rank's
    elements and counts them. Along an axis split into expert groups, the first group counts."""
    grid, coordinate = mesh.mesh, coordinate_on(mesh)
    different = {dist.get_rank()}.union(*distinct)
    for axis, axis_name in enumerate(axis_names(mesh)):
        if axis_name == "pp" or grid.shape[axis] == 1:
            continue
        first = list(coordinate)
        first[axis] = 0
        if int(grid[tuple(first)]) not in different:
            return False
    return True

"""Data parallelism and ZeRO: FSDP2 ``fully_shard`` on the data-parallel axes.

ZeRO stage -> what is sharded over the shard group (``dp_shard`` ranks):
    3: parameters, gradients and optimizer state; parameters re-gathered for backward
    2: gradients and optimizer state; parameters stay gathered from forward to backward
    1: optimizer state only (parameters replicated; see optimizer.py)
    0: nothing (every rank holds everything; gradients all-reduced, as DDP does)
Stages 0 and 1 use the same ``fully_shard`` machinery on a shard group of one rank, so
gradient averaging works the same way alongside tensor and pipeline parallelism. With context
parallelism the shard group spans data- x context-parallel ranks (ZeRO-2/3 only: FSDP cannot
replicate over a group that interleaves other mesh axes, so the planner pairs CP with ZeRO >= 2).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from autopar.sections.mesh import MeshAxis, ParallelDims, axis_names
from autopar.sections.contract import holds_parameters


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, groups: list[list[str]], reshard_after_forward: bool,
               param_dtype: torch.dtype | None, root: nn.Module | None = None,
               ignored: set[nn.Parameter] | None = None) -> None:
    """Shard parameters over the data-parallel mesh, one communication group per entry of ``groups``.

    FSDP goes bottom-up: each transformer block is its own group (its parameters are gathered
    just before it runs and freed after), then the final norm and head together, then the
    root, which takes every parameter not yet grouped (embeddings).

    Args:
        model: the model or pipeline stage (applied after TP and activation checkpointing).
        dp_mesh: 1-D (FSDP) or 2-D (replicate, shard: hybrid) data-parallel mesh.
        groups: module FQNs per group, bottom-up; modules ``model`` does not hold are skipped,
            and so is a module sharing a parameter with one outside its group (a tied head).
        reshard_after_forward: True for ZeRO-3, False for ZeRO-0/1/2.
        param_dtype: dtype parameters are gathered and computed in (bf16 on GPUs), or None.
        root: the module wrapped last (a pipeline stage around ``model``); default ``model``.
        ignored: parameters FSDP leaves alone (expert slices of a traced pipeline stage).
    """
    mp_policy = (MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype
                 else MixedPrecisionPolicy())
    # FSDP cannot shard a 0-dim parameter (CLIP's logit_scale): it stays whole on every rank and
    # its gradient is averaged over the same ranks as FSDP averages the others'.
    scalars = {p for p in (root if root is not None else model).parameters() if p.dim() == 0}
    left = scalars | (ignored or set())
    for group in groups:
        modules = [model.get_submodule(name) for name in group if holds_parameters(model, name)]
        modules = [m for m in modules if not _shares_parameters_outside(model, m, modules)]
        if modules:
            fully_shard(modules if len(modules) > 1 else modules[0], mesh=dp_mesh,
                        reshard_after_forward=reshard_after_forward, mp_policy=mp_policy, ignored_params=left or None)
    # The root's parameters are needed first in backward, so they are never resharded early.
    fully_shard(root if root is not None else model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp_policy,
                ignored_params=left or None)
    for parameter in scalars:
        if parameter.requires_grad:
            parameter.register_hook(averaged_over(dp_mesh))


def averaged_over(mesh: DeviceMesh) -> Callable[[torch.Tensor], torch.Tensor]:
    """A gradient hook averaging each micro-batch's gradient over every rank of ``mesh`` (summed
    per mesh dimension: gloo has no average), as FSDP averages the parameters it shards."""
    def average(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        for dim in range(mesh.ndim):
            dist.all_reduce(grad, group=mesh.get_group(dim))
        return grad / mesh.size()
    return average


def dp_mesh_of(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The mesh gradients are averaged over, as FSDP takes it: 2-D (replicate, shard) when ranks
    replicate shard groups, else 1-D. Context-parallel ranks join the shard group (they hold
    the same parameters and see other tokens), flattened with it into one axis."""
    if not dims.cp_enabled:
        if dims.dp_replicate > 1:
            return mesh[MeshAxis.DP_REPLICATE.value, MeshAxis.DP_SHARD.value]
        return mesh[MeshAxis.DP_SHARD.value]
    names = axis_names(mesh)
    pair = tuple(sorted((MeshAxis.DP_SHARD.value, MeshAxis.CP.value), key=names.index))
    # Private, but the only route: torch 2.13 has no public DeviceMesh flatten, and a second mesh
    # over the same ranks would not do (FSDP wants its mesh and TP's to share one root mesh).
    flattened = mesh[pair]._flatten("dp_shard_cp")
    if dims.dp_replicate > 1:
        return mesh[MeshAxis.DP_REPLICATE.value, "dp_shard_cp"]
    return flattened


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip (or resume) the gradient reduction of a FSDP-wrapped model, for accumulation."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def _shares_parameters_outside(model: nn.Module, module: nn.Module, group: list[nn.Module]) -> bool:
    """Whether a module outside ``group`` holds one of ``module``'s parameters (a tie), which
    FSDP cannot shard in two groups."""
    mine = {id(p) for p in module.parameters()}
    inside = {id(sub) for m in group for sub in m.modules()}
    return any(id(p) in mine for other in model.modules() if id(other) not in inside
               for p in other.parameters(recurse=False))

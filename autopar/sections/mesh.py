"""Parallel degrees and the DeviceMesh they name."""
from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class MeshAxis(str, Enum):
    """Names of the DeviceMesh axes. Data parallelism has two: replicas of a shard group
    (hybrid sharding across nodes) and the shard group itself (ZeRO inside it)."""

    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    PP = "pp"
    CP = "cp"
    TP = "tp"


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees of a plan and the order of its mesh axes.

    Attributes:
        dp_replicate: data-parallel replicas (each holding a full copy of what its shard group holds).
        dp_shard: ranks a ZeRO shard group spreads parameters/gradients/optimizer state over.
        pp, cp, tp: pipeline, context and tensor-parallel degrees.
        mesh_order: axes innermost (fastest links) first, e.g. ("tp", "cp", "pp", "dp").
    """

    dp_replicate: int
    dp_shard: int
    pp: int
    cp: int
    tp: int
    mesh_order: tuple[str, ...]

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.pp * self.cp * self.tp

    def check_world_size(self, started: int) -> None:
        """Refuse to run on a different number of ranks than the plan was made for."""
        if started != self.world_size:
            raise ValueError(f"the plan needs {self.world_size} ranks (dp={self.dp} pp={self.pp} cp={self.cp} "
                             f"tp={self.tp}) but {started} were started; launch with --nnodes x "
                             f"--nproc-per-node = {self.world_size}")

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def grad_sync_enabled(self) -> bool:
        """Whether gradients are averaged across ranks: data-parallel ranks see other samples,
        context-parallel ranks other tokens of the same samples."""
        return self.dp * self.cp > 1

    def mesh_axes(self) -> tuple[tuple[str, int], ...]:
        """(axis, size) outermost first, as DeviceMesh wants; "dp" expands to replicate, shard."""
        axes: list[tuple[str, int]] = []
        for name in reversed(self.mesh_order):
            if name == "dp":
                axes += [(MeshAxis.DP_REPLICATE.value, self.dp_replicate), (MeshAxis.DP_SHARD.value, self.dp_shard)]
            else:
                axes.append((name, getattr(self, name)))
        return tuple(axes)


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """One DeviceMesh over all ranks with a named axis per parallelism.

    Rank r sits at the coordinate of r in ``arange(world_size).reshape(shape)``: the innermost
    axis (last) holds neighbouring ranks, which share the fastest links.

    Args:
        dims: the plan's degrees and axis order.
        device_type: "cuda" (NCCL) or "cpu" (gloo).
    """
    axes = dims.mesh_axes()
    return init_device_mesh(device_type, tuple(size for _, size in axes),
                            mesh_dim_names=tuple(name for name, _ in axes))


def axis_names(mesh: DeviceMesh) -> tuple[str, ...]:
    """The mesh's axis names (every mesh and sub-mesh of the plan is built with them)."""
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError("a mesh without axis names: build it with build_mesh")
    return names


def coordinate_on(mesh: DeviceMesh) -> list[int]:
    """This rank's coordinate on the mesh (every rank of the world is on the plan's mesh)."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("this rank is not on the mesh")
    return list(coordinate)


def dp_rank(mesh: DeviceMesh, dims: ParallelDims) -> int:
    """This rank's index among the data-parallel ranks (which slice of the batch it trains on)."""
    return (mesh[MeshAxis.DP_REPLICATE.value].get_local_rank() * dims.dp_shard
            + mesh[MeshAxis.DP_SHARD.value].get_local_rank())


def pick_device() -> tuple[torch.device, str]:
    """(device, process-group backend): the local GPU with NCCL when there is one, else CPU/gloo."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"

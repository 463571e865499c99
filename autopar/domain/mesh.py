"""Mesh arithmetic, in one place: where each rank sits on the parallel axes.

Axes are listed innermost (consecutive ranks, fastest links) to outermost in `order`; rank r's
coordinate on an axis is (r // stride) % degree, the innermost axis having stride 1 and each
next axis the product of the degrees inside it. This is `torch.arange(world).reshape(shape)`
with the shape outermost first (DeviceMesh's order), so a generated DeviceMesh and the cost
model agree on which ranks form each group. Every module that needs a stride, a coordinate or a
group's ranks asks `Mesh` (a test greps the packages for arithmetic written elsewhere).

    mesh = Mesh.of(plan)               # anything with mesh_order and degree(axis)
    mesh.coordinate(5, "pp"); mesh.group_ranks(("dp", "cp")); mesh.shape()
    mesh.block_ranks("dp", 2)          # the expert-parallel group of ep=2 through rank 0
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any


@dataclass(frozen=True)
class Mesh:
    """Degrees of the mesh axes in rank order.

    Attributes:
        order: axis names innermost -> outermost.
        degrees: the degree of each axis of `order`, in the same order.
    """

    order: tuple[str, ...]
    degrees: tuple[int, ...]

    @classmethod
    def of(cls, layout: Any) -> "Mesh":
        """The mesh of a plan or layout (anything with `mesh_order` and `degree(axis)`)."""
        order = tuple(str(axis) for axis in layout.mesh_order)
        return cls(order, tuple(layout.degree(axis) for axis in order))

    @classmethod
    def from_degrees(cls, order: tuple[str, ...], degrees: dict[str, int]) -> "Mesh":
        return cls(tuple(order), tuple(degrees[axis] for axis in order))

    @property
    def world_size(self) -> int:
        return math.prod(self.degrees)

    @cached_property
    def _degree_of(self) -> dict[str, int]:
        return dict(zip(self.order, self.degrees))

    @cached_property
    def _strides(self) -> dict[str, int]:
        strides, stride = {}, 1
        for axis, degree in zip(self.order, self.degrees):
            strides[axis] = stride
            stride *= degree
        return strides

    def degree(self, axis: str) -> int:
        return self._degree_of[axis]

    def strides(self) -> dict[str, int]:
        """Rank stride of each axis (the innermost has stride 1)."""
        return dict(self._strides)

    def stride(self, axis: str) -> int:
        return self._strides[axis]

    def coordinate(self, rank: int, axis: str) -> int:
        """Rank's index along one axis."""
        return (rank // self.stride(axis)) % self.degree(axis)

    def coordinates(self, rank: int) -> dict[str, int]:
        """Rank's index along every axis, innermost first."""
        return {axis: (rank // stride) % self.degree(axis) for axis, stride in self.strides().items()}

    def group_ranks(self, axes: str | tuple[str, ...], rank: int = 0) -> list[int]:
        """Ranks of the group through `rank` spanned by one axis or several, sorted."""
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        strides = self._strides
        base = rank - sum(self.coordinate(rank, axis) * strides[axis] for axis in axes) if rank else 0
        ranks = [base]
        for axis in axes:
            ranks = [r + i * strides[axis] for r in ranks for i in range(self.degree(axis))]
        return sorted(ranks)

    def groups(self, axes: str | tuple[str, ...]) -> list[list[int]]:
        """Every group spanned by `axes`, each sorted, in order of their lowest rank."""
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        firsts = [0]  # the ranks at coordinate 0 on `axes`: one per group
        for axis in self.order:
            if axis not in axes:
                firsts = [r + i * self._strides[axis] for r in firsts for i in range(self._degree_of[axis])]
        return [self.group_ranks(axes, rank) for rank in sorted(firsts)]

    def block_ranks(self, axes: str | tuple[str, ...], size: int, rank: int = 0) -> list[int]:
        """The group of `axes` through `rank` cut into consecutive blocks of `size` ranks in rank
        order: the block holding `rank` (expert-parallel groups are such blocks of a
        data-parallel group, as Megatron-Core cuts them)."""
        ranks = self.group_ranks(axes, rank)
        start = ranks.index(rank) // size * size
        return ranks[start:start + size]

    def blocks(self, axes: str | tuple[str, ...], size: int) -> list[list[int]]:
        """Every block of `size` of every group of `axes` (each sorted, by lowest rank)."""
        return sorted(group[i:i + size] for group in self.groups(axes) for i in range(0, len(group), size))

    def nodes_of(self, axis: str, gpus_per_node: int) -> list[int]:
        """Nodes the group of `axis` through rank 0 touches."""
        return sorted({rank // gpus_per_node for rank in self.group_ranks(axis)})

    def group_bases(self, axes: str | tuple[str, ...], gpus_per_node: int) -> list[int]:
        """The first rank of one group of `axes` per distinct offset from a node's first rank,
        the lowest of each: groups at the same offset cross the same node boundaries. One base
        (rank 0) when every group sits as rank 0's does; with degrees that do not divide the
        node (tp=3 on 8-GPU nodes), groups {0,1,2} and {6,7,8} do not."""
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        if self.tiles_nodes(gpus_per_node):
            return [0]
        bases = {0: 0}
        for axis in self.order:
            if axis in axes:
                continue
            stride = self._strides[axis]
            spread: dict[int, int] = {}
            # i * stride modulo the node repeats within gpus_per_node steps of i.
            for base in bases.values():
                for i in range(min(self._degree_of[axis], gpus_per_node)):
                    rank = base + i * stride
                    if rank % gpus_per_node not in spread or rank < spread[rank % gpus_per_node]:
                        spread[rank % gpus_per_node] = rank
            bases = spread
        return sorted(bases.values())

    def tiles_nodes(self, gpus_per_node: int) -> bool:
        """Whether every group of every axis sits on the nodes as rank 0's does: each product of
        the innermost degrees divides the node or is a multiple of it (powers of two on 8-GPU
        nodes), so groups tile the nodes alike."""
        inner = 1
        for degree in self.degrees:
            inner *= degree
            if gpus_per_node % inner and inner % gpus_per_node:
                return False
        return True

    def span(self, axis: str, gpus_per_node: int) -> tuple[int, int]:
        """(nodes spanned, ranks per node) of the group of `axis` spanning the most nodes."""
        size = self.degree(axis)
        if size == 1:
            return (1, 1)
        stride = self.stride(axis)
        # A group's ranks are base + i * stride for i < size. With stride >= gpus_per_node each
        # lands on its own node; with a smaller stride consecutive ranks' nodes differ by at most
        # one, so the nodes are the contiguous range from the base's to the last rank's (counted,
        # not listed: a data-parallel group can have millions of ranks).
        if stride >= gpus_per_node:
            return (size, 1)
        nodes = max((base % gpus_per_node + (size - 1) * stride) // gpus_per_node + 1
                    for base in self.group_bases(axis, gpus_per_node))
        return (nodes, size // nodes)

    def shape(self) -> tuple[int, ...]:
        """Degrees outermost first (DeviceMesh order)."""
        return tuple(reversed(self.degrees))

    def dim_names(self) -> tuple[str, ...]:
        """Axis names outermost first (DeviceMesh order)."""
        return tuple(reversed(self.order))

    def rank_grid(self) -> list:
        """Nested lists of ranks in DeviceMesh order: rank r sits at its coordinate."""
        import torch

        return torch.arange(self.world_size).reshape(self.shape()).tolist()


def mesh_of(layout: Any) -> Mesh:
    """A layout's mesh: the one a ParallelLayout computed once, else computed here (a Plan, or
    anything with `mesh_order` and `degree(axis)`)."""
    mesh = getattr(layout, "mesh", None)
    return mesh if isinstance(mesh, Mesh) else Mesh.of(layout)

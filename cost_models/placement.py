"""Where a layout's groups sit and what their collectives cost: the gradient, shard and replica
groups, the GPU types of each pipeline and data-parallel rank (`LayoutGroups`, the pricer's
`groups`), and how a mixed cluster shares a batch by speed (`proportional_shares`).

Mesh arithmetic itself is `autopar.domain.mesh`'s.
"""
from __future__ import annotations

from typing import Any

from cost_models.collectives import Collective, collective_time_s
from cost_models.hardware import GPUSpec
from autopar.domain.layout import ParallelLayout
from autopar.domain.mesh import mesh_of
from cost_models.topology import ClusterSpec, GroupPlacement



def proportional_shares(weights: list[float], total: int) -> tuple[int, ...]:
    """Integers summing to `total`, at least 1 each, proportional to `weights` (largest
    remainder: the shares furthest below their ideal get the leftover units)."""
    ideal = [total * w / sum(weights) for w in weights]
    shares = [max(1, int(x)) for x in ideal]
    while sum(shares) > total:
        shares[max(range(len(shares)), key=lambda i: shares[i] - ideal[i])] -= 1
    while sum(shares) < total:
        shares[max(range(len(shares)), key=lambda i: ideal[i] - shares[i])] += 1
    return tuple(shares)



class LayoutGroups:
    """Where a layout's groups sit on one cluster, and what a collective over one costs: built from
    the cluster alone, cached per mesh (the planner asks the same questions of many layouts)."""

    def __init__(self, cluster: ClusterSpec):
        self.cluster = cluster
        self.homogeneous = cluster.homogeneous
        self._placements: dict[tuple, GroupPlacement] = {}
        self._rank_gpus: dict[Any, list] = {}
        self._collectives: dict[tuple, float] = {}

    def placement(self, layout: ParallelLayout, axes: str | tuple[str, ...]) -> GroupPlacement:
        """Where the slowest group along one mesh axis (or several) sits: the one spanning the
        most nodes with the fewest ranks on one of them (every group waits for it). The group
        through rank 0 where all groups sit alike."""
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        if axes == ("ep",):
            return self.expert_group(layout)
        key = (axes, mesh_of(layout))
        if key not in self._placements:
            mesh = mesh_of(layout)
            placements = [self.cluster.group_links(mesh.group_ranks(axes, base))
                          for base in mesh.group_bases(axes, self.cluster.gpus_per_node)]
            self._placements[key] = max(placements, key=lambda group: (group.nodes, -group.min_per_node))
        return self._placements[key]

    def expert_group(self, layout: ParallelLayout) -> GroupPlacement:
        """The expert-parallel group through rank 0: the first ep ranks of its data-parallel
        group, in rank order (ep consecutive data-parallel ranks, as the generated code cuts them;
        cost_models.expert_parallel)."""
        key = ("ep", layout.ep, mesh_of(layout))
        if key not in self._placements:
            self._placements[key] = self.cluster.group_links(mesh_of(layout).block_ranks(("dp", "cp"), layout.ep))
        return self._placements[key]

    def grad_group(self, layout: ParallelLayout) -> GroupPlacement:
        """Ranks holding the same parameters: data- x context-parallel (CP ranks see other
        tokens, so their gradients are summed too)."""
        return self.placement(layout, ("dp", "cp"))

    @staticmethod
    def grad_size(layout: ParallelLayout) -> int:
        return layout.dp * layout.cp

    def shard_size(self, layout: ParallelLayout) -> int:
        """Ranks ZeRO shards over: the gradient group, or its part on one node (hybrid)."""
        return self.shard_group(layout).size

    def shard_group(self, layout: ParallelLayout) -> GroupPlacement:
        if not layout.hybrid_shard:
            return self.grad_group(layout)
        key = ("shard", mesh_of(layout))
        if key not in self._placements:
            ranks = mesh_of(layout).group_ranks(("dp", "cp"))
            self._placements[key] = self.cluster.group_links(
                [r for r in ranks if r // self.cluster.gpus_per_node == 0])
        return self._placements[key]

    def replica_group(self, layout: ParallelLayout) -> GroupPlacement:
        """Hybrid sharding's replicas: one rank per node of the gradient group."""
        key = ("replica", mesh_of(layout))
        if key not in self._placements:
            firsts: dict[int, int] = {}
            for rank in mesh_of(layout).group_ranks(("dp", "cp")):
                firsts.setdefault(rank // self.cluster.gpus_per_node, rank)
            self._placements[key] = self.cluster.group_links(sorted(firsts.values()))
        return self._placements[key]

    def pp_rank_gpus(self, layout: ParallelLayout) -> list[list[GPUSpec]]:
        """GPU types of the ranks of each pipeline rank (callers take their set, min or max: on a
        one-type cluster each pipeline rank lists its type once)."""
        key = mesh_of(layout)
        if key not in self._rank_gpus and self.homogeneous:
            # No need to walk every rank (16,384 of them at frontier scale).
            self._rank_gpus[key] = [[self.cluster.node_gpus[0]] for _ in range(layout.pp)]
        if key not in self._rank_gpus:
            mesh = mesh_of(layout)
            groups: list[list[GPUSpec]] = [[] for _ in range(layout.pp)]
            for rank in range(layout.world_size):
                groups[mesh.coordinate(rank, "pp")].append(self.cluster.gpu_of_rank(rank))
            self._rank_gpus[key] = groups
        return self._rank_gpus[key]

    def dp_rank_gpus(self, layout: ParallelLayout) -> list[GPUSpec]:
        """GPU type of each data-parallel rank (its first rank: TP groups are one type)."""
        key = ("dp", mesh_of(layout))
        if key not in self._rank_gpus:
            self._rank_gpus[key] = [self.cluster.gpu_of_rank(r) for r in mesh_of(layout).group_ranks("dp")]
        return self._rank_gpus[key]

    def tp_groups_homogeneous(self, layout: ParallelLayout) -> bool:
        """A TP group never mixes GPU types (its ranks run in lockstep on sharded work)."""
        if self.homogeneous:
            return True
        return all(len({self.cluster.gpu_of_rank(rank).name for rank in group}) == 1
                   for group in mesh_of(layout).groups("tp"))

    def span(self, layout: ParallelLayout, axes: str | tuple[str, ...]) -> tuple[int, int, int, int]:
        """A cheap cache key for a group's placement."""
        group = self.placement(layout, axes)
        return (group.size, group.nodes, group.per_node, group.min_per_node)

    def collective_s(self, op: Collective, nbytes: float, group: GroupPlacement) -> float:
        """Cheapest-algorithm time, memoised."""
        key = (op, nbytes, group)
        if key not in self._collectives:
            self._collectives[key] = collective_time_s(op, nbytes, group)
        return self._collectives[key]

"""Alpha-beta cost of collectives under each algorithm, and the cheapest choice.

Conventions follow NVIDIA nccl-tests (doc/PERFORMANCE.md): `nbytes` is the buffer size S of
the operation (all-reduce: the buffer; all-gather: the gathered output; reduce-scatter: the
input; all-to-all: one rank's send buffer), algbw = S / t and busbw = algbw × factor with
factor 2(n-1)/n for all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for
broadcast/reduce/send. With per-message latency α and link bandwidth B:

    ring all-reduce           2(n-1)·α + 2(n-1)/n · S/B          (Patarasuk & Yuan 2009)
    ring all-gather / r-s     (n-1)·α + (n-1)/n · S/B
    tree all-reduce           2·⌈log2 n⌉·α + 2·S/B               (NCCL double binary tree:
                                                                   log-depth latency, no 1/n gain)
    halving-doubling a-r      2·⌈log2 n⌉·α + 2(n-1)/n · S/B      (Rabenseifner, Thakur et al. 2005)
    hierarchical a-r          intra reduce-scatter + inter all-reduce of S/g + intra all-gather
    parameter server a-r      2(n-1)·α + 2(n-1)·S/B at the server (it receives n-1 gradients and
                              sends n-1 copies back, one message each: O(N) traffic, the classic
                              bottleneck of Li et al. 2014's design once workers outnumber servers)
    broadcast / reduce        ⌈log2 n⌉·α + S/B (pipelined)
    scatter / gather          (n-1)·α + (n-1)/n · S/B
    all-to-all                (n-1)·α + (n-1)/n · S/B
    send / recv               α + S/B
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from cost_models.topology import GroupPlacement, Link


class Collective(StrEnum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    SCATTER = "scatter"
    GATHER = "gather"
    ALL_TO_ALL = "all_to_all"
    SEND_RECV = "send_recv"


class Algorithm(StrEnum):
    RING = "ring"
    TREE = "tree"
    HALVING_DOUBLING = "halving_doubling"
    HIERARCHICAL = "hierarchical"
    PARAMETER_SERVER = "ps"


BUSBW_FACTOR = {
    Collective.ALL_REDUCE: lambda n: 2 * (n - 1) / n,
    Collective.ALL_GATHER: lambda n: (n - 1) / n,
    Collective.REDUCE_SCATTER: lambda n: (n - 1) / n,
    Collective.ALL_TO_ALL: lambda n: (n - 1) / n,
    Collective.BROADCAST: lambda n: 1.0,
    Collective.REDUCE: lambda n: 1.0,
    Collective.SCATTER: lambda n: (n - 1) / n,
    Collective.GATHER: lambda n: (n - 1) / n,
    Collective.SEND_RECV: lambda n: 1.0,
}


def bus_bandwidth(op: Collective, n: int, nbytes: float, seconds: float) -> float:
    """nccl-tests' busbw for a measured time."""
    return nbytes / seconds * BUSBW_FACTOR[op](n)


@dataclass(frozen=True)
class CollectiveCost:
    op: Collective
    algorithm: Algorithm
    seconds: float


def flat_time_s(op: Collective, algorithm: Algorithm, nbytes: float, n: int, link: Link) -> float:
    """Time of a collective over n ranks on one link level."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    a, b = link.latency_s, link.bandwidth_Bps
    log_n = math.ceil(math.log2(n))
    if op is Collective.SEND_RECV:
        return a + nbytes / b
    if op is Collective.ALL_REDUCE:
        if algorithm is Algorithm.RING:
            return 2 * (n - 1) * a + 2 * (n - 1) / n * nbytes / b
        if algorithm is Algorithm.TREE:
            return 2 * log_n * a + 2 * nbytes / b
        if algorithm is Algorithm.HALVING_DOUBLING:
            return 2 * log_n * a + 2 * (n - 1) / n * nbytes / b
        if algorithm is Algorithm.PARAMETER_SERVER:
            return 2 * (n - 1) * a + 2 * (n - 1) * nbytes / b
    if op in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        if algorithm is Algorithm.HALVING_DOUBLING:
            return log_n * a + (n - 1) / n * nbytes / b
        return (n - 1) * a + (n - 1) / n * nbytes / b
    if op in (Collective.BROADCAST, Collective.REDUCE):
        return log_n * a + nbytes / b
    if op in (Collective.SCATTER, Collective.GATHER, Collective.ALL_TO_ALL):
        return (n - 1) * a + (n - 1) / n * nbytes / b
    raise ValueError(f"{algorithm} does not implement {op}")


def hierarchical_all_reduce_s(nbytes: float, group: GroupPlacement) -> float:
    """Intra-node reduce-scatter, inter-node all-reduce of each GPU's shard (every GPU drives
    its own NIC), intra-node all-gather."""
    g, k = group.per_node, group.nodes
    return (flat_time_s(Collective.REDUCE_SCATTER, Algorithm.RING, nbytes, g, group.intra)
            + flat_time_s(Collective.ALL_REDUCE, Algorithm.RING, nbytes / g, k, group.inter)
            + flat_time_s(Collective.ALL_GATHER, Algorithm.RING, nbytes, g, group.intra))


ALGORITHMS = {
    Collective.ALL_REDUCE: (Algorithm.RING, Algorithm.TREE, Algorithm.HALVING_DOUBLING, Algorithm.HIERARCHICAL,
                            Algorithm.PARAMETER_SERVER),
    Collective.ALL_GATHER: (Algorithm.RING, Algorithm.HALVING_DOUBLING),
    Collective.REDUCE_SCATTER: (Algorithm.RING, Algorithm.HALVING_DOUBLING),
}


def collective_time_s(op: Collective, nbytes: float, group: GroupPlacement,
                      algorithm: Algorithm | None = None) -> float:
    """Time of `op` on a placed group; the cheapest algorithm unless one is named."""
    if algorithm is None:
        return best_algorithm(op, nbytes, group).seconds
    if algorithm is Algorithm.HIERARCHICAL:
        if op is not Collective.ALL_REDUCE:
            raise ValueError("hierarchical is an all-reduce algorithm")
        if not group.crosses_nodes:
            return flat_time_s(op, Algorithm.RING, nbytes, group.size, group.intra)
        return hierarchical_all_reduce_s(nbytes, group)
    return flat_time_s(op, algorithm, nbytes, group.size, group.link)


def best_algorithm(op: Collective, nbytes: float, group: GroupPlacement,
                   allowed: tuple[Algorithm, ...] | None = None) -> CollectiveCost:
    """Cheapest algorithm for this size and group, as NCCL's tuner picks per message size."""
    options = allowed or ALGORITHMS.get(op, (Algorithm.RING,))
    costs = [CollectiveCost(op, algorithm, collective_time_s(op, nbytes, group, algorithm)) for algorithm in options
             if algorithm is not Algorithm.HIERARCHICAL or group.crosses_nodes]
    return min(costs, key=lambda cost: (cost.seconds, list(Algorithm).index(cost.algorithm)))


def parameter_server_load_bytes(nbytes: float, workers: int) -> float:
    """Bytes through the server's link for one gradient exchange (push + pull)."""
    return 2 * (workers - 1) * nbytes


def ring_per_worker_bytes(nbytes: float, workers: int) -> float:
    """Bytes each worker sends in a ring all-reduce: 2(N-1)/N · M, flat in N."""
    return 2 * (workers - 1) / workers * nbytes

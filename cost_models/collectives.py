"""Alpha-beta cost of collectives under each algorithm, and the cheapest choice.

Conventions follow NVIDIA nccl-tests (doc/PERFORMANCE.md): `nbytes` is the buffer size S of
the operation (all-reduce: the buffer; all-gather: the gathered output; reduce-scatter: the
input; all-to-all: one rank's send buffer; broadcast/reduce/scatter/gather: the root's buffer),
algbw = S / t and busbw = algbw x factor with factor 2(n-1)/n for all-reduce, (n-1)/n for
all-gather, reduce-scatter and all-to-all, 1 for broadcast, reduce and send/recv. With
per-message latency a and link bandwidth B (one direction):

    ring all-reduce          2(n-1)·a + 2(n-1)/n · S/B         (Patarasuk & Yuan 2009)
    tree all-reduce          2·ceil(log2 n)·a + 2·S/B           (NCCL's double binary tree,
                                                                 pipelined reduce + broadcast:
                                                                 log-depth latency, no 1/n gain;
                                                                 across exactly two nodes S/B:
                                                                 `tree_all_reduce_s`)
    halving-doubling a-r     2·log2 n·a + 2(n-1)/n · S/B         (Rabenseifner; Thakur, Rabenseifner
                                                                 & Gropp 2005 §4.4; a non-power-of-
                                                                 two n adds one exchange of S each
                                                                 way with the surplus ranks)
    hierarchical a-r         intra-node reduce-scatter (g ranks) + inter-node all-reduce of S/g
                             (k nodes, every GPU on its own NIC) + intra-node all-gather
    parameter server a-r     2(n-1)·a + 2(n-1)·S/B at the server: it receives n-1 gradients
                             and sends n-1 copies back through its one link, O(N) traffic
                             (Li et al. 2014, OSDI, with one server shard)
    ring all-gather / r-s    (n-1)·a + (n-1)/n · S/B
    broadcast / reduce       ceil(log2 n)·a + S/B                (pipelined tree)
    scatter / gather         (n-1)·a + (n-1)/n · S/B             (root sends / receives n-1 pieces)
    all-to-all               (n-1)·a + (n-1)/n · S/B             (pairwise exchange)
    send / recv              a + S/B

Which link B and a are depends on where the group sits (`GroupPlacement`): ring and tree
algorithms spanning nodes use one channel per NIC of the group's ranks on a node
(`GroupPlacement.ring_link`); all-to-all splits its traffic into the part leaving the node (one
NIC per GPU) and the part staying on it; point-to-point, scatter/gather and the parameter server
go through one rank's link.

At scale: a collective spanning k nodes sees the network's bandwidth times k^-fall, with one
fall for rings and one for trees, and a tree's bus bandwidth capped beyond two nodes, each fitted
per network to the published bus-bandwidth curve its preset names (`topology.NETWORKS`; EFA: the
Ultra-Scale Playbook's 1-64-node all-gather, reduce-scatter and all-reduce at 256 MB, with the
per-step latency a; InfiniBand and RoCE have no node-count curve: no fall, NCCL's tree cap).
NCCL's tuner picks ring or tree for an all-reduce by size and node count (`best_algorithm`: the
cheaper of the two as priced here); only its Simple protocol is priced (the low-latency LL and
LL128 protocols, which it picks for small messages, are not). Point-to-point traffic (pipeline
sends) is left at the NIC's rate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
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

# What each collective can run as. Automatic choice (`best_algorithm`) considers what NCCL's
# tuner chooses between for one call on a flat group: ring and tree for all-reduce, ring for the
# others. The two-level composition (autopar's generated `dp_sync=hierarchical`, several calls on
# sub-groups), halving-doubling (MPI, gloo) and the parameter server are priced when named.
ALGORITHMS = {
    Collective.ALL_REDUCE: (Algorithm.RING, Algorithm.TREE, Algorithm.HALVING_DOUBLING, Algorithm.HIERARCHICAL,
                            Algorithm.PARAMETER_SERVER),
    Collective.ALL_GATHER: (Algorithm.RING, Algorithm.HALVING_DOUBLING),
    Collective.REDUCE_SCATTER: (Algorithm.RING, Algorithm.HALVING_DOUBLING),
}
AUTO_ALGORITHMS = {
    Collective.ALL_REDUCE: (Algorithm.RING, Algorithm.TREE),
}


def bus_bandwidth(op: Collective, n: int, nbytes: float, seconds: float) -> float:
    """nccl-tests' busbw for a measured (or predicted) time."""
    return nbytes / seconds * BUSBW_FACTOR[Collective(op)](n)


@dataclass(frozen=True)
class CollectiveCost:
    """A priced collective: which algorithm and how long."""

    op: Collective
    algorithm: Algorithm
    seconds: float


def flat_time_s(op: Collective, algorithm: Algorithm, nbytes: float, n: int, link: Link) -> float:
    """Time of a collective over n ranks whose every message crosses `link`."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    a, b = link.alpha_beta(Collective(op).value)
    log_n = math.ceil(math.log2(n))
    power_of_two = n & (n - 1) == 0
    if op is Collective.SEND_RECV:
        return a + nbytes / b
    if op is Collective.ALL_REDUCE:
        if algorithm is Algorithm.RING:
            return 2 * (n - 1) * a + 2 * (n - 1) / n * nbytes / b
        if algorithm is Algorithm.TREE:
            return 2 * log_n * a + 2 * nbytes / b
        if algorithm is Algorithm.HALVING_DOUBLING:
            if power_of_two:
                return 2 * log_n * a + 2 * (n - 1) / n * nbytes / b
            core = 2 ** (log_n - 1)
            return 2 * (log_n - 1) * a + 2 * (core - 1) / core * nbytes / b + 2 * (a + nbytes / b)
        if algorithm is Algorithm.PARAMETER_SERVER:
            return 2 * (n - 1) * a + 2 * (n - 1) * nbytes / b
    if op in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        if algorithm is Algorithm.HALVING_DOUBLING:
            extra = 0.0 if power_of_two else a + nbytes / n / b
            return log_n * a + (n - 1) / n * nbytes / b + extra
        if algorithm is Algorithm.RING:
            return (n - 1) * a + (n - 1) / n * nbytes / b
    if op in (Collective.BROADCAST, Collective.REDUCE) and algorithm in (Algorithm.RING, Algorithm.TREE):
        return log_n * a + nbytes / b
    if op in (Collective.SCATTER, Collective.GATHER, Collective.ALL_TO_ALL) and algorithm is Algorithm.RING:
        return (n - 1) * a + (n - 1) / n * nbytes / b
    raise ValueError(f"{algorithm} does not implement {op}")


def hierarchical_all_reduce_s(nbytes: float, group: GroupPlacement) -> float:
    """Intra-node reduce-scatter, inter-node all-reduce of each GPU's 1/g shard (one rank per node,
    every GPU on its own NIC, k nodes: NCCL's ring or tree, whichever it prices cheaper),
    intra-node all-gather (Horovod's hierarchical all-reduce)."""
    g, k = group.per_node, group.nodes
    across = replace(group, size=k, per_node=1, min_per_node=1)
    return (flat_time_s(Collective.REDUCE_SCATTER, Algorithm.RING, nbytes, g, group.intra)
            + best_algorithm(Collective.ALL_REDUCE, nbytes / g, across).seconds
            + flat_time_s(Collective.ALL_GATHER, Algorithm.RING, nbytes, g, group.intra))


def all_to_all_s(nbytes: float, group: GroupPlacement) -> float:
    """Pairwise exchange: each rank sends S/n to every other; across nodes the off-node share
    (n - g)/n·S leaves through the rank's NIC while the on-node share uses the intra link."""
    n, g = group.size, group.per_node
    if not group.crosses_nodes:
        return flat_time_s(Collective.ALL_TO_ALL, Algorithm.RING, nbytes, n, group.intra)
    a_inter, b_inter = group.network.alpha_beta(Collective.ALL_TO_ALL.value)
    _, b_intra = group.intra.alpha_beta(Collective.ALL_TO_ALL.value)
    return (n - 1) * a_inter + max((n - g) / n * nbytes / b_inter, (g - 1) / n * nbytes / b_intra)


def collective_time_s(op: Collective, nbytes: float, group: GroupPlacement,
                      algorithm: Algorithm | None = None) -> float:
    """Time of `op` on a placed group; the cheapest automatic algorithm unless one is named."""
    op = Collective(op)
    if algorithm is None:
        return best_algorithm(op, nbytes, group).seconds
    algorithm = Algorithm(algorithm)
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    if algorithm is Algorithm.HIERARCHICAL:
        if op is not Collective.ALL_REDUCE:
            raise ValueError("hierarchical is an all-reduce algorithm")
        if not group.crosses_nodes or group.per_node == 1:
            return flat_time_s(op, Algorithm.RING, nbytes, group.size, group.ring_link)
        return hierarchical_all_reduce_s(nbytes, group)
    if op is Collective.ALL_TO_ALL:
        return all_to_all_s(nbytes, group)
    if algorithm is Algorithm.TREE and group.crosses_nodes:
        return tree_all_reduce_s(op, nbytes, group)
    one_rank = op in (Collective.SEND_RECV, Collective.SCATTER, Collective.GATHER) \
        or algorithm is Algorithm.PARAMETER_SERVER
    link = group.link if one_rank else group.ring_link
    return flat_time_s(op, algorithm, nbytes, group.size, link)


def tree_all_reduce_s(op: Collective, nbytes: float, group: GroupPlacement) -> float:
    """NCCL's double binary tree across nodes: 2·ceil(log2 n) latencies, and each node's NICs carry
    what its busiest position sends. Each of the two trees reduces and broadcasts S/2; beyond two
    nodes a node interior in one tree (two children) and a leaf in the other sends
    S/2 + S + S/2 = 2S, while across two nodes each tree is one edge and a node sends S/2 + S/2 = S."""
    if op is not Collective.ALL_REDUCE:
        return flat_time_s(op, Algorithm.TREE, nbytes, group.size, group.tree_link)
    a, b = group.tree_link.alpha_beta(op.value)
    per_node_bytes = nbytes if group.nodes == 2 else 2 * nbytes
    return 2 * math.ceil(math.log2(group.size)) * a + per_node_bytes / b


def best_algorithm(op: Collective, nbytes: float, group: GroupPlacement,
                   allowed: tuple[Algorithm, ...] | None = None) -> CollectiveCost:
    """Cheapest algorithm for this size and group, as NCCL's tuner picks one per message size
    (among `allowed`, default: the automatic candidates above)."""
    op = Collective(op)
    options = allowed or AUTO_ALGORITHMS.get(op) or ALGORITHMS.get(op, (Algorithm.RING,))[:1]
    costs = [CollectiveCost(op, algorithm, collective_time_s(op, nbytes, group, algorithm)) for algorithm in options
             if algorithm is not Algorithm.HIERARCHICAL or group.crosses_nodes]
    return min(costs, key=lambda cost: (cost.seconds, list(Algorithm).index(cost.algorithm)))


def parameter_server_load_bytes(nbytes: float, workers: int) -> float:
    """Bytes through the server's link for one gradient exchange (n-1 pushes + n-1 pulls)."""
    return 2 * (workers - 1) * nbytes


def ring_per_worker_bytes(nbytes: float, workers: int) -> float:
    """Bytes each worker sends in a ring all-reduce: 2(N-1)/N · M, flat in N."""
    return 2 * (workers - 1) / workers * nbytes

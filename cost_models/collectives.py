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
(`GroupPlacement.ring_link`), and of a ring's n - 1 steps only the nodes - 1 that cross a node
boundary pay the network's a, the others the intra-node link's (at least the network's per-step
overhead: `intra_step_saving_s`, NCCL's tuning model); all-to-all splits its traffic into the part leaving the node (one
NIC per GPU) and the part staying on it; point-to-point, scatter/gather and the parameter server
go through one rank's link.

At scale: a collective spanning k nodes sees the network's bandwidth times k^-fall, with one
fall for rings and one for trees, and a tree's bus bandwidth capped beyond two nodes, each fitted
per network to the published bus-bandwidth curve its preset names (`topology.NETWORKS`; EFA: the
Ultra-Scale Playbook's 1-64-node all-gather, reduce-scatter and all-reduce at 256 MB, with the
per-step latency a; InfiniBand and RoCE have no node-count curve: no fall, NCCL's tree cap).
Protocols: each NCCL call also runs one of three wire protocols (`Protocol`, `PROTOCOLS`): Simple
(the formulas above with the link's a and B: the presets' latencies are Simple's, fitted where
NCCL runs it), LL (a flag in every 8-byte word: a fraction of Simple's per-step latency and at
most half its bandwidth) and LL128 (a flag per 128-byte line: 120/128 of the bandwidth and a
latency between the two, only on paths that keep a line whole and in order: NVLink inside a
node, and networks whose `NetworkSpec.ll128` says so, InfiniBand and RoCE, not EFA). Their
shares are fitted to PUBLISHED.md E4's B200 busbw-vs-payload curves on 1 and 4 nodes
(benchmarks/bench_collectives.py). As NCCL's tuner does per call, `best_algorithm` prices every
(algorithm, protocol) pair it could run (ring or tree for an all-reduce, ring for the others)
and takes the cheapest; `best_protocol` does so for a named algorithm. Point-to-point traffic
(send/recv, and all-to-all, which NCCL runs as grouped sends) is not tuned: LL up to 16 KiB a
peer, Simple above. Halving-doubling and the parameter server (not NCCL's) and calibrated links
(whose measured a and B already hold NCCL's choice) are Simple. Pipeline sends keep the NIC's
rate (no fall with nodes). All-to-all is fitted to nothing published (`all_to_all_s` says why
its price is what it is) and counts as extrapolated across nodes (cost_models/uncertainty.py).
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


class Protocol(StrEnum):
    """NCCL's three wire protocols (how a step's data and its ready flag travel)."""

    LL = "LL"
    LL128 = "LL128"
    SIMPLE = "Simple"


@dataclass(frozen=True)
class ProtocolSpec:
    """What a protocol costs against Simple on the same link. The presets' per-step latencies are
    Simple's (fitted at 256 MB and above, where NCCL runs Simple); of each, the part that is
    Simple's synchronisation (at most SIMPLE_STEP_SYNC_S) shrinks to `step_latency_share` of itself,
    the rest (wire, NIC, switches, and what a network's fitted latency absorbs of congestion) every
    protocol pays. Data moves at `bandwidth_share` of the link's bandwidth."""

    step_latency_share: float
    bandwidth_share: float


# Fitted to PUBLISHED.md E4's all_reduce_bench busbw vs payload on 8 B200 (1 node, NVLink 5) and
# 4 nodes (P6-B200, EFA v4), 1 MiB to 16 GiB, with a per-call harness overhead (50 us fitted) and
# the per-step latency across EFA v4 (8 us fitted), rejecting constants that price any of D10's
# EFA collectives more than 3% faster than published: mean |log error| of busbw 12.4% over the
# 14 points (benchmarks/bench_collectives.py, `fit_protocols`, prints the fit and each payload's
# error with Simple alone and with the chosen protocol).
# - Simple: a memory fence, then a flag the receiver polls, per step: the presets' latency and
#   full bandwidth.
# - LL: a 4-byte flag beside each 4 bytes of data, written as one 8-byte store, so a step needs
#   no fence: its synchronisation shrinks to x0.2 (fitted; 4-node 1 MiB and 16 MiB decide it),
#   and half of every word is flag: half the bandwidth (the fit's best of 0.25, 0.35, 0.5).
# - LL128: one 8-byte flag per 128-byte line, so 120/128 of the bandwidth, and a latency between
#   the two: x0.8. E4 hardly decides it (EFA does not carry LL128, and on one NVLink node a step's
#   3 us leave little to save): from x0.4 to x1.0 the fit's error moves 12.4-13.3%; 0.8 is within
#   0.05 points of the best, and below 1 as NCCL's own tuning has it. It needs a path that keeps
#   each 128-byte line whole and in order (NVLink, and networks whose `NetworkSpec.ll128` says so).
# SIMPLE_STEP_SYNC_S is the part of a Simple step's latency the other protocols shorten (fitted:
# 4 us, the best of 4-12 us): capped, because a network's fitted per-step latency (43 us on EFA,
# D10) holds far more than synchronisation, and LL priced at a share of all of it undercuts D10's
# 256 MB rings over 32-64 nodes by up to 2.6x, where NCCL runs Simple.
SIMPLE_STEP_SYNC_S = 4e-6
LL_BANDWIDTH_SHARE = 0.5
LL_STEP_LATENCY_SHARE = 0.2
LL128_STEP_LATENCY_SHARE = 0.8
PROTOCOLS: dict[Protocol, ProtocolSpec] = {
    Protocol.LL: ProtocolSpec(step_latency_share=LL_STEP_LATENCY_SHARE, bandwidth_share=LL_BANDWIDTH_SHARE),
    Protocol.LL128: ProtocolSpec(step_latency_share=LL128_STEP_LATENCY_SHARE, bandwidth_share=120 / 128),
    Protocol.SIMPLE: ProtocolSpec(step_latency_share=1.0, bandwidth_share=1.0),
}
# Point-to-point traffic (send/recv, and all-to-all, which NCCL runs as grouped sends) is not
# tuned per size: NCCL sends a peer's message by LL up to 16 KiB (its NCCL_P2P_LL_THRESHOLD
# default) and by Simple above.
P2P_LL_THRESHOLD_BYTES = 16 * 2**10


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
    """A priced collective: which algorithm and protocol, and how long."""

    op: Collective
    algorithm: Algorithm
    seconds: float
    protocol: Protocol = Protocol.SIMPLE


def with_protocol(link: Link, protocol: Protocol) -> Link:
    """The link as `protocol` sees it: Simple's synchronisation in each step's latency (at most
    SIMPLE_STEP_SYNC_S) times the protocol's latency share, its bandwidth times its bandwidth share."""
    spec = PROTOCOLS[protocol]
    if protocol is Protocol.SIMPLE:
        return link
    saved_s = (1 - spec.step_latency_share) * min(link.latency_s, SIMPLE_STEP_SYNC_S)
    return replace(link.scaled(spec.bandwidth_share), latency_s=link.latency_s - saved_s)


def ll128_path(group: GroupPlacement) -> bool:
    """LL128 needs every hop to keep a 128-byte line whole and in order: NVLink inside the node and,
    across nodes, a network that does (`NetworkSpec.ll128`)."""
    if not group.intra.name.startswith("NVLink"):
        return False
    return not group.crosses_nodes or bool(group.inter.network and group.inter.network.ll128)


def protocols_for(op: Collective, algorithm: Algorithm, nbytes: float, group: GroupPlacement) -> tuple[Protocol, ...]:
    """The protocols NCCL could run `op` by `algorithm` with on this group. Calibrated links
    (per-collective alpha-beta measured by `autopar calibrate`) already include the protocol NCCL
    chose at each size, and halving-doubling and the parameter server are not NCCL's: Simple.
    Point-to-point traffic takes NCCL's fixed size threshold (P2P_LL_THRESHOLD_BYTES)."""
    if group.intra.per_collective or group.inter.per_collective \
            or algorithm in (Algorithm.HALVING_DOUBLING, Algorithm.PARAMETER_SERVER) \
            or op in (Collective.SCATTER, Collective.GATHER):
        return (Protocol.SIMPLE,)
    if algorithm is Algorithm.HIERARCHICAL and group.crosses_nodes and group.per_node > 1:
        return (Protocol.SIMPLE,)  # nominal: each of its three calls chooses its own (hierarchical_all_reduce_s)
    if op in (Collective.SEND_RECV, Collective.ALL_TO_ALL):
        per_peer = nbytes if op is Collective.SEND_RECV else nbytes / group.size
        return (Protocol.LL,) if per_peer <= P2P_LL_THRESHOLD_BYTES else (Protocol.SIMPLE,)
    if ll128_path(group):
        return Protocol.LL, Protocol.LL128, Protocol.SIMPLE
    return Protocol.LL, Protocol.SIMPLE


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
    node = replace(group, size=g, nodes=1, per_node=g, min_per_node=g, link=group.intra)
    return (collective_time_s(Collective.REDUCE_SCATTER, nbytes, node, Algorithm.RING)
            + best_algorithm(Collective.ALL_REDUCE, nbytes / g, across).seconds
            + collective_time_s(Collective.ALL_GATHER, nbytes, node, Algorithm.RING))


def all_to_all_s(nbytes: float, group: GroupPlacement, protocol: Protocol = Protocol.SIMPLE) -> float:
    """Pairwise exchange: each rank sends S/n to every other; across nodes the off-node share
    (n - g)/n·S leaves through the rank's NIC while the on-node share uses the intra link.

    Fitted to nothing: no all-to-all measurement is published (shared/PUBLISHED.md), so its price
    is the alpha-beta count above on the links the other collectives are fitted on: the NIC's
    bandwidth with the ring's fall over the nodes spanned (all-to-all crosses the same switches,
    and at least as many of them, as a ring over those nodes), and NCCL's point-to-point protocol
    (LL for a peer's message up to P2P_LL_THRESHOLD_BYTES, else Simple). Its groups across nodes
    count as extrapolated in the uncertainty interval (cost_models/uncertainty.py)."""
    n, g = group.size, group.per_node
    if not group.crosses_nodes:
        return flat_time_s(Collective.ALL_TO_ALL, Algorithm.RING, nbytes, n, with_protocol(group.intra, protocol))
    network = group.inter.across(group.nodes, op=Collective.ALL_TO_ALL.value)
    a_inter, b_inter = with_protocol(network, protocol).alpha_beta(Collective.ALL_TO_ALL.value)
    _, b_intra = with_protocol(group.intra, protocol).alpha_beta(Collective.ALL_TO_ALL.value)
    return (n - 1) * a_inter + max((n - g) / n * nbytes / b_inter, (g - 1) / n * nbytes / b_intra)


def collective_time_s(op: Collective, nbytes: float, group: GroupPlacement,
                      algorithm: Algorithm | None = None, protocol: Protocol | None = None) -> float:
    """Time of `op` on a placed group; the cheapest automatic algorithm unless one is named, and
    the cheapest protocol for it unless one is named."""
    op = Collective(op)
    if algorithm is None:
        return best_algorithm(op, nbytes, group).seconds
    return best_protocol(op, Algorithm(algorithm), nbytes, group, protocol).seconds


def best_protocol(op: Collective, algorithm: Algorithm, nbytes: float, group: GroupPlacement,
                  protocol: Protocol | None = None) -> CollectiveCost:
    """`op` by `algorithm` with the cheapest protocol NCCL could run it with (or the one named),
    as its tuner picks one per call from each protocol's latency and bandwidth."""
    options = (Protocol(protocol),) if protocol else protocols_for(op, algorithm, nbytes, group)
    costs = [CollectiveCost(op, algorithm, protocol_time_s(op, algorithm, p, nbytes, group), p) for p in options]
    return min(costs, key=lambda cost: (cost.seconds, list(Protocol).index(cost.protocol)))


def protocol_time_s(op: Collective, algorithm: Algorithm, protocol: Protocol, nbytes: float,
                    group: GroupPlacement) -> float:
    """Time of `op` by `algorithm` and `protocol` on a placed group."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    if algorithm is Algorithm.HIERARCHICAL:
        if op is not Collective.ALL_REDUCE:
            raise ValueError("hierarchical is an all-reduce algorithm")
        if not group.crosses_nodes or group.per_node == 1:
            return flat_time_s(op, Algorithm.RING, nbytes, group.size, with_protocol(group.ring_link, protocol))
        return hierarchical_all_reduce_s(nbytes, group)  # its three calls each choose a protocol
    if op is Collective.ALL_TO_ALL:
        return all_to_all_s(nbytes, group, protocol)
    if algorithm is Algorithm.TREE and group.crosses_nodes:
        return tree_all_reduce_s(op, nbytes, group, protocol)
    one_rank = op in (Collective.SEND_RECV, Collective.SCATTER, Collective.GATHER) \
        or algorithm is Algorithm.PARAMETER_SERVER
    link = group.link if one_rank else group.ring_link
    seconds = flat_time_s(op, algorithm, nbytes, group.size, with_protocol(link, protocol))
    if algorithm is Algorithm.RING and not one_rank:
        seconds -= intra_step_saving_s(op, group, protocol)
    return seconds


def ring_steps(op: Collective, ranks: int, nodes: int) -> tuple[int, int]:
    """A ring's steps, and how many of them cross a node boundary (NCCL's tuning model)."""
    if op is Collective.ALL_REDUCE:
        return 2 * (ranks - 1), 2 * (nodes - 1)
    return ranks - 1, nodes - 1


def intra_step_saving_s(op: Collective, group: GroupPlacement, protocol: Protocol) -> float:
    """What a ring spanning nodes saves on n - 1 network latencies (2(n - 1) for an all-reduce):
    NCCL's tuning model prices its steps apart, those crossing a node boundary (nodes - 1 of an
    all-gather's) at the network's latency and the others at the intra-node link's, but at least
    the network's per-step overhead (NetworkSpec.ring_step_overhead_s; three times that under
    Simple, as NCCL counts it). A ring over 280 nodes of 8 GPUs crosses a node in 279 of its
    2,239 all-gather steps. Fabrics whose per-step latency was fitted with every step at it
    (EFA: ring_step_overhead_s None), calibrated links and groups of one rank per node save
    nothing."""
    network = group.inter.network
    if (op not in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_REDUCE)
            or not group.crosses_nodes or group.per_node <= 1 or network is None
            or network.ring_step_overhead_s is None or group.intra.per_collective or group.inter.per_collective):
        return 0.0
    steps, crossing = ring_steps(op, group.size, group.nodes)
    network_step_s = with_protocol(group.ring_link, protocol).latency_s
    floor_s = network.ring_step_overhead_s * (3 if protocol is Protocol.SIMPLE else 1)
    intra_step_s = min(network_step_s, max(with_protocol(group.intra, protocol).latency_s, floor_s))
    return (steps - crossing) * (network_step_s - intra_step_s)


def tree_all_reduce_s(op: Collective, nbytes: float, group: GroupPlacement,
                      protocol: Protocol = Protocol.SIMPLE) -> float:
    """NCCL's double binary tree across nodes: 2·ceil(log2 n) latencies, and each node's NICs carry
    what its busiest position sends. Each of the two trees reduces and broadcasts S/2; beyond two
    nodes a node interior in one tree (two children) and a leaf in the other sends
    S/2 + S + S/2 = 2S, while across two nodes each tree is one edge and a node sends S/2 + S/2 = S."""
    link = with_protocol(group.tree_link, protocol)
    if op is not Collective.ALL_REDUCE:
        return flat_time_s(op, Algorithm.TREE, nbytes, group.size, link)
    a, b = link.alpha_beta(op.value)
    per_node_bytes = nbytes if group.nodes == 2 else 2 * nbytes
    return 2 * math.ceil(math.log2(group.size)) * a + per_node_bytes / b


def best_algorithm(op: Collective, nbytes: float, group: GroupPlacement,
                   allowed: tuple[Algorithm, ...] | None = None) -> CollectiveCost:
    """Cheapest (algorithm, protocol) pair for this size and group, as NCCL's tuner picks one per
    call (algorithms among `allowed`, default: the automatic candidates above)."""
    op = Collective(op)
    options = allowed or AUTO_ALGORITHMS.get(op) or ALGORITHMS.get(op, (Algorithm.RING,))[:1]
    costs = [best_protocol(op, algorithm, nbytes, group) for algorithm in options
             if algorithm is not Algorithm.HIERARCHICAL or group.crosses_nodes]
    return min(costs, key=lambda cost: (cost.seconds, list(Algorithm).index(cost.algorithm)))


def parameter_server_load_bytes(nbytes: float, workers: int) -> float:
    """Bytes through the server's link for one gradient exchange (n-1 pushes + n-1 pulls)."""
    return 2 * (workers - 1) * nbytes


def ring_per_worker_bytes(nbytes: float, workers: int) -> float:
    """Bytes each worker sends in a ring all-reduce: 2(N-1)/N · M, flat in N."""
    return 2 * (workers - 1) / workers * nbytes


# Slowdown of computation running beside NCCL kernels, as a share of the overlapped
# communication time: NCCL's kernels occupy SMs and memory bandwidth. An assumption (overlapped
# GEMMs typically lose 10-30%), not yet measured here: the committed H100 runs are single-GPU.
OVERLAP_INTERFERENCE = 0.2


def exposed_s(comm_s: float, compute_s: float) -> float:
    """Time a collective adds when overlapped with `compute_s` of independent work: what does not
    fit under the compute, plus OVERLAP_INTERFERENCE of what does (communication kernels take
    SMs and memory bandwidth from the overlapped computation)."""
    return max(0.0, comm_s - compute_s) + OVERLAP_INTERFERENCE * min(comm_s, compute_s)

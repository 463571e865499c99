"""Collectives: the alpha-beta formulas and the at-scale terms by hand, and the seeds'
parameter-server comparison. (Published bus bandwidths are compared in
`python -m benchmarks.run collectives`, not asserted here.)"""
from __future__ import annotations

from dataclasses import replace

import pytest

from cost_models.collectives import (P2P_LL_THRESHOLD_BYTES, PROTOCOLS, SIMPLE_STEP_SYNC_S, Algorithm, Collective,
                                     Protocol, best_algorithm, best_protocol, bus_bandwidth, collective_time_s,
                                     protocol_time_s, protocols_for, flat_time_s, parameter_server_load_bytes,
                                     ring_per_worker_bytes)
from cost_models.topology import NCCL_NET_STEP_OVERHEAD_S, ClusterConfig, ClusterSpec, Link, NetworkSpec

GB = 1e9
LINK = Link(bandwidth_Bps=100 * GB, latency_s=5e-6, name="test")


def cluster(gpu: str, nodes: int, per_node: int = 8, nic_GBps: float = 25.0) -> ClusterSpec:
    return ClusterSpec.from_config(ClusterConfig(name="t", gpu=gpu, nodes=nodes, gpus_per_node=per_node,
                                                 inter_node_bandwidth_GBps=nic_GBps))


def test_ring_all_reduce_is_the_textbook_formula():
    n, size = 8, 1 * GB
    expected = 2 * (n - 1) / n * size / (100 * GB) + 2 * (n - 1) * 5e-6  # 2(N-1)/N·M/bw + 2(N-1)·α
    assert flat_time_s(Collective.ALL_REDUCE, Algorithm.RING, size, n, LINK) == pytest.approx(expected, rel=1e-12)
    # nccl-tests: a ring's busbw tends to the link bandwidth as latency vanishes.
    seconds = flat_time_s(Collective.ALL_REDUCE, Algorithm.RING, 64 * GB, n, LINK)
    assert bus_bandwidth(Collective.ALL_REDUCE, n, 64 * GB, seconds) == pytest.approx(100 * GB, rel=1e-4)


def test_parameter_server_grows_with_workers_while_ring_traffic_stays_flat():
    """Parameter server: n-1 pushes and n-1 pulls through the server's one link, O(N)·M; ring:
    each worker sends 2(N-1)/N·M whatever N."""
    size = 1 * GB
    nic = Link(bandwidth_Bps=25 * GB, latency_s=10e-6, name="nic")
    workers = (4, 8, 16, 32)
    ps = [flat_time_s(Collective.ALL_REDUCE, Algorithm.PARAMETER_SERVER, size, n, nic) for n in workers]
    ring = [flat_time_s(Collective.ALL_REDUCE, Algorithm.RING, size, n, nic) for n in workers]
    assert ps == sorted(ps) and ps[-1] / ps[0] == pytest.approx(31 / 3, rel=1e-3)
    assert ps[0] == pytest.approx(2 * 3 * size / (25 * GB) + 2 * 3 * 10e-6)
    assert max(ring) / min(ring) < 1.35  # 2·31/32 vs 2·3/4 of M: bounded by 4/3 plus latency
    assert [parameter_server_load_bytes(size, n) for n in workers] == [2 * (n - 1) * size for n in workers]
    assert [ring_per_worker_bytes(size, n) for n in workers] == pytest.approx([2 * (n - 1) / n * size for n in workers])


def test_other_primitives_by_hand():
    a, b, s, n = 5e-6, 100 * GB, 8e8, 8
    assert flat_time_s(Collective.ALL_GATHER, Algorithm.RING, s, n, LINK) == pytest.approx(7 * a + 7 / 8 * s / b)
    assert flat_time_s(Collective.REDUCE_SCATTER, Algorithm.RING, s, n, LINK) == pytest.approx(7 * a + 7 / 8 * s / b)
    assert flat_time_s(Collective.BROADCAST, Algorithm.RING, s, n, LINK) == pytest.approx(3 * a + s / b)
    assert flat_time_s(Collective.SCATTER, Algorithm.RING, s, n, LINK) == pytest.approx(7 * a + 7 / 8 * s / b)
    assert flat_time_s(Collective.SEND_RECV, Algorithm.RING, s, 2, LINK) == pytest.approx(a + s / b)
    assert flat_time_s(Collective.ALL_REDUCE, Algorithm.TREE, s, n, LINK) == pytest.approx(6 * a + 2 * s / b)
    # Halving-doubling: log-depth latency with the ring's bandwidth term for a power of two ...
    assert flat_time_s(Collective.ALL_REDUCE, Algorithm.HALVING_DOUBLING, s, n, LINK) == \
        pytest.approx(6 * a + 2 * 7 / 8 * s / b)
    # ... and, for 6 ranks, the 4-rank core plus one exchange each way with the 2 surplus ranks.
    assert flat_time_s(Collective.ALL_REDUCE, Algorithm.HALVING_DOUBLING, s, 6, LINK) == \
        pytest.approx(4 * a + 2 * 3 / 4 * s / b + 2 * (a + s / b))
    assert flat_time_s(Collective.ALL_REDUCE, Algorithm.RING, s, 1, LINK) == 0.0


def test_hierarchical_all_reduce_is_three_phases():
    spec = cluster("A100-80GB", nodes=2, per_node=4)
    group = spec.group_links(list(range(8)))
    intra, inter = spec.intra, spec.inter
    s = 1e9
    expected = (3 * intra.latency_s + 3 / 4 * s / intra.bandwidth_Bps            # intra reduce-scatter
                + 2 * inter.latency_s + 2 * 1 / 2 * (s / 4) / inter.bandwidth_Bps  # inter all-reduce of S/4
                + 3 * intra.latency_s + 3 / 4 * s / intra.bandwidth_Bps)         # intra all-gather
    assert collective_time_s(Collective.ALL_REDUCE, s, group, Algorithm.HIERARCHICAL) == pytest.approx(expected)


@pytest.mark.parametrize("gpu,nodes,nic_GBps,link_GBps", [
    ("A100-80GB", 1, 25, 300 * 0.77),    # NVLink3 at its measured share
    ("H100-SXM", 1, 50, 450 * 0.82),     # NVLink4
    ("A100-80GB", 16, 25, 8 * 25 * 0.96),  # 8 ring channels, one per 200 Gb/s NIC
    ("H100-SXM", 16, 50, min(450 * 0.82, 8 * 50 * 0.96)),  # 8 x 400 Gb/s NICs, capped by NVLink4
])
def test_large_all_reduce_is_the_ring_over_every_nic(gpu, nodes, nic_GBps, link_GBps):
    """Hand count of a 16 GiB all-reduce over whole DGX nodes: NCCL's choice is the ring (a tree
    across more than two nodes is capped at 80 GB/s), one channel per NIC, so its busbw is the
    ring's link less its steps' latencies: across nodes 2(k-1) of its 2(n-1) steps cross a node at
    the network's latency, the others at the NVLink's but at least three network post overheads
    under Simple (NCCL's tuning model). (The published busbw of these systems, GTC24, is
    compared in `python -m benchmarks.run collectives`.)"""
    spec = cluster(gpu, nodes, nic_GBps=nic_GBps)
    group = spec.group_links(list(range(spec.world_size)))
    n, size = group.size, 16 * 2**30
    cost = best_algorithm(Collective.ALL_REDUCE, size, group)
    if nodes > 1:
        intra_step = max(spec.intra.latency_s, 3 * NCCL_NET_STEP_OVERHEAD_S)
        latency = 2 * (nodes - 1) * spec.inter.latency_s + (2 * (n - 1) - 2 * (nodes - 1)) * intra_step
    else:
        latency = 2 * (n - 1) * spec.intra.latency_s
    assert cost.algorithm is Algorithm.RING
    assert cost.seconds == pytest.approx(latency + 2 * (n - 1) / n * size / (link_GBps * GB))


def test_a_ring_across_nodes_pays_the_network_latency_only_where_it_crosses_a_node():
    """An all-gather over 4 nodes of 8 GPUs takes 31 steps, 3 of them across a node boundary: at
    Simple those pay the network's latency and the 28 others the NVLink's, but at least three
    network post overheads. A fabric whose per-step latency was fitted with every step at it
    (EFA) and a group of one rank per node keep 31 network latencies."""
    spec = cluster("H100-SXM", 4, nic_GBps=50)
    group = spec.group_links(list(range(spec.world_size)))
    s = 2**30
    intra_step = max(spec.intra.latency_s, 3 * NCCL_NET_STEP_OVERHEAD_S)
    flat = flat_time_s(Collective.ALL_GATHER, Algorithm.RING, s, 32, group.ring_link)
    split = protocol_time_s(Collective.ALL_GATHER, Algorithm.RING, Protocol.SIMPLE, s, group)
    assert split == pytest.approx(flat - 28 * (spec.inter.latency_s - intra_step))
    assert intra_step < spec.inter.latency_s
    efa = ClusterSpec.from_config(ClusterConfig(name="efa", gpu="H100-SXM", nodes=4, gpus_per_node=8,
                                                network="efa", inter_node_latency_us=43))
    efa_group = efa.group_links(list(range(efa.world_size)))
    assert protocol_time_s(Collective.ALL_GATHER, Algorithm.RING, Protocol.SIMPLE, s, efa_group) == pytest.approx(
        flat_time_s(Collective.ALL_GATHER, Algorithm.RING, s, 32, efa_group.ring_link))
    one_per_node = spec.group_links([0, 8, 16, 24])
    assert protocol_time_s(Collective.ALL_GATHER, Algorithm.RING, Protocol.SIMPLE, s, one_per_node) == pytest.approx(
        flat_time_s(Collective.ALL_GATHER, Algorithm.RING, s, 4, one_per_node.ring_link))


def test_small_messages_across_nodes_take_the_tree():
    spec = cluster("H100-SXM", nodes=16, nic_GBps=50)
    everyone = spec.group_links(list(range(spec.world_size)))
    small = best_algorithm(Collective.ALL_REDUCE, 64 * 2**10, everyone)
    assert small.algorithm is Algorithm.TREE  # 2·log2(128) latencies instead of 2·127
    assert small.seconds < collective_time_s(Collective.ALL_REDUCE, 64 * 2**10, everyone, Algorithm.RING) / 5


def test_all_to_all_across_nodes_is_limited_by_each_gpus_nic():
    """Every rank's off-node share (n-g)/n·S leaves through its own NIC: no NIC aggregation."""
    spec = cluster("H100-SXM", nodes=2, nic_GBps=50)
    group = spec.group_links(list(range(16)))
    s = 1e9
    seconds = collective_time_s(Collective.ALL_TO_ALL, s, group, Algorithm.RING)
    assert seconds == pytest.approx(15 * spec.inter.latency_s + (8 / 16) * s / spec.inter.bandwidth_Bps)


def test_calibrated_per_collective_alpha_beta_replace_the_links():
    link = Link(1 * GB, 1e-5, "measured", per_collective=(("all_gather", 2e-4, 0.5 * GB),))
    assert flat_time_s(Collective.ALL_GATHER, Algorithm.RING, 1e6, 2, link) == pytest.approx(2e-4 + 0.5e6 / (0.5 * GB))
    assert flat_time_s(Collective.ALL_REDUCE, Algorithm.RING, 1e6, 2, link) == pytest.approx(2e-5 + 1e6 / GB)


def fabric(nodes: int, ring_fall: float, tree_fall: float, cap_GBps: float | None = None,
           latency_us: float = 40.0) -> ClusterSpec:
    """`nodes` nodes of 8 H100 (8 x 50 GB/s NICs at 96%: 48 GB/s each) on a made-up fabric."""
    spec = ClusterSpec.from_config(ClusterConfig(name="t", gpu="H100-SXM", nodes=nodes, gpus_per_node=8,
                                                 inter_node_bandwidth_GBps=50, inter_node_latency_us=latency_us))
    network = NetworkSpec("test", 0.96, ring_fall, tree_fall, cap_GBps, 0, "none")
    return replace(spec, inter=replace(spec.inter, network=network))


def test_ring_bandwidth_falls_with_the_nodes_spanned():
    """Hand count: a ring all-gather over 4 nodes with ring_fall 0.5 sees each NIC at
    48·4^-0.5 = 24 GB/s, 8 channels = 192 GB/s (under NVLink's 369), and 31 steps of latency."""
    spec = fabric(4, ring_fall=0.5, tree_fall=0.0)
    group = spec.group_links(list(range(32)))
    s = 256e6
    simple = (Algorithm.RING, Protocol.SIMPLE)
    assert collective_time_s(Collective.ALL_GATHER, s, group, *simple) \
        == pytest.approx(31 * 40e-6 + 31 / 32 * s / 192e9)
    # point-to-point traffic (pipeline sends) keeps the NIC's rate
    pair = spec.group_links([0, 8])
    assert collective_time_s(Collective.SEND_RECV, s, pair) == pytest.approx(40e-6 + s / 48e9)
    # with no fall the same group is the plain alpha-beta ring over min(369, 8 x 48) GB/s
    flat = fabric(4, ring_fall=0.0, tree_fall=0.0).group_links(list(range(32)))
    assert collective_time_s(Collective.ALL_GATHER, s, flat, *simple) == \
        pytest.approx(31 * 40e-6 + 31 / 32 * s / min(450e9 * 0.82, 8 * 48e9))


def test_tree_has_its_own_fall_and_sends_half_as_much_across_two_nodes():
    """Hand count of the double binary tree across nodes, tree_fall 1 (bandwidth / nodes), no cap:
    over 4 nodes 8 x 48 / 4 = 96 GB/s and each node sends 2S; over 2 nodes 8 x 48 / 2 = 192 GB/s
    and each node sends S (each tree is one edge). Latency 2·ceil(log2 n) steps either way."""
    s = 1e9
    four = fabric(4, ring_fall=0.0, tree_fall=1.0).group_links(list(range(32)))
    assert collective_time_s(Collective.ALL_REDUCE, s, four, Algorithm.TREE) \
        == pytest.approx(2 * 5 * 40e-6 + 2 * s / 96e9)
    two = fabric(2, ring_fall=0.0, tree_fall=1.0).group_links(list(range(16)))
    assert collective_time_s(Collective.ALL_REDUCE, s, two, Algorithm.TREE) == pytest.approx(2 * 4 * 40e-6 + s / 192e9)
    # the ring's own fall (0 here) is untouched by the tree's
    assert four.ring_link.bandwidth_Bps == pytest.approx(min(450e9 * 0.82, 8 * 48e9))


def test_nccl_takes_the_tree_for_small_messages_and_the_ring_for_large_ones():
    """Over 16 nodes (128 ranks), tree_fall 1, Simple: the tree pays 2·7 latencies and 2S at
    384/16 = 24 GB/s, the ring 2·127 latencies and 2·127/128·S at 369 GB/s. At 1 MB: tree
    14·40 us + 83 us = 643 us, ring 254·40 us + 5 us = 10.2 ms. At 1 GB: tree 83 ms, ring
    10.2 ms + 5.4 ms = 15.5 ms."""
    group = fabric(16, ring_fall=0.0, tree_fall=1.0).group_links(list(range(128)))
    ring = 450e9 * 0.82
    tree_s = collective_time_s(Collective.ALL_REDUCE, 1e6, group, Algorithm.TREE, Protocol.SIMPLE)
    assert tree_s == pytest.approx(14 * 40e-6 + 2e6 / 24e9)
    assert collective_time_s(Collective.ALL_REDUCE, 1e6, group, Algorithm.RING, Protocol.SIMPLE) > 10 * tree_s
    assert collective_time_s(Collective.ALL_REDUCE, 1e9, group, Algorithm.RING, Protocol.SIMPLE) == \
        pytest.approx(254 * 40e-6 + 2 * 127 / 128 * 1e9 / ring)
    assert collective_time_s(Collective.ALL_REDUCE, 1e9, group, Algorithm.TREE, Protocol.SIMPLE) == \
        pytest.approx(14 * 40e-6 + 2e9 / 24e9)


def test_a_flat_all_reduce_is_never_priced_as_the_two_level_composition():
    """One NCCL call on a flat group runs a ring or a tree; the hierarchical exchange (several calls
    on sub-groups) is priced only when named. Its inter-node stage is NCCL's choice over one rank
    per node: for 8 KB over 16 nodes the tree (2·4 latencies) rather than the ring (2·15)."""
    spec = fabric(16, ring_fall=0.0, tree_fall=0.0)
    group = spec.group_links(list(range(128)))
    for nbytes in (1e3, 1e6, 1e9):
        assert best_algorithm(Collective.ALL_REDUCE, nbytes, group).algorithm in (Algorithm.RING, Algorithm.TREE)
    s, g = 8 * 8e3, 8
    # 64 KB: every call (each one NCCL's) runs LL: its step latency and bandwidth share
    ll = PROTOCOLS[Protocol.LL]
    intra = spec.intra
    phases = 2 * (7 * step_s(intra.latency_s, ll) + 7 / 8 * s / (ll.bandwidth_share * intra.bandwidth_Bps))
    tree = 2 * 4 * step_s(40e-6, ll) + 2 * (s / g) / (ll.bandwidth_share * 48e9)  # one NIC a node, 48 GB/s
    assert collective_time_s(Collective.ALL_REDUCE, s, group, Algorithm.HIERARCHICAL) == pytest.approx(phases + tree)


def test_tree_bandwidth_is_capped_beyond_two_nodes():
    """Hand count on InfiniBand (no fall, NCCL's 80 GB/s tree cap): a tree all-reduce over 4 DGX H100
    nodes runs at 80 GB/s, not the 8 NICs' 384, and each node sends 2S; over 2 nodes there is no cap
    and each node sends S (each of the two trees is one edge)."""
    spec = cluster("H100-SXM", nodes=4, nic_GBps=50)
    group = spec.group_links(list(range(32)))
    s = 1e9
    assert collective_time_s(Collective.ALL_REDUCE, s, group, Algorithm.TREE) == \
        pytest.approx(2 * 5 * spec.inter.latency_s + 2 * s / 80e9)
    two = cluster("H100-SXM", nodes=2, nic_GBps=50).group_links(list(range(16)))
    assert collective_time_s(Collective.ALL_REDUCE, s, two, Algorithm.TREE) == \
        pytest.approx(2 * 4 * spec.inter.latency_s + s / min(450e9 * 0.82, 8 * 50e9 * 0.96))


# -- NCCL's protocols (LL, LL128, Simple) --------------------------------------------------------

LL, LL128 = PROTOCOLS[Protocol.LL], PROTOCOLS[Protocol.LL128]


def step_s(latency_s: float, protocol) -> float:
    """A step's latency under a protocol: Simple's synchronisation (at most SIMPLE_STEP_SYNC_S of
    the link's latency) shrinks to the protocol's share of itself, the rest stays."""
    return latency_s - (1 - protocol.step_latency_share) * min(latency_s, SIMPLE_STEP_SYNC_S)


def dgx_h100_node():
    """One DGX H100 node: 8 ranks on NVLink4 at 450 x 0.82 = 369 GB/s, 3 us a step (Simple)."""
    spec = cluster("H100-SXM", nodes=1, nic_GBps=50)
    return spec, spec.group_links(list(range(8)))


def test_a_small_all_reduce_takes_ll():
    """64 KiB on one node: the tree (2·3 steps) with LL pays 6 LL steps (3 us is all synchronisation,
    under SIMPLE_STEP_SYNC_S: 3 us · LL's share) and 2S at LL's share of 369 GB/s; Simple pays the
    full 3 us a step, LL128 most of it."""
    spec, group = dgx_h100_node()
    s, a, b = 64 * 2**10, spec.intra.latency_s, spec.intra.bandwidth_Bps
    cost = best_algorithm(Collective.ALL_REDUCE, s, group)
    assert step_s(a, LL) == pytest.approx(a * LL.step_latency_share)
    expected = 6 * step_s(a, LL) + 2 * s / (b * LL.bandwidth_share)
    assert (cost.algorithm, cost.protocol) == (Algorithm.TREE, Protocol.LL)
    assert cost.seconds == pytest.approx(expected)
    assert expected < 6 * a + 2 * s / b  # the same tree with Simple


def test_a_large_all_reduce_takes_simple():
    """1 GiB on one node: the ring with Simple, 14 · 3 us + 2·7/8 · S / 369 GB/s; LL128 would save
    14 · 3 us · (1 - its latency share) and lose 8/120 of 5.1 ms of bandwidth."""
    spec, group = dgx_h100_node()
    s, a, b = 2**30, spec.intra.latency_s, spec.intra.bandwidth_Bps
    cost = best_algorithm(Collective.ALL_REDUCE, s, group)
    assert (cost.algorithm, cost.protocol) == (Algorithm.RING, Protocol.SIMPLE)
    assert cost.seconds == pytest.approx(14 * a + 2 * 7 / 8 * s / b)
    ll128 = 14 * step_s(a, LL128) + 2 * 7 / 8 * s / (b * LL128.bandwidth_share)
    assert collective_time_s(Collective.ALL_REDUCE, s, group, Algorithm.RING, Protocol.LL128) == pytest.approx(ll128)


def test_ring_crossover_from_ll128_to_simple_is_where_the_saved_latency_meets_the_lost_bandwidth():
    """A ring over one node: LL128 saves 14·(a - its step) of latency and costs 1.75·S/B·(1/w - 1)
    of bandwidth (w: its share), so Simple wins from S* = 14·(a - step) / (1.75/B · (1/w - 1))."""
    spec, group = dgx_h100_node()
    a, b = spec.intra.latency_s, spec.intra.bandwidth_Bps
    crossover = 14 * (a - step_s(a, LL128)) / (1.75 / b * (1 / LL128.bandwidth_share - 1))
    below = best_protocol(Collective.ALL_REDUCE, Algorithm.RING, 0.9 * crossover, group)
    above = best_protocol(Collective.ALL_REDUCE, Algorithm.RING, 1.1 * crossover, group)
    assert below.protocol is Protocol.LL128 and above.protocol is Protocol.SIMPLE


@pytest.mark.parametrize("network", ["infiniband", "efa"])
@pytest.mark.parametrize("nbytes", [2**10, 2**16, 2**20, 2**24, 2**28, 2**32])
def test_the_choice_is_the_argmin_over_algorithms_and_protocols(network, nbytes):
    """What best_algorithm returns is the cheapest pair NCCL could run; across EFA (out of order)
    LL128 is never among them, across InfiniBand it is."""
    spec = ClusterSpec.from_config(ClusterConfig(name="t", gpu="H100-SXM", nodes=4, gpus_per_node=8,
                                                 inter_node_bandwidth_GBps=50, network=network))
    group = spec.group_links(list(range(32)))
    pairs = [(algorithm, protocol) for algorithm in (Algorithm.RING, Algorithm.TREE)
             for protocol in protocols_for(Collective.ALL_REDUCE, algorithm, nbytes, group)]
    assert (Protocol.LL128 in {p for _, p in pairs}) == (network == "infiniband")
    times = {pair: protocol_time_s(Collective.ALL_REDUCE, *pair, nbytes, group) for pair in pairs}
    cost = best_algorithm(Collective.ALL_REDUCE, nbytes, group)
    assert cost.seconds == pytest.approx(min(times.values()))
    assert times[(cost.algorithm, cost.protocol)] == cost.seconds


def test_point_to_point_takes_ll_up_to_nccls_threshold():
    """Sends and all-to-all are not tuned: a peer's message up to 16 KiB goes by LL, above by Simple.
    All-to-all over one node at 8 x 2 KiB (2 KiB a peer): 7 LL steps + 7/8 · S at LL's bandwidth."""
    spec, group = dgx_h100_node()
    a, b = spec.intra.latency_s, spec.intra.bandwidth_Bps
    s = 8 * 2 * 2**10
    assert protocols_for(Collective.ALL_TO_ALL, Algorithm.RING, s, group) == (Protocol.LL,)
    assert collective_time_s(Collective.ALL_TO_ALL, s, group, Algorithm.RING) == \
        pytest.approx(7 * step_s(a, LL) + 7 / 8 * s / (b * LL.bandwidth_share))
    assert protocols_for(Collective.ALL_TO_ALL, Algorithm.RING, 8 * P2P_LL_THRESHOLD_BYTES + 8, group) == \
        (Protocol.SIMPLE,)
    assert protocols_for(Collective.SEND_RECV, Algorithm.RING, P2P_LL_THRESHOLD_BYTES, group) == (Protocol.LL,)


def test_a_network_step_keeps_what_is_not_synchronisation():
    """Across a network whose fitted step is 40 us, LL shortens only Simple's synchronisation:
    40 us - (1 - LL's share) · SIMPLE_STEP_SYNC_S, not 40 us · LL's share."""
    spec = fabric(4, ring_fall=0.0, tree_fall=0.0)
    group = spec.group_links(list(range(32)))
    s = 8 * 2**10
    expected = 62 * (40e-6 - (1 - LL.step_latency_share) * SIMPLE_STEP_SYNC_S) \
        + 2 * 31 / 32 * s / (LL.bandwidth_share * min(450e9 * 0.82, 8 * 48e9))
    assert collective_time_s(Collective.ALL_REDUCE, s, group, Algorithm.RING, Protocol.LL) == pytest.approx(expected)


def test_calibrated_links_are_priced_as_measured():
    """A calibrated link's alpha-beta already hold the protocol NCCL chose when it was measured."""
    link = Link(100 * GB, 5e-6, "NVLink4 (calibrated)", per_collective=(("all_reduce", 5e-6, 100 * GB),))
    spec = replace(cluster("H100-SXM", nodes=1), intra=link)
    group = spec.group_links(list(range(8)))
    assert protocols_for(Collective.ALL_REDUCE, Algorithm.RING, 1e3, group) == (Protocol.SIMPLE,)

"""The pricer's groups, built from a cluster alone (cost_models.placement.LayoutGroups): where each
group of a layout sits, by hand, on two nodes of eight GPUs and on a mixed cluster."""
from __future__ import annotations

from autopar.domain.layout import ParallelLayout
from cost_models.collectives import Collective, collective_time_s
from cost_models.placement import LayoutGroups
from cost_models.topology import ClusterConfig, ClusterSpec, NodeGroupConfig


def _two_nodes() -> LayoutGroups:
    return LayoutGroups(ClusterSpec.from_config(ClusterConfig(name="t", gpu="H100-SXM", nodes=2, gpus_per_node=8)))


def test_groups_of_a_hybrid_sharded_layout_by_hand():
    """tp innermost: ranks 4t..4t+3 form a TP group; dp's 4 ranks step by 4 over both nodes
    (0, 4, 8, 12). Hybrid sharding shards over dp's ranks on node 0 (0, 4) and replicates across
    one rank per node (0, 8)."""
    groups = _two_nodes()
    layout = ParallelLayout(dp=4, tp=4, zero_stage=3, hybrid_shard=True, mesh_order=("tp", "cp", "pp", "dp"))
    tp, grad = groups.placement(layout, "tp"), groups.grad_group(layout)
    assert (tp.size, tp.nodes, tp.per_node) == (4, 1, 4)
    assert (grad.size, grad.nodes, grad.per_node) == (4, 2, 2)
    assert groups.grad_size(layout) == 4 and groups.shard_size(layout) == 2
    shard, replicas = groups.shard_group(layout), groups.replica_group(layout)
    assert (shard.size, shard.nodes) == (2, 1) and (replicas.size, replicas.nodes, replicas.per_node) == (2, 2, 1)
    assert groups.span(layout, "tp") == (4, 1, 4, 4)
    assert groups.collective_s(Collective.ALL_REDUCE, 2**20, grad) == collective_time_s(Collective.ALL_REDUCE, 2**20,
                                                                                         grad)
    flat = ParallelLayout(dp=4, tp=4, zero_stage=3, mesh_order=("tp", "cp", "pp", "dp"))
    assert groups.shard_group(flat) == grad  # without hybrid sharding ZeRO shards the whole group


def test_expert_groups_are_consecutive_data_parallel_ranks():
    groups = _two_nodes()
    layout = ParallelLayout(dp=16, ep=4)
    experts = groups.placement(layout, "ep")
    assert (experts.size, experts.nodes) == (4, 1) and groups.expert_group(layout) == experts


def test_gpu_types_of_each_rank_on_a_mixed_cluster():
    """Node 0 holds H100s, node 1 A100s: with dp outermost, pipeline rank 0 sits on node 0; with
    tp spanning the nodes a TP group would mix types."""
    cluster = ClusterSpec.from_config(ClusterConfig(name="mixed", gpus_per_node=4, node_groups=[
        NodeGroupConfig(gpu="H100-SXM", nodes=1), NodeGroupConfig(gpu="A100-80GB", nodes=1)]))
    groups = LayoutGroups(cluster)
    piped = ParallelLayout(tp=4, pp=2, mesh_order=("tp", "cp", "pp", "dp"))
    assert [{gpu.name for gpu in ranks} for ranks in groups.pp_rank_gpus(piped)] == [{"H100-SXM"},
                                                                                      {"A100-80GB"}]
    assert groups.tp_groups_homogeneous(piped)
    replicas = ParallelLayout(dp=2, tp=4, mesh_order=("tp", "cp", "pp", "dp"))
    assert [gpu.name for gpu in groups.dp_rank_gpus(replicas)] == ["H100-SXM", "A100-80GB"]
    spanning = ParallelLayout(dp=4, tp=2, mesh_order=("dp", "cp", "pp", "tp"))  # tp steps by 4: across the nodes
    assert not groups.tp_groups_homogeneous(spanning)


def test_a_degree_that_does_not_divide_the_node_is_priced_by_its_straddling_groups():
    """tp=3 on three nodes of eight GPUs: the TP group through rank 0 ({0, 1, 2}) stays on NVLink,
    but {6, 7, 8} crosses to the next node, and every TP collective waits for it: the placement is
    that group's, across two nodes with one rank on one of them, and a TP all-reduce costs what
    it costs over the network."""
    cluster = ClusterSpec.from_config(ClusterConfig(name="t", gpu="H100-SXM", nodes=3, gpus_per_node=8))
    groups = LayoutGroups(cluster)
    layout = ParallelLayout(dp=8, tp=3, mesh_order=("tp", "cp", "pp", "dp"))
    tp = groups.placement(layout, "tp")
    assert (tp.size, tp.nodes, tp.per_node, tp.min_per_node) == (3, 2, 2, 1) and tp.link == cluster.inter
    assert tp == cluster.group_links([6, 7, 8])
    on_nvlink = cluster.group_links([0, 1, 2])
    assert groups.collective_s(Collective.ALL_REDUCE, 2**26, tp) > 2 * collective_time_s(
        Collective.ALL_REDUCE, 2**26, on_nvlink)

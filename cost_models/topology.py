"""Cluster topology: nodes of GPUs, two link levels, and which links a process group crosses.

`ClusterConfig` is the flat, Hydra-friendly description (presets in autopar/conf/cluster/);
`ClusterSpec.from_config` resolves it into a GPU type per rank and two link levels. Ranks are
numbered node by node (rank r sits on node r // gpus_per_node, as torchrun assigns them), so a
process group's ranks decide what it crosses (`ClusterSpec.group_links`): all on one node ->
the intra-node link (NVLink / PCIe); several nodes -> the network, where each GPU drives its own
NIC. A ring or tree spanning nodes runs one channel per NIC (NCCL builds as many rings as the
node has NICs), so its bandwidth is that of all the group's NICs on a node, capped by the
intra-node link: DGX A100 clusters reach an all-reduce busbw of ~192 GB/s on 8 x 25 GB/s NICs
(NVIDIA GTC24 S62129). Point-to-point traffic and all-to-all get one NIC per GPU.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import yaml

from autopar.domain.bounds import Bound, out_of_range
from cost_models.hardware import GB, GPUSpec, get_gpu

INTRA_NODE = "intra_node"
INTER_NODE = "inter_node"

# Share of a link's datasheet rate that NCCL's large-message bus bandwidth reaches (nccl-tests
# all-reduce busbw, NVIDIA GTC24 S62129): NVLink2 122/150, NVLink3 232/300, NVLink4 370/450,
# PCIe Gen4 24/32, Gen5 48/64; RDMA NICs 24/25 (200 Gb/s) and 48/50 (400 Gb/s). Links not
# measured there take NVLink's ~0.8. Calibrated links are measured rates and skip this.
LINK_EFFICIENCY = {"NVLink2": 0.81, "NVLink3": 0.77, "NVLink4": 0.82, "NVLink5": 0.82, "PCIe4": 0.75,
                   "PCIe5": 0.75, "InfinityFabric": 0.8, "shared-memory": 1.0}
NETWORK_EFFICIENCY = 0.96


@dataclass(frozen=True)
class NetworkSpec:
    """An inter-node fabric: what share of the NIC rate large messages reach, and how a
    collective's bandwidth falls as its group spans more nodes (switch hops, congestion, adaptive
    routing): across k nodes a ring sees its bandwidth times k^-ring_fall, a tree times
    k^-tree_fall, and a tree's bus bandwidth is capped at `tree_busbw_cap_GBps` beyond two nodes.
    Each preset names the published curve (shared/PUBLISHED.md table) its numbers are fitted to;
    `measured_nodes` is the widest group a published measurement on this fabric spans (0: none):
    beyond it the price is an extrapolation (cost_models/uncertainty.py widens the interval).
    `fall_measured` says whether a published node-count curve fixes the falls at all (False: they
    are 0, not because bandwidth holds with nodes but because nothing published says how it
    falls). `ll128` says whether NCCL runs its LL128 protocol across this fabric
    (cost_models/collectives.py, PROTOCOLS). `ring_step_overhead_s` is what a step of a ring
    spanning nodes costs at least when it stays inside a node (NCCL's per-step network overhead,
    `collectives.intra_step_saving_s`); None: every step of such a ring is priced at the
    network's latency, as the fabric's per-step latency was fitted."""

    name: str
    efficiency: float
    ring_fall: float
    tree_fall: float
    tree_busbw_cap_GBps: float | None
    measured_nodes: int
    curve: str
    fall_measured: bool = False
    ll128: bool = True
    ring_step_overhead_s: float | None = None

    def describe(self) -> str:
        """One line for reports: what the preset is fitted to and what is not measured."""
        fall = (f"node-count fall measured (ring k^-{self.ring_fall:g}, tree k^-{self.tree_fall:g})"
                if self.fall_measured else "node-count fall NOT measured (none priced)")
        widest = f"widest measured group {self.measured_nodes} nodes" if self.measured_nodes else "no group measured"
        return f"{self.name}: fitted to {self.curve}; {fall}; {widest}, wider is extrapolated"

    def fall(self, nodes: int, tree: bool = False) -> float:
        """Factor on the bandwidth of a ring (or tree) spanning `nodes` nodes."""
        if nodes <= 1:
            return 1.0
        return nodes ** -(self.tree_fall if tree else self.ring_fall)


# NCCL's tuning model caps a tree's bus bandwidth at 80 GB/s beyond two nodes (NVIDIA/nccl
# src/graph/tuning.cc, maxTreeBw): its interior ranks receive from two children and send to a
# parent through one channel pair. Networks without a measured all-reduce curve keep that cap.
NCCL_TREE_BUSBW_CAP_GBps = 80.0
# NCCL's tuning model (src/graph/tuning.cc, getNetOverhead) charges every step of a ring that
# spans nodes at least a network post overhead: 1 us on Intel hosts, 2 us on AMD ones (DGX A100);
# three times that under the Simple protocol. Hosts are not described here: the larger.
NCCL_NET_STEP_OVERHEAD_S = 2e-6

NETWORKS: dict[str, NetworkSpec] = {spec.name: spec for spec in (
    # PUBLISHED.md E4 (NVIDIA GTC24 S62129): nccl-tests all-reduce busbw of multi-node DGX
    # clusters, 8 x 200 Gb/s: 192 GB/s (24 per NIC), 8 x 400 Gb/s: 380 GB/s (48 per NIC): the
    # efficiency is fitted to those. No node-count curve (the slide does not say how many nodes):
    # no fall with nodes is fitted; data-parallel groups over up to 48 nodes are checked only
    # through the training runs of A1 and A6, and wider groups are extrapolations.
    # NCCL runs LL128 over InfiniBand (its verbs transport writes each 128-byte line in order).
    NetworkSpec("infiniband", NETWORK_EFFICIENCY, 0.0, 0.0, NCCL_TREE_BUSBW_CAP_GBps, 48,
                "PUBLISHED.md E4 (GTC24 S62129 multi-node all-reduce busbw: DGX A100 192 GB/s, DGX H100 380 GB/s, "
                "node count not stated); no node-count curve", fall_measured=False, ll128=True,
                ring_step_overhead_s=NCCL_NET_STEP_OVERHEAD_S),
    # PUBLISHED.md E4: RoCE at 200/400 Gb/s reaches the same busbw per NIC ("200 Gb RDMA (IB/RoCE)
    # 24 GB/s, 400 Gb 48"). No node-count curve and no training run on RoCE: every group across
    # nodes is an extrapolation.
    # RoCE is the same verbs transport to NCCL as InfiniBand: LL128 as there.
    NetworkSpec("roce", NETWORK_EFFICIENCY, 0.0, 0.0, NCCL_TREE_BUSBW_CAP_GBps, 0,
                "PUBLISHED.md E4 (GTC24 S62129 RDMA busbw: 200 Gb IB/RoCE 24 GB/s, 400 Gb 48 GB/s); "
                "no node-count curve", fall_measured=False, ll128=True,
                ring_step_overhead_s=NCCL_NET_STEP_OVERHEAD_S),
    # PUBLISHED.md D10 (Ultra-Scale Playbook, nccl busbw at 256 MB on 1-64 nodes of 8 H100 on AWS
    # EFA): the ring's fall and per-step latency (conf/cluster/p5_h100_efa.yaml: 43 us) fitted to
    # all-gather and reduce-scatter, the tree's fall to all-reduce, each never faster than the
    # curve by more than 3% (benchmarks/bench_collectives.py prints the fit: mean |error| 9.7%
    # all-gather, 9.8% reduce-scatter, 10.0% all-reduce). The all-reduce measured at 8 and 16 nodes
    # is above NCCL's 80 GB/s tree cap, so this fabric has no cap.
    # EFA's SRD transport delivers out of order, so LL128's in-order 128-byte lines cannot be
    # relied on across it: Simple and LL only.
    NetworkSpec("efa", NETWORK_EFFICIENCY, 0.13, 0.58, None, 64,
                "PUBLISHED.md D10 (Ultra-Scale Playbook nccl all-gather/reduce-scatter/all-reduce busbw, 256 MB, "
                "1-64 nodes of 8 H100 on EFA)", fall_measured=True, ll128=False),
    # PUBLISHED.md E4 (ml-engineering all_reduce_bench, 8 B200 per node on AWS P6-B200, 8 x 400 Gb/s
    # EFA v4): busbw vs payload on 1 and 4 nodes. One node count across the fabric gives no fall
    # to fit, and none shows at 4 nodes (16 GiB: 381.8 GB/s of the 8 NICs' 384 at 96%); the
    # per-step latency (conf/cluster/p6_b200_efa.yaml) and the protocol constants
    # (cost_models/collectives.py) are fitted to the curve's payload sweep
    # (benchmarks/bench_collectives.py). Out of order like EFA: no LL128.
    NetworkSpec("efa_v4", NETWORK_EFFICIENCY, 0.0, 0.0, NCCL_TREE_BUSBW_CAP_GBps, 4,
                "PUBLISHED.md E4 (ml-engineering all_reduce_bench busbw vs payload, 1 MiB-16 GiB, 1 and 4 nodes "
                "of 8 B200 on P6-B200 EFA v4)", fall_measured=False, ll128=False),
)}


def get_network(name: str) -> NetworkSpec:
    if name not in NETWORKS:
        raise ValueError(f"Unknown network '{name}'. Known networks: {', '.join(sorted(NETWORKS))}.")
    return NETWORKS[name]


@dataclass
class NodeGroupConfig:
    """A group of identical nodes in a mixed cluster."""

    gpu: str = "H100-SXM"
    """GPU type of these nodes (a name from the hardware catalogue)."""
    nodes: int = 1
    """How many such nodes."""


@dataclass
class ClusterConfig:
    """A cluster as the user describes it (one Hydra config group, `cluster=<preset>`)."""

    name: str = "cpu_gloo"
    """Preset name, shown in reports."""
    gpu: str = "cpu"
    """GPU type of every node (ignored when node_groups is set); see cost_models.hardware."""
    nodes: int = 1
    """Number of nodes (ignored when node_groups is set)."""
    gpus_per_node: int = 4
    """GPUs (ranks) per node."""
    intra_node_bandwidth_GBps: float | None = None
    """Per-GPU unidirectional link rate inside a node, GB/s (datasheet; ~80% of it is reached, see
    LINK_EFFICIENCY); null: the GPU's link from the catalogue."""
    intra_node_latency_us: float = 3.0
    """Per-message latency (alpha) inside a node, microseconds."""
    inter_node_bandwidth_GBps: float = 25.0
    """Network rate per GPU between nodes, GB/s (25 for one 200 Gb/s NIC per GPU, 50 for 400 Gb/s; 96%
    of it is reached)."""
    inter_node_latency_us: float = 8.0
    """Per-message latency (alpha) between nodes, microseconds."""
    network: str = "infiniband"
    """Inter-node fabric (infiniband, roce, efa, efa_v4): how much of the NIC rate is reached and how
    bandwidth falls with the nodes a group spans (cost_models.topology.NETWORKS names the
    published curve behind each)."""
    memory_headroom_fraction: float = 0.05
    """Share of each GPU's memory kept free for allocator fragmentation and the CUDA context's slack."""
    price_per_gpu_hour: float = 0.0
    """Cost of one GPU for an hour (any currency), for cost-per-token reports."""
    node_groups: list[NodeGroupConfig] = field(default_factory=list)
    """Mixed clusters: node groups in rank order, e.g. [{gpu: H100-SXM, nodes: 8}, {gpu: A100-80GB, nodes: 8}]
    (empty: `nodes` nodes of `gpu`)."""
    hardware_profile: str | None = None
    """Calibration YAML written by `autopar calibrate`, overriding GPU and link numbers."""
    power_limit_W: float | None = None
    """Board power limit the GPUs run at, watts (null: each GPU's rated limit). Training holds a GPU
    at its limit, so a lower one lowers the clock compute-bound work runs at
    (`GPUSpec.clock_share`); memory bandwidth is unchanged."""


# The range of every numeric field of ClusterConfig and NodeGroupConfig (cluster_problem checks
# them where a cluster is read; a test keeps every numeric field listed).
CLUSTER_BOUNDS: dict[str, Bound] = {
    "nodes": Bound(low=1, integer=True),
    "gpus_per_node": Bound(low=1, integer=True),
    "intra_node_bandwidth_GBps": Bound(low=0, low_open=True, null="the GPU's link from the catalogue"),
    "intra_node_latency_us": Bound(low=0),
    "inter_node_bandwidth_GBps": Bound(low=0, low_open=True),
    "inter_node_latency_us": Bound(low=0),
    "memory_headroom_fraction": Bound(low=0, high=1, high_open=True),
    "price_per_gpu_hour": Bound(low=0),
    "power_limit_W": Bound(low=0, low_open=True, null="each GPU's rated limit"),
}
NODE_GROUP_BOUNDS: dict[str, Bound] = {"nodes": Bound(low=0, integer=True)}


def cluster_problem(config: Any) -> str | None:
    """The first numeric cluster.* setting (of a ClusterConfig, a DictConfig or a plain mapping)
    outside its range, as one sentence naming the field, the value and the range (None when
    every one is in range)."""
    found = out_of_range(config, CLUSTER_BOUNDS)
    if found:
        return found.sentence("cluster.")
    groups = config.get("node_groups") if isinstance(config, Mapping) else getattr(config, "node_groups", None)
    for index, group in enumerate(groups or []):
        found = out_of_range(group, NODE_GROUP_BOUNDS)
        if found:
            return found.sentence(f"cluster.node_groups[{index}].")
    return None


def _power_limited(gpus: tuple[GPUSpec, ...], limit_W: float | None) -> tuple[GPUSpec, ...]:
    """The GPUs run at a power limit; refused at or below a GPU's idle power (nothing would run)."""
    if not limit_W:
        return gpus
    for gpu in gpus:
        if limit_W <= gpu.idle_power_W:
            raise ValueError(f"cluster.power_limit_W={limit_W:g} is at or below a {gpu.name}'s idle power "
                             f"({gpu.idle_power_W:g} W); give the limit the GPUs run at (its rated limit is "
                             f"{gpu.rated_power_W:g} W)")
    return tuple(gpu.with_overrides(power_limit_W=float(limit_W)) for gpu in gpus)


@dataclass(frozen=True)
class Link:
    """Alpha-beta parameters of one link level.

    Attributes:
        bandwidth_Bps: unidirectional bandwidth per GPU, bytes per second (beta = 1 / bandwidth).
        latency_s: per-message latency alpha.
        name: what it is (NVLink4, network, ...).
        per_collective: calibrated (op name, latency_s, bandwidth_Bps) replacing alpha and beta
            for that collective (each collective has its own protocol overheads).
    """

    bandwidth_Bps: float
    latency_s: float
    name: str
    per_collective: tuple[tuple[str, float, float], ...] = ()
    network: NetworkSpec | None = None  # the fabric, for an inter-node link: its fall with nodes
    # A pessimistic price (cost_models.uncertainty): beyond `measured_nodes` the bandwidth also
    # falls by `fall_per_doubling` per doubling of nodes (1.0: no such term).
    measured_nodes: int = 0
    fall_per_doubling: float = 1.0
    # Collectives no published measurement covers on any fabric (all-to-all): pessimistically they
    # fall from one node on.
    unmeasured_ops: tuple[str, ...] = ()

    def across(self, nodes: int, tree: bool = False, op: str = "") -> "Link":
        """This link as a ring (or tree) spanning `nodes` nodes sees it (NetworkSpec.fall); `op`
        names the collective when it is one of `unmeasured_ops`."""
        measured = 1 if op in self.unmeasured_ops else max(1, self.measured_nodes)
        beyond = self.fall_per_doubling != 1.0 and nodes > measured
        fall = self.network.fall(nodes, tree) if self.network else 1.0
        if nodes <= 1 or (fall == 1.0 and not beyond):
            return self
        factor = 1 / fall
        if beyond:
            factor *= self.fall_per_doubling ** math.log2(nodes / measured)
        return self.scaled(1 / factor)

    def scaled(self, share: float, cap_Bps: float | None = None) -> "Link":
        """This link with every bandwidth times `share` (and at most `cap_Bps`)."""
        cap = cap_Bps if cap_Bps is not None else math.inf
        return replace(self, bandwidth_Bps=min(cap, self.bandwidth_Bps * share),
                       per_collective=tuple((op, latency, min(cap, bandwidth * share))
                                            for op, latency, bandwidth in self.per_collective))

    def alpha_beta(self, op: str) -> tuple[float, float]:
        """(latency_s, bandwidth_Bps) for a collective, calibrated where measured."""
        for name, latency, bandwidth in self.per_collective:
            if name == op:
                return latency, bandwidth
        return self.latency_s, self.bandwidth_Bps


@dataclass(frozen=True)
class GroupPlacement:
    """Where a process group sits and what it crosses.

    Attributes:
        size: ranks in the group.
        nodes: nodes it spans.
        per_node: most ranks of the group on one node.
        link: bottleneck link of one rank's traffic (intra-node link, or its NIC across nodes).
        intra, inter: the cluster's two link levels (hierarchical algorithms use both).
        min_per_node: fewest ranks of the group on one of its nodes (NICs a ring can use there).
    """

    size: int
    nodes: int
    per_node: int
    link: Link
    intra: Link
    inter: Link
    min_per_node: int = 0

    def __hash__(self) -> int:
        """The fields' hash, computed once: a placement keys the pricer's memo of collective
        times, looked up about a hundred thousand times per plan, and hashing its three links
        again at each lookup took longer than the lookup itself."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.size, self.nodes, self.per_node, self.link, self.intra, self.inter, self.min_per_node))
            object.__setattr__(self, "_hash", cached)
        return cached

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1

    @property
    def level(self) -> str:
        """"intra_node" or "inter_node": the slowest level the group's traffic crosses."""
        return INTER_NODE if self.crosses_nodes else INTRA_NODE

    @property
    def bandwidth_Bps(self) -> float:
        return self.link.bandwidth_Bps

    @property
    def latency_s(self) -> float:
        return self.link.latency_s

    @property
    def ring_link(self) -> Link:
        """Link of a ring collective: across nodes one channel per NIC of the group's ranks on a
        node, capped by the intra-node link the channels also traverse."""
        return self._channels(self.network)

    @property
    def tree_link(self) -> Link:
        """Link of a tree all-reduce: the ring's channels with the tree's fall with nodes, and
        beyond two nodes the fabric's cap on a tree's bus bandwidth (NetworkSpec)."""
        link = self._channels(self.inter.across(self.nodes, tree=True))
        network = self.inter.network
        cap_GBps = network.tree_busbw_cap_GBps if network else NCCL_TREE_BUSBW_CAP_GBps
        if self.nodes <= 2 or cap_GBps is None:
            return link
        return link.scaled(1.0, cap_GBps * GB)

    def _channels(self, inter: Link) -> Link:
        if not self.crosses_nodes:
            return self.intra
        nics = max(1, self.min_per_node or self.per_node)
        return Link(min(self.intra.bandwidth_Bps, nics * inter.bandwidth_Bps), inter.latency_s,
                    f"{nics} x {inter.name}", inter.per_collective)

    @property
    def network(self) -> Link:
        """The inter-node link as a ring over this group sees it: its bandwidth falls with the
        nodes spanned."""
        return self.inter.across(self.nodes)


@dataclass(frozen=True)
class ClusterSpec:
    """Resolved cluster: a GPUSpec per node and the two link levels."""

    name: str
    gpus_per_node: int
    node_gpus: tuple[GPUSpec, ...]
    intra: Link
    inter: Link
    memory_headroom_fraction: float
    price_per_gpu_hour: float = 0.0
    calibration: str = "catalogue (datasheets)"
    time_scale: tuple[tuple[str, float], ...] = ()  # measured/predicted factors per step-time part (feedback.py)
    # Techniques whose communication is priced without the compute it overlaps (the pessimistic
    # price of an overlap no published run measured: cost_models.uncertainty).
    exposed_overlap: tuple[str, ...] = ()

    def scale_of(self, part: str) -> float:
        return next((factor for name, factor in self.time_scale if name == part), 1.0)

    @classmethod
    def from_config(cls, config: Any) -> "ClusterSpec":
        """Build from a ClusterConfig (or any object / DictConfig with its fields)."""
        problem = cluster_problem(config)
        if problem:
            raise ValueError(f"{problem}.")
        groups = list(getattr(config, "node_groups", None) or [])
        if not groups:
            groups = [NodeGroupConfig(gpu=config.gpu, nodes=config.nodes)]
        if sum(int(g.nodes) for g in groups) < 1:  # each group's count is in range; all of them 0
            raise ValueError(f"Cluster '{config.name}' has no GPUs: its node groups hold 0 nodes; give one "
                             "group at least 1 node (cluster.node_groups[i].nodes).")
        headroom = float(getattr(config, "memory_headroom_fraction", 0.05))
        node_gpus = tuple(get_gpu(g.gpu) for g in groups for _ in range(int(g.nodes)))
        path = getattr(config, "hardware_profile", None)
        profile = load_hardware_profile(path) if path else {}
        node_gpus = tuple(_apply_gpu_profile(gpu, profile.get("gpus", {}).get(gpu.name, {})) for gpu in node_gpus)
        node_gpus = _power_limited(node_gpus, getattr(config, "power_limit_W", None))
        intra_bw = config.intra_node_bandwidth_GBps  # null, not 0, means the catalogue's link (0 is refused)
        if intra_bw is None:
            intra_bw = min(g.intra_node_bandwidth_GBps for g in node_gpus)
        link_name = min(node_gpus, key=lambda g: g.intra_node_bandwidth_GBps).intra_node_link
        intra = Link(intra_bw * GB * LINK_EFFICIENCY.get(link_name, 0.8), config.intra_node_latency_us * 1e-6,
                     link_name)
        network = get_network(str(getattr(config, "network", "infiniband")))
        inter = Link(config.inter_node_bandwidth_GBps * GB * network.efficiency, config.inter_node_latency_us * 1e-6,
                     network.name, network=network)
        links = profile.get("links", {})
        if "intra" in links:
            intra = _calibrated_link(links["intra"], intra.name + " (calibrated)")
        if "inter" in links:
            inter = replace(_calibrated_link(links["inter"], f"{network.name} (calibrated)"), network=network)
        return cls(name=config.name, gpus_per_node=int(config.gpus_per_node), node_gpus=node_gpus, intra=intra,
                   inter=inter, memory_headroom_fraction=headroom,
                   price_per_gpu_hour=float(getattr(config, "price_per_gpu_hour", 0.0)),
                   calibration=str(path) if profile else "catalogue (datasheets)",
                   time_scale=tuple(sorted((str(k), float(v)) for k, v in (profile.get("time_scale") or {}).items())))

    @property
    def nodes(self) -> int:
        return len(self.node_gpus)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @functools.cached_property
    def homogeneous(self) -> bool:
        """One GPU type everywhere (asked per candidate: cached, as a cluster has up to 8192 nodes)."""
        return len({gpu.name for gpu in self.node_gpus}) == 1

    def gpu_of_rank(self, rank: int) -> GPUSpec:
        return self.node_gpus[rank // self.gpus_per_node]

    def gpu_types(self) -> list[str]:
        """GPU type name of every rank, in rank order."""
        return [gpu.name for gpu in self.node_gpus for _ in range(self.gpus_per_node)]

    def group_links(self, ranks: list[int] | tuple[int, ...]) -> GroupPlacement:
        """Which level a process group of these ranks crosses, and its bottleneck link."""
        if not ranks:
            raise ValueError("a process group needs at least one rank")
        if min(ranks) < 0 or max(ranks) >= self.world_size:
            raise ValueError(f"ranks must lie in [0, {self.world_size}), got {min(ranks)}..{max(ranks)}")
        counts: dict[int, int] = {}
        for rank in ranks:
            counts[rank // self.gpus_per_node] = counts.get(rank // self.gpus_per_node, 0) + 1
        link = self.intra if len(counts) == 1 else self.inter  # one rank's traffic: point to point, no fabric-wide load
        return GroupPlacement(size=len(ranks), nodes=len(counts), per_node=max(counts.values()), link=link,
                              intra=self.intra, inter=self.inter, min_per_node=min(counts.values()))

    def strided_placement(self, size: int, stride: int) -> GroupPlacement:
        """Placement of the group {0, stride, 2·stride, ...} (a mesh axis with that stride)."""
        return self.group_links([i * stride for i in range(size)])


# The ranges of a hardware profile's numbers (written by `autopar calibrate`, or edited by hand):
# its links' alpha-beta fits (each collective's too), each GPU's measurements, the time factors.
LINK_PROFILE_BOUNDS: dict[str, Bound] = {"bandwidth_Bps": Bound(low=0, low_open=True), "latency_s": Bound(low=0)}
GPU_PROFILE_BOUNDS: dict[str, Bound] = {
    "peak_flops": Bound(low=0, low_open=True, each=True),
    "efficiency": Bound(low=0, high=1, low_open=True, each=True),  # a share of the peak
    "memory_bandwidth_Bps": Bound(low=0, low_open=True),
    "launch_overhead_s": Bound(low=0),
}
PROFILE_BOUNDS: dict[str, Bound] = {"time_scale": Bound(low=0, low_open=True, each=True)}


def load_hardware_profile(path: str | Path) -> dict:
    """Read a calibration YAML (see cost_models.calibrate for its layout), refusing one whose
    numbers are out of range (ValueError naming the entry)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"Hardware profile {path} is not YAML ({' '.join(str(err).split())[:200]}); write it "
                         f"again with `autopar calibrate --out {path}`.") from None
    if not isinstance(data, dict):
        raise ValueError(f"Hardware profile {path} is not a mapping.")
    # YAML 1.1 reads 5.0e10 (no exponent sign) as text; such numbers were always read with float()
    data = {key: _as_numbers(value) if key in ("gpus", "links", "time_scale") else value for key, value in data.items()}
    problem = hardware_profile_problem(data)
    if problem:
        raise ValueError(f"Hardware profile {path}: {problem}; measure again with `autopar calibrate --out {path}` "
                         "or correct that entry.")
    return data


def _as_numbers(value: Any) -> Any:
    """``value`` with every text that reads as a number turned into that float."""
    if isinstance(value, dict):
        return {key: _as_numbers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_numbers(item) for item in value]
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def hardware_profile_problem(data: dict) -> str | None:
    """The first number of a hardware profile outside its range (or an entry of the wrong shape)."""
    parts: list[tuple[str, Any, dict[str, Bound]]] = [("", data, PROFILE_BOUNDS)]
    for section, table in (("gpus", GPU_PROFILE_BOUNDS), ("links", LINK_PROFILE_BOUNDS)):
        entries = data.get(section) or {}
        if not isinstance(entries, dict):
            return f"{section} is not a mapping"
        parts += [(f"{section}.{name}.", entry, table) for name, entry in entries.items()]
    for level, link in (data.get("links") or {}).items():
        fits = link.get("collectives") if isinstance(link, dict) else None
        parts += [(f"links.{level}.collectives.{op}.", fit, LINK_PROFILE_BOUNDS) for op, fit in (fits or {}).items()]
    for prefix, values, table in parts:
        if not isinstance(values, dict):
            return f"{prefix.rstrip('.')} is not a mapping"
        missing = [name for name in LINK_PROFILE_BOUNDS if table is LINK_PROFILE_BOUNDS and name not in values]
        if missing:
            return f"{prefix}{missing[0]} is missing"
        found = out_of_range(values, table)
        if found:
            return found.sentence(prefix)
    return None


def _calibrated_link(entry: dict, name: str) -> Link:
    per_op = tuple((op, float(fit["latency_s"]), float(fit["bandwidth_Bps"]))
                   for op, fit in sorted((entry.get("collectives") or {}).items()))
    return Link(float(entry["bandwidth_Bps"]), float(entry["latency_s"]), name, per_op)


def _apply_gpu_profile(gpu: GPUSpec, overrides: dict) -> GPUSpec:
    if not overrides:
        return gpu
    peak = dict(gpu.peak_flops)
    peak.update({k: float(v) for k, v in overrides.get("peak_flops", {}).items()})
    efficiency = dict(gpu.efficiency)
    efficiency.update({k: float(v) for k, v in overrides.get("efficiency", {}).items()})
    return gpu.with_overrides(peak_flops=peak, efficiency=efficiency,
                              memory_bandwidth_Bps=float(overrides.get("memory_bandwidth_Bps",
                                                                       gpu.memory_bandwidth_Bps)),
                              launch_overhead_s=float(overrides.get("launch_overhead_s", gpu.launch_overhead_s)))

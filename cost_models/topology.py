"""Cluster topology: nodes of GPUs, two link levels, and what a process group crosses.

`ClusterConfig` is the flat, Hydra-friendly description (presets in conf/cluster/);
`ClusterSpec.from_config` turns it into GPUs per rank and links. Ranks are numbered node by
node (rank r sits on node r // gpus_per_node, as torchrun assigns them), so a process group's
ranks decide which links it crosses: all on one node -> the intra-node link (NVLink/PCIe),
otherwise the inter-node NIC bandwidth per GPU is the bottleneck.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cost_models.hardware import GB, GPUSpec, get_gpu


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
    """GPU type of every node (ignored when node_groups is set)."""
    nodes: int = 1
    """Number of nodes (ignored when node_groups is set)."""
    gpus_per_node: int = 4
    """GPUs (ranks) per node."""
    intra_node_bandwidth_GBps: float | None = None
    """Per-GPU unidirectional bandwidth inside a node; default: the GPU's link from the catalogue."""
    intra_node_latency_us: float = 3.0
    """Per-message latency (alpha) inside a node, microseconds."""
    inter_node_bandwidth_GBps: float = 25.0
    """Per-GPU network bandwidth between nodes (e.g. 25 for 200 Gb/s, 50 for 400 Gb/s NICs)."""
    inter_node_latency_us: float = 8.0
    """Per-message latency (alpha) between nodes, microseconds."""
    memory_headroom_fraction: float = 0.05
    """Share of GPU memory left to the allocator's fragmentation and the CUDA context."""
    price_per_gpu_hour: float = 0.0
    """Cost of one GPU for an hour, for cost-per-token reports."""
    node_groups: list[NodeGroupConfig] = field(default_factory=list)
    """Mixed clusters: node groups in rank order (empty: `nodes` nodes of `gpu`)."""
    hardware_profile: str | None = None
    """Calibration YAML (from `autopar calibrate`) overriding GPU and link numbers."""


@dataclass(frozen=True)
class Link:
    """Alpha-beta parameters of one link level."""

    bandwidth_Bps: float
    latency_s: float
    name: str


@dataclass(frozen=True)
class GroupPlacement:
    """Where a process group sits: its size, nodes spanned, ranks per node and bottleneck link."""

    size: int
    nodes: int
    per_node: int
    link: Link
    intra: Link
    inter: Link

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1


@dataclass(frozen=True)
class ClusterSpec:
    """Resolved cluster: a GPUSpec per rank and the two link levels."""

    name: str
    gpus_per_node: int
    node_gpus: tuple[GPUSpec, ...]
    intra: Link
    inter: Link
    memory_headroom_fraction: float
    price_per_gpu_hour: float = 0.0
    calibration: str = "catalogue (datasheets)"

    @classmethod
    def from_config(cls, config: Any) -> "ClusterSpec":
        """Build from a ClusterConfig (or any object/DictConfig with its fields)."""
        groups = list(getattr(config, "node_groups", None) or [])
        if not groups:
            groups = [NodeGroupConfig(gpu=config.gpu, nodes=config.nodes)]
        if config.gpus_per_node < 1 or sum(int(g.nodes) for g in groups) < 1:
            raise ValueError(f"Cluster '{config.name}' has no GPUs: set cluster.nodes and "
                             "cluster.gpus_per_node to at least 1.")
        node_gpus = tuple(get_gpu(g.gpu) for g in groups for _ in range(int(g.nodes)))
        profile = _load_profile(config.hardware_profile) if getattr(config, "hardware_profile", None) else {}
        node_gpus = tuple(_apply_gpu_profile(gpu, profile.get("gpus", {}).get(gpu.name, {})) for gpu in node_gpus)
        intra_bw = config.intra_node_bandwidth_GBps or min(g.intra_node_bandwidth_GBps for g in node_gpus)
        intra = Link(intra_bw * GB, config.intra_node_latency_us * 1e-6, node_gpus[0].intra_node_link)
        inter = Link(config.inter_node_bandwidth_GBps * GB, config.inter_node_latency_us * 1e-6, "network")
        links = profile.get("links", {})
        if "intra" in links:
            intra = Link(links["intra"]["bandwidth_Bps"], links["intra"]["latency_s"], intra.name + " (calibrated)")
        if "inter" in links:
            inter = Link(links["inter"]["bandwidth_Bps"], links["inter"]["latency_s"], "network (calibrated)")
        return cls(name=config.name, gpus_per_node=int(config.gpus_per_node), node_gpus=node_gpus, intra=intra,
                   inter=inter, memory_headroom_fraction=config.memory_headroom_fraction,
                   price_per_gpu_hour=config.price_per_gpu_hour,
                   calibration=str(config.hardware_profile) if profile else "catalogue (datasheets)")

    @property
    def nodes(self) -> int:
        return len(self.node_gpus)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def homogeneous(self) -> bool:
        return len({gpu.name for gpu in self.node_gpus}) == 1

    def gpu_of_rank(self, rank: int) -> GPUSpec:
        return self.node_gpus[rank // self.gpus_per_node]

    def placement(self, ranks: list[int] | tuple[int, ...]) -> GroupPlacement:
        """Which links a group of ranks crosses."""
        nodes = {rank // self.gpus_per_node for rank in ranks}
        per_node = max(sum(1 for r in ranks if r // self.gpus_per_node == n) for n in nodes)
        link = self.intra if len(nodes) == 1 else self.inter
        return GroupPlacement(size=len(ranks), nodes=len(nodes), per_node=per_node, link=link,
                              intra=self.intra, inter=self.inter)

    def strided_placement(self, size: int, stride: int) -> GroupPlacement:
        """Placement of the group {0, stride, 2·stride, ...} (a mesh axis with that stride)."""
        return self.placement([i * stride for i in range(size)])


def _load_profile(path: str | Path) -> dict:
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"Hardware profile {path} is not a mapping.")
    return data


def _apply_gpu_profile(gpu: GPUSpec, overrides: dict) -> GPUSpec:
    if not overrides:
        return gpu
    peak = dict(gpu.peak_flops)
    peak.update(overrides.get("peak_flops", {}))
    efficiency = dict(gpu.efficiency)
    efficiency.update(overrides.get("efficiency", {}))
    return gpu.with_overrides(peak_flops=peak, efficiency=efficiency,
                              memory_bandwidth_Bps=overrides.get("memory_bandwidth_Bps", gpu.memory_bandwidth_Bps),
                              launch_overhead_s=overrides.get("launch_overhead_s", gpu.launch_overhead_s))

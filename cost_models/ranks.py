"""The pipeline ranks of a layout on one cluster: the GPU a layer's price is computed on (the
reference), how much slower each pipeline rank runs than it, what memory each may use, and, when
data-parallel ranks mix GPU types, the share of each micro-batch each gets so all finish together.

On a one-type cluster every rank runs at the reference's speed; on a mixed one the slowest GPU
type of a pipeline rank paces it (its data-parallel replicas run in lockstep).

    ranks = PipelineRanks(cluster, LayoutGroups(cluster), splits, profile.layers)
    reference, speed, capacity = ranks.device_facts(ParallelLayout(dp=8))
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.domain.layout import ParallelLayout
from autopar.domain.mesh import mesh_of
from cost_models.hardware import GPUSpec
from cost_models.layer_split import LayerSplits
from cost_models.placement import LayoutGroups, proportional_shares
from cost_models.topology import ClusterSpec

if TYPE_CHECKING:
    from autopar.model_profile import LayerProfile

# (reference GPU, speed factor per pipeline rank, usable memory per pipeline rank in bytes)
DeviceFacts = tuple[GPUSpec, list[float], list[int]]


class PipelineRanks:
    """The speed and memory of each pipeline rank of a layout, and the data-parallel ranks' shares
    of a micro-batch; cached per rank layout.

    Args:
        cluster: where the ranks are (GPU types, memory headroom).
        groups: where a layout's groups sit (the GPU types of its pipeline and data-parallel ranks).
        splits: each layer kind's TP split (its compute time on each GPU type weighs the speeds).
        layers: the model's layers, in order.
    """

    def __init__(self, cluster: ClusterSpec, groups: LayoutGroups, splits: LayerSplits,
                 layers: list["LayerProfile"]):
        self.cluster = cluster
        self.groups = groups
        self.splits = splits
        self.layers = layers
        self._devices: dict[tuple, DeviceFacts | None] = {}

    def device_facts(self, layout: ParallelLayout) -> DeviceFacts | None:
        """(reference GPU, speed factor and usable memory per pipeline rank), or None when a TP
        group would mix GPU types. Cached per rank layout."""
        key = (mesh_of(layout), layout.micro_batch_size, tuple(getattr(layout, "dp_shares", ()) or ()))
        if key not in self._devices:
            self._devices[key] = self._compute_device_facts(layout)
        return self._devices[key]

    def reference_gpu(self, layout: ParallelLayout) -> GPUSpec:
        """The GPU a layout's per-layer prices are computed on (its first pipeline rank's).

        Raises:
            ValueError: a tensor-parallel group would mix GPU types (`device_facts` is None).
        """
        facts = self.device_facts(layout)
        if facts is None:
            raise ValueError("a tensor-parallel group would mix GPU types; change the mesh order or tp")
        return facts[0]

    def _compute_device_facts(self, layout: ParallelLayout) -> DeviceFacts | None:
        if layout.tp > 1 and not self.groups.tp_groups_homogeneous(layout):
            return None
        pp_gpus = self.groups.pp_rank_gpus(layout)
        reference = pp_gpus[0][0]
        if self.groups.homogeneous and not getattr(layout, "dp_shares", ()):
            # One GPU type, even shares: every pipeline rank runs at the reference's speed.
            return reference, [1.0] * layout.pp, [int(reference.memory_bytes
                                                      * (1 - self.cluster.memory_headroom_fraction))] * layout.pp
        distinct = {gpu.name: gpu for group in pp_gpus for gpu in group}
        total = {name: self._model_time_s(layout, gpu) for name, gpu in distinct.items()}
        # A pipeline rank's data-parallel replicas run in lockstep: the slowest GPU type paces it,
        # unless each data-parallel rank gets a share of the batch (then the slowest share does).
        slowest_gpu = [max(group, key=lambda g: total[g.name]) for group in pp_gpus]
        speed = [total[g.name] / total[reference.name] if total[reference.name] else 1.0 for g in slowest_gpu]
        shares = self.dp_shares(layout, total)
        if shares and total[reference.name]:
            gpus = self.groups.dp_rank_gpus(layout)
            speed = [max(b * total[g.name] for b, g in zip(shares, gpus))
                     / (layout.micro_batch_size * total[reference.name])]
        capacity = [int(min(g.memory_bytes for g in group) * (1 - self.cluster.memory_headroom_fraction))
                    for group in pp_gpus]
        return reference, speed, capacity

    def dp_shares(self, layout: ParallelLayout, total: dict[str, float] | None = None) -> tuple[int, ...]:
        """Samples per micro-batch of each data-parallel rank: the layout's own, or, when its
        data-parallel ranks mix GPU types (pp=1), shares in proportion to each GPU's speed
        (largest remainder, at least one each) so all finish together; () when even."""
        pinned = tuple(getattr(layout, "dp_shares", ()) or ())
        if pinned or layout.pp > 1 or layout.dp == 1 or self.groups.homogeneous:
            return pinned
        gpus = self.groups.dp_rank_gpus(layout)
        if len({g.name for g in gpus}) == 1:
            return ()
        if total is None:
            total = {g.name: self._model_time_s(layout, g) for g in gpus}
        return proportional_shares([1 / total[g.name] for g in gpus], layout.dp * layout.micro_batch_size)

    def _model_time_s(self, layout: ParallelLayout, gpu: GPUSpec) -> float:
        """Every layer's compute under the layout's TP split on ``gpu`` (what sets the speeds)."""
        return sum(self.splits.split(each.name, layout, gpu).compute.time_s(1.0, gpu.launch_overhead_s)
                   for each in self.layers)

"""ZeRO-3 as DeepSpeed ran it in 2021: a pricing runtime for published runs of that engine
(`train.zero3_runtime=deepspeed_2021`; Narayanan et al. 2021, Table 2, PUBLISHED.md A4), not
one autopar generates (its ZeRO-3 is FSDP2: one all-gather per block, prefetched behind compute).

What DeepSpeed's stage-3 code of that time (v0.3.12, the first with stage 3, to v0.5) did each
step (partition_parameters.py `_allgather_param`, `_reduce_scatter_gradient`; stage3.py's
parameter coordinator), and what each costs here, with stage 3's settings as DeepSpeed's own
Megatron GPT example set them when stage 3 came out (DeepSpeedExamples,
Megatron-LM-v1.1.5-ZeRO3/examples/ds_zero_stage_3_config.json, 2021-03-08): live parameters and
reuse distance 1e8 elements, prefetch bucket 2.5e7, reduce bucket 5e7, overlap_comm and
contiguous_gradients on; its persistence threshold is misspelt there (`persitance`), so the
library's 1e5 holds. The paper does not publish its configuration; the library's own defaults
(1e9, 1e9, 5e7, 5e8) let a 174.6B model prefetch nearly every gather.
- Every parameter tensor of at least PERSISTENCE_THRESHOLD elements is partitioned over the
  whole data-parallel group and gathered alone: one NCCL all-gather per tensor, not one per
  block. Smaller tensors (biases, norms) stay whole on every rank and are never gathered.
- Before each gather the host calls `torch.cuda.synchronize()`, so a gather never overlaps the
  compute queued before it. What overlaps is the coordinator's prefetch (stage3.py
  `PartitionedParameterCoordinator`, from the second step, when the first step's module trace
  is complete): right after a module's own fetch it starts the gather of the next module's
  tensors (until PREFETCH_BUCKET_ELEMENTS are in flight) on its communication stream, which
  then runs beside that module's compute; the next fetch waits for all of it. The prefetch is
  skipped while the tensors gathered and not yet released hold MAX_LIVE_PARAMETERS elements or
  more: a model whose single weight matrices exceed it (every matrix of A4's models: 0.15e9 to
  1.68e9 elements) prefetches only what follows a module without one. A module's tensors are
  released after its use unless the elements the module trace uses before their next use are
  fewer than MAX_REUSE_DISTANCE (`_keep_for_later`): under full recomputation, a layer's last
  module runs its backward right after its re-run forward and keeps its tensor for it.
  `exposed_gather_s` walks one layer's uses in that order (a layer's forward compute split
  over its gathered tensors by their size, its backward likewise); each collective is priced by
  the same alpha-beta model as every other collective (cost_models.collectives: a ring over
  1,536 ranks on 192 nodes pays 191 network latencies per tensor and 1,344 intra-node steps).
- A tensor is otherwise gathered for its forward, again when activation checkpointing re-runs
  the forward, and again for the backward; every gradient tensor is reduce-scattered alone
  (`_reduce_scatter_gradients`, the path of `contiguous_gradients: true`). overlap_comm (on by
  default for stage 3 in v0.3.13-v0.5) runs the reduction on its own stream, but the next
  gather's `torch.cuda.synchronize()` waits for it, so it is priced exposed.
- Tensors under PERSISTENCE_THRESHOLD stay whole and are never gathered in forward or
  backward, but the optimizer's step rewrites only each rank's partition, so every step ends by
  gathering all of them again (`_post_step`, v0.3.13-v0.5: `persistent_parameters[0].all_gather`)
  through the blocking coalesced path `_allgather_params`, which copies every rank's piece of
  every such tensor into place from a Python loop: per tensor, one narrow, a view, a narrow and
  a copy launch for each rank whose piece lies inside it (`persistent_regather_s`). Every bias
  and norm of the model, times the ranks: 1.8 million launches a step for A4's 529.6B on 2240
  GPUs.
- Not priced: v0.3.13-v0.4's default `contiguous_gradients: false` (the example sets it true),
  under which stage 3 instead
  all-reduces flattened buckets of whole gradients (`buffered_reduce_fallback`). Priced that way
  (one all-reduce per 5e8-element bucket, the default then, six memory passes for flatten,
  divide and copy back)
  A4's ZeRO-3 traffic comes out cheaper, not dearer (2240 GPUs, 529.6B: 81 s a step instead of
  106 s; 1536 GPUs, 174.6B: 35 s instead of 55 s), further from what the paper measured, so the
  reduce-scatter path is kept as the one the paper ran.
- Both collectives take Python lists of one view per rank. DeepSpeed builds the views in a
  Python loop (HOST_VIEW_S per rank; the gather's loop also asks
  `torch.distributed.get_rank(group=...)` at every rank to find its own piece, GROUP_RANK_S, so
  GATHER_VIEW_S a rank, in each release read, v0.3.12 to v0.5.5); torch's list reduce-scatter
  then copies every rank's piece into a flat buffer, one kernel launch per rank, before NCCL
  starts. The gather's copies out of NCCL's flat output are queued behind the ring (hidden),
  but move its bytes again: a zeroed buffer, NCCL's output and the copy (read and write) are 4
  bytes of memory traffic per byte gathered, the reduce-scatter's copy in 2.
- Before that, stage 3's own passes over each whole gradient (stage3.py): with
  `contiguous_gradients` it is copied into the reduction bucket (`ipg_buffer`, read and write)
  unless it alone exceeds the bucket (REDUCE_BUCKET_ELEMENTS; then it is reduced where it lies),
  and `average_tensor` divides the bucket and any such gradient by the group size in place
  (`tensor.div_`, read and write) before the reduce-scatter.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from cost_models.collectives import Collective, exposed_s
from cost_models.topology import GroupPlacement

PERSISTENCE_THRESHOLD = 100_000  # stage3_param_persistence_threshold's default (the example misspells it)
# One `flat.narrow(0, offset, size)` and `list.append` from Python, per rank: 1.6 us measured
# with torch 2.x on the 2-core CI machine (2021's dispatcher was no faster); not fitted to A4.
HOST_VIEW_S = 1.6e-6
# `torch.distributed.get_rank(group=g)` for a group that is not the default one (Megatron hands
# stage 3 its data-parallel group), once per rank inside `_allgather_param`'s views loop: that
# loop measured 1.6x the views alone (median of eight runs) with torch 2.x on the same machine (its lookups of the
# default group and of the group's rank table, as torch 1.8's `_get_group_rank` made them).
GROUP_RANK_S = 1.0e-6
GATHER_VIEW_S = HOST_VIEW_S + GROUP_RANK_S  # one rank of a gather's loop: a view, an append, a get_rank
GATHER_MEMORY_PASSES = 4
SCATTER_MEMORY_PASSES = 2  # torch's copy of the list into one flat input
DIVIDE_MEMORY_PASSES = 2  # average_tensor's in-place division by the group size
BUCKET_COPY_MEMORY_PASSES = 2  # the copy into the contiguous reduction bucket
REDUCE_BUCKET_ELEMENTS = 50_000_000  # reduce_bucket_size, the example's (default 5e8)
REDUCE_BUCKETS = 2  # ipg_buffer: one, and a second to fill while the first reduces under overlap_comm
MAX_LIVE_PARAMETERS = 100_000_000  # stage3_max_live_parameters, the example's (default 1e9): no prefetch at it
MAX_REUSE_DISTANCE = 100_000_000  # stage3_max_reuse_distance, the example's (default 1e9): kept if reused within it
PREFETCH_BUCKET_ELEMENTS = 25_000_000  # stage3_prefetch_bucket_size, the example's (default 5e7)
# One pass of `_allgather_params`' copy loop: narrow, view, narrow (HOST_VIEW_S each) and a copy launch.
REGATHER_VIEWS_PER_PIECE = 3


def per_tensor_buffers(largest_numel: float, weights_bytes: int, grads_bytes: int) -> dict[str, float]:
    """Memory beside the model states while the largest tensor is in flight: in forward the
    gathered tensor and the all-gather's flat output (torch gathers into one buffer and copies
    into the list's views), in backward its whole gradient and the reduce-scatter's flattened
    input. Below stage3_max_live_parameters the coordinator prefetches the next tensor while it
    is live, so a second one is gathered beside it (priced as large: the bound); at or above it
    (every matrix of A4's models) it is held alone. FSDP2's buffers are a whole block's, and two of them. Beside
    them, all through the step, the two contiguous reduction buckets (`ipg_buffer`, two with
    overlap_comm) the gradients are copied into."""
    gathered = 3 if largest_numel < MAX_LIVE_PARAMETERS else 2
    return {"zero3_gathered_params": gathered * largest_numel * weights_bytes,
            "gradient_reduce": 2 * largest_numel * grads_bytes,
            "reduce_buckets": REDUCE_BUCKETS * REDUCE_BUCKET_ELEMENTS * grads_bytes}


def gradient_memory_passes(numel: float) -> int:
    """Bytes of memory traffic per gradient byte before and around its reduce-scatter: the copy
    into the reduction bucket (a gradient larger than the bucket is reduced in place), the
    division by the group size and torch's flattening of the list."""
    bucket_copy = BUCKET_COPY_MEMORY_PASSES if numel <= REDUCE_BUCKET_ELEMENTS else 0
    return bucket_copy + DIVIDE_MEMORY_PASSES + SCATTER_MEMORY_PASSES


TensorId = tuple[int, int]  # (which copy of the layer, which of its gathered tensors)


@dataclass(frozen=True)
class TensorUse:
    """One module's use of a gathered tensor, in the order the coordinator's trace sees it."""

    tensor: TensorId
    compute_s: float


def _reuse_distance(uses: list[TensorUse], at: int, numels: dict[TensorId, float]) -> float:
    """Elements the uses between `at` and the next use of the same tensor gather (infinite if
    it is not used again), as `get_reuse_distance_in_numel` counts them."""
    for later in range(at + 1, len(uses)):
        if uses[later].tensor == uses[at].tensor:
            return sum(numels[use.tensor] for use in uses[at + 1:later])
    return float("inf")


def exposed_gather_s(uses: list[TensorUse], numels: dict[TensorId, float],
                     gather_s: dict[TensorId, float], host_s: dict[TensorId, float]) -> float:
    """Seconds the gathers of `uses` leave exposed under stage 3's coordinator: a fetch waits for
    what is in flight (less the compute it ran beside, plus the interference of running beside it:
    `collectives.exposed_s`) and gathers what is missing; then, unless
    MAX_LIVE_PARAMETERS elements are live, the next tensors are prefetched beside this use's
    compute; after the use the tensor is released unless reused within MAX_REUSE_DISTANCE. The
    host's per-rank views of every gather (`host_s`) run while the GPU waits."""
    exposed = 0.0
    live: set[TensorId] = set()
    in_flight: list[TensorId] = []
    overlap = 0.0
    for at, use in enumerate(uses):
        if in_flight:
            exposed += exposed_s(sum(gather_s[t] for t in in_flight), overlap)
            live.update(in_flight)
            in_flight = []
        if use.tensor not in live:
            exposed += gather_s[use.tensor] + host_s[use.tensor]
            live.add(use.tensor)
        if sum(numels[t] for t in live) < MAX_LIVE_PARAMETERS:
            queued = 0.0
            for later in uses[at + 1:]:
                if queued >= PREFETCH_BUCKET_ELEMENTS:
                    break
                if later.tensor not in live and later.tensor not in in_flight:
                    in_flight.append(later.tensor)
                    queued += numels[later.tensor]
                    exposed += host_s[later.tensor]
        overlap = use.compute_s
        if _reuse_distance(uses, at, numels) >= MAX_REUSE_DISTANCE:
            live.discard(use.tensor)
    return exposed


def persistent_regather_s(numels: tuple[float, ...], group_size: int, launch_overhead_s: float) -> float:
    """Host seconds of the step-end gather of the tensors stage 3 keeps whole (`_post_step`'s
    `_allgather_params`): for each, a Python narrow, view, narrow and copy launch per rank whose
    piece (ceil(numel / ranks) elements) starts inside it. The gather's bytes are a few
    megabytes, priced with the reduce-scatters of the same tensors as negligible beside this."""
    per_piece = REGATHER_VIEWS_PER_PIECE * HOST_VIEW_S + launch_overhead_s
    pieces = 0
    for numel in numels:
        if numel >= PERSISTENCE_THRESHOLD or numel <= 0:
            continue
        piece = math.ceil(numel / group_size)
        pieces += min(group_size, math.ceil(numel / piece))
    return pieces * per_piece


@dataclass(frozen=True)
class PerTensorZero3:
    """One layer's ZeRO-3 traffic per micro-batch, one collective per tensor, gathers overlapped
    only by the coordinator's prefetch."""

    tensor_numels: tuple[float, ...]
    weights_bytes: float
    grads_bytes: float
    group: GroupPlacement
    launch_overhead_s: float
    memory_bandwidth_Bps: float

    def gathered(self) -> list[int]:
        """The tensors stage 3 gathers (the others stay whole), in the layer's order."""
        return [i for i, numel in enumerate(self.tensor_numels) if numel >= PERSISTENCE_THRESHOLD]

    def passes(self, forward_s: float, backward_s: float, full_recompute: bool,
               layers: int) -> tuple[list[TensorUse], list[TensorUse]]:
        """`layers` consecutive identical layers' module uses in forward, and in backward (re-run
        forward, if any, then backward in reverse), each use carrying its share (by size) of the
        layer's compute."""
        gathered = self.gathered()
        total = sum(self.tensor_numels[i] for i in gathered) or 1.0
        forward = [(i, forward_s * self.tensor_numels[i] / total) for i in gathered]
        backward = [(i, backward_s * self.tensor_numels[i] / total) for i in reversed(gathered)]
        backward = (forward if full_recompute else []) + backward
        return ([TensorUse((copy, i), s) for copy in range(layers) for i, s in forward],
                [TensorUse((copy, i), s) for copy in range(layers) for i, s in backward])

    def seconds(self, collective_s: Callable[[Collective, float, GroupPlacement], float],
                forward_s: float, backward_s: float, full_recompute: bool) -> float:
        """Seconds the layer's gathers (walked by `exposed_gather_s`: forward, the re-run forward
        under full recomputation, backward) and gradient reduce-scatters add to a micro-batch in
        which it computes `forward_s` and `backward_s`. A layer is priced in steady state, the
        prefetch across the layer boundary included: the walk over two layers less the walk over
        one."""
        n = self.group.size
        if n <= 1:
            return 0.0
        total = 0.0
        for numel in self.tensor_numels:
            scatter_bytes = numel * self.grads_bytes
            total += (collective_s(Collective.REDUCE_SCATTER, scatter_bytes, self.group)
                      + n * (HOST_VIEW_S + self.launch_overhead_s)
                      + gradient_memory_passes(numel) * scatter_bytes / self.memory_bandwidth_Bps)
        gather_bytes = {i: self.tensor_numels[i] * self.weights_bytes for i in self.gathered()}
        wire_s = {i: collective_s(Collective.ALL_GATHER, size, self.group)
                  + GATHER_MEMORY_PASSES * size / self.memory_bandwidth_Bps for i, size in gather_bytes.items()}
        keys = [(copy, i) for copy in range(2) for i in gather_bytes]
        gather_s = {key: wire_s[key[1]] for key in keys}
        host_s = {key: n * GATHER_VIEW_S for key in keys}
        numels = {key: self.tensor_numels[key[1]] for key in keys}

        def walked_s(layers: int) -> float:
            return sum(exposed_gather_s(uses, numels, gather_s, host_s)
                       for uses in self.passes(forward_s, backward_s, full_recompute, layers))

        return total + walked_s(2) - walked_s(1)

    def persistent_regather_s(self) -> float:
        """This layer's part of the step-end gather of the tensors kept whole."""
        return persistent_regather_s(self.tensor_numels, self.group.size, self.launch_overhead_s)

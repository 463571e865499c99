"""ZeRO-3 as DeepSpeed ran it in 2021: a pricing runtime for published runs of that engine
(`train.zero3_runtime=deepspeed_2021`; Narayanan et al. 2021, Table 2, PUBLISHED.md A4), not
one autopar generates (its ZeRO-3 is FSDP2: one all-gather per block, prefetched behind compute).

What DeepSpeed's stage-3 code of that time did each step (partition_parameters.py `_allgather_param`,
`_reduce_scatter_gradient`; stage3.py's parameter coordinator), and what each costs here:
- Every parameter tensor of at least PERSISTENCE_THRESHOLD elements is partitioned over the
  whole data-parallel group and gathered alone: one NCCL all-gather per tensor, not one per
  block. Smaller tensors (biases, norms) stay whole on every rank and are never gathered.
- Before each gather the host calls `torch.cuda.synchronize()`: the gather waits for every
  queued kernel, and the next kernel waits for the gather. Nothing overlaps; each collective is
  priced whole, after the compute, by the same alpha-beta model as every other collective
  (cost_models.collectives: a ring over 1,536 ranks pays 1,535 per-step latencies per tensor).
- A tensor is gathered for its forward, again when activation checkpointing re-runs the forward,
  and again for the backward (released after each); every gradient tensor is reduce-scattered
  alone (`_reduce_scatter_gradients`, the path of `contiguous_gradients: true`). overlap_comm
  (on by default for stage 3 in v0.3.13-v0.5) runs the reduction on its own stream, but the
  next gather's `torch.cuda.synchronize()` waits for it, so it is priced exposed too.
- Not priced: v0.3.13-v0.4's default `contiguous_gradients: false`, under which stage 3 instead
  all-reduces flattened buckets of whole gradients (`buffered_reduce_fallback`). Priced that way
  (one all-reduce per 5e8-element bucket, six memory passes for flatten, divide and copy back)
  A4's ZeRO-3 traffic comes out cheaper, not dearer (2240 GPUs, 529.6B: 81 s a step instead of
  106 s; 1536 GPUs, 174.6B: 35 s instead of 55 s), further from what the paper measured, so the
  reduce-scatter path is kept as the one the paper ran.
- Both collectives take Python lists of one view per rank. DeepSpeed builds the views in a
  Python loop (HOST_VIEW_S per rank); torch's list reduce-scatter then copies every rank's piece
  into a flat buffer, one kernel launch per rank, before NCCL starts. The gather's copies out of
  NCCL's flat output are queued behind the ring (hidden), but move its bytes again: a zeroed
  buffer, NCCL's output and the copy (read and write) are 4 bytes of memory traffic per byte
  gathered, the reduce-scatter's copy in 2.
- Before that, stage 3's own passes over each whole gradient (stage3.py): with
  `contiguous_gradients` it is copied into the reduction bucket (`ipg_buffer`, read and write)
  unless it alone exceeds the bucket (REDUCE_BUCKET_ELEMENTS; then it is reduced where it lies),
  and `average_tensor` divides the bucket and any such gradient by the group size in place
  (`tensor.div_`, read and write) before the reduce-scatter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from cost_models.collectives import Collective
from cost_models.topology import GroupPlacement

PERSISTENCE_THRESHOLD = 100_000  # stage3_param_persistence_threshold's default
# One `flat.narrow(0, offset, size)` and `list.append` from Python, per rank: 1.6 us measured
# with torch 2.x on the 2-core CI machine (2021's dispatcher was no faster); not fitted to A4.
HOST_VIEW_S = 1.6e-6
GATHER_MEMORY_PASSES = 4
SCATTER_MEMORY_PASSES = 2  # torch's copy of the list into one flat input
DIVIDE_MEMORY_PASSES = 2  # average_tensor's in-place division by the group size
BUCKET_COPY_MEMORY_PASSES = 2  # the copy into the contiguous reduction bucket
REDUCE_BUCKET_ELEMENTS = 500_000_000  # stage 3's reduce_bucket_size default
REDUCE_BUCKETS = 2  # ipg_buffer: one, and a second to fill while the first reduces under overlap_comm


def per_tensor_buffers(largest_numel: float, weights_bytes: int, grads_bytes: int) -> dict[str, float]:
    """Memory beside the model states while one tensor is in flight, the largest: in forward the
    gathered tensor and the all-gather's flat output (torch gathers into one buffer and copies
    into the list's views), in backward its whole gradient and the reduce-scatter's flattened
    input. Prefetching a further tensor waits while stage3_max_live_parameters (1e9 elements)
    are gathered, so the largest tensor of a model this runtime was used for is held alone;
    FSDP2's buffers are a whole block's, and two of them. Beside them, all through the step, the
    two contiguous reduction buckets (`ipg_buffer`, two with overlap_comm) the gradients are
    copied into."""
    return {"zero3_gathered_params": 2 * largest_numel * weights_bytes,
            "gradient_reduce": 2 * largest_numel * grads_bytes,
            "reduce_buckets": REDUCE_BUCKETS * REDUCE_BUCKET_ELEMENTS * grads_bytes}


def gradient_memory_passes(numel: float) -> int:
    """Bytes of memory traffic per gradient byte before and around its reduce-scatter: the copy
    into the reduction bucket (a gradient larger than the bucket is reduced in place), the
    division by the group size and torch's flattening of the list."""
    bucket_copy = BUCKET_COPY_MEMORY_PASSES if numel <= REDUCE_BUCKET_ELEMENTS else 0
    return bucket_copy + DIVIDE_MEMORY_PASSES + SCATTER_MEMORY_PASSES


@dataclass(frozen=True)
class PerTensorZero3:
    """One layer's ZeRO-3 traffic per micro-batch, one collective per tensor, nothing overlapped."""

    tensor_numels: tuple[float, ...]
    weights_bytes: float
    grads_bytes: float
    group: GroupPlacement
    launch_overhead_s: float
    memory_bandwidth_Bps: float

    def seconds(self, collective_s: Callable[[Collective, float, GroupPlacement], float], gathers: int) -> float:
        """Seconds the layer's gathers (`gathers` per tensor: 3 under full recomputation, else 2)
        and gradient reduce-scatters add to a micro-batch."""
        n = self.group.size
        if n <= 1:
            return 0.0
        total = 0.0
        for numel in self.tensor_numels:
            scatter_bytes = numel * self.grads_bytes
            total += (collective_s(Collective.REDUCE_SCATTER, scatter_bytes, self.group)
                      + n * (HOST_VIEW_S + self.launch_overhead_s)
                      + gradient_memory_passes(numel) * scatter_bytes / self.memory_bandwidth_Bps)
            if numel < PERSISTENCE_THRESHOLD:
                continue
            gather_bytes = numel * self.weights_bytes
            total += gathers * (collective_s(Collective.ALL_GATHER, gather_bytes, self.group) + n * HOST_VIEW_S
                                + GATHER_MEMORY_PASSES * gather_bytes / self.memory_bandwidth_Bps)
        return total

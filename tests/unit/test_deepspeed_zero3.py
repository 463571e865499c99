"""DeepSpeed's 2021 ZeRO-3 priced per tensor (cost_models/deepspeed_zero3.py), against hand-worked
numbers, and as the A4 runs behaved: at a fixed batch, more GPUs do not shorten its step."""
from types import SimpleNamespace

import pytest

from cost_models.collectives import Collective
from cost_models.deepspeed_zero3 import HOST_VIEW_S, PERSISTENCE_THRESHOLD, REDUCE_BUCKET_ELEMENTS, PerTensorZero3


def _wire_s(op, nbytes, group):
    """A stand-in collective: 1 ms per GB, and 1 ms more for a reduce-scatter."""
    return nbytes * 1e-12 + (1e-3 if op is Collective.REDUCE_SCATTER else 0.0)


def _traffic(numels, ranks=100):
    return PerTensorZero3(tuple(numels), weights_bytes=2, grads_bytes=4, group=SimpleNamespace(size=ranks),
                          launch_overhead_s=9e-6, memory_bandwidth_Bps=1e12)


def test_a_large_tensor_is_gathered_per_pass_and_reduce_scattered_once():
    numel = 1_000_000  # 2 MB of weights, 4 MB of gradients
    gather = 2e6 * 1e-12 + 100 * HOST_VIEW_S + 4 * 2e6 / 1e12
    # memory: the copy into the bucket, the division and torch's flattening, each a read and a write
    scatter = 4e6 * 1e-12 + 1e-3 + 100 * (HOST_VIEW_S + 9e-6) + 6 * 4e6 / 1e12
    assert _traffic([numel]).seconds(_wire_s, gathers=3) == pytest.approx(3 * gather + scatter)
    assert _traffic([numel]).seconds(_wire_s, gathers=2) == pytest.approx(2 * gather + scatter)


def test_a_tensor_below_the_persistence_threshold_is_only_reduce_scattered():
    small = PERSISTENCE_THRESHOLD - 1
    scatter = small * 4 * 1e-12 + 1e-3 + 100 * (HOST_VIEW_S + 9e-6) + 6 * small * 4 / 1e12
    assert _traffic([small]).seconds(_wire_s, gathers=3) == pytest.approx(scatter)


def test_a_gradient_larger_than_the_reduction_bucket_is_not_copied_into_it():
    """Stage 3 reduces a gradient of more than reduce_bucket_size elements where it lies: divided
    and flattened (4 bytes of traffic per byte), not copied into the bucket first (6)."""
    large, fits = REDUCE_BUCKET_ELEMENTS + 1, REDUCE_BUCKET_ELEMENTS
    per_byte = {numel: (_traffic([numel]).seconds(_wire_s, gathers=0) - 1e-3 - 100 * (HOST_VIEW_S + 9e-6))
                / (numel * 4) for numel in (large, fits)}
    assert per_byte[large] == pytest.approx(1e-12 + 4 / 1e12)
    assert per_byte[fits] == pytest.approx(1e-12 + 6 / 1e12)


def test_the_host_work_grows_with_the_ranks_and_one_rank_moves_nothing():
    """Each collective builds one view per rank (and the reduce-scatter copies one piece per rank)."""
    few, many = _traffic([10**6], ranks=10), _traffic([10**6], ranks=1000)
    per_rank = 3 * HOST_VIEW_S + HOST_VIEW_S + 9e-6
    assert many.seconds(_wire_s, 3) - few.seconds(_wire_s, 3) == pytest.approx(990 * per_rank)
    assert _traffic([10**6], ranks=1).seconds(_wire_s, 3) == 0.0


def test_the_pricer_prices_a_layout_as_deepspeed_2021_ran_it():
    """Through the pricer (its groups' collectives): the same ZeRO-3 layout is slower as DeepSpeed's
    2021 code ran it (every tensor gathered alone behind a synchronize, three times a step under
    recomputation) than as FSDP2 prefetches and overlaps it; ZeRO-2 is priced the same by both."""
    from cost_models.step import ParallelLayout, TrainSpec, estimate
    from cost_models.topology import ClusterConfig, ClusterSpec
    from tests.profiles import gpt

    profile = gpt()
    cluster = ClusterSpec.from_config(ClusterConfig(name="t", gpu="A100-80GB", nodes=2, gpus_per_node=8))
    zero3 = ParallelLayout(dp=16, zero_stage=3, micro_batch_size=1, num_micro_batches=1)
    fsdp2, deepspeed = (TrainSpec(global_batch_size=16, zero3_runtime=runtime) for runtime in ("fsdp2",
                                                                                              "deepspeed_2021"))
    slower = estimate(profile, cluster, zero3, deepspeed).step_time_s
    assert slower > estimate(profile, cluster, zero3, fsdp2).step_time_s
    zero2 = ParallelLayout(dp=16, zero_stage=2, micro_batch_size=1, num_micro_batches=1)
    assert estimate(profile, cluster, zero2, deepspeed).step_time_s == estimate(profile, cluster, zero2,
                                                                                fsdp2).step_time_s


def test_deepspeed_holds_one_tensor_in_flight_where_fsdp2_holds_two_blocks():
    """Beside the model states DeepSpeed's 2021 stage 3 holds the largest tensor gathered (and the
    all-gather's flat output) and its gradient (and the reduce-scatter's flat input), and all the
    while its two 5e8-element gradient buckets; FSDP2 holds a block gathered and the next
    prefetched, and the block's fp32 gradient."""
    import math

    from cost_models.step import ParallelLayout, TrainSpec, estimate
    from cost_models.topology import ClusterConfig, ClusterSpec
    from tests.profiles import gpt

    profile = gpt()
    cluster = ClusterSpec.from_config(ClusterConfig(name="t", gpu="A100-80GB", nodes=2, gpus_per_node=8))
    zero3 = ParallelLayout(dp=16, zero_stage=3, micro_batch_size=1, num_micro_batches=1)
    train = {runtime: TrainSpec(global_batch_size=16, zero3_runtime=runtime, precision="bf16")
             for runtime in ("fsdp2", "deepspeed_2021")}
    buffers = {runtime: estimate(profile, cluster, zero3, spec).memory_breakdown["buffers"]
               for runtime, spec in train.items()}
    block = max(layer.param_count for layer in profile.layers)
    tensor = max(math.prod(shape) for shape in profile.param_shapes.values())
    # bf16 weights and gradients (2 bytes each); FSDP2 reduces from fp32 (4 bytes).
    fsdp2, deepspeed = 2 * block * 2 + block * 4, 2 * tensor * 2 + 2 * tensor * 2 + 2 * 500_000_000 * 2
    assert buffers["fsdp2"] - buffers["deepspeed_2021"] == fsdp2 - deepspeed

"""DeepSpeed's 2021 ZeRO-3 priced per tensor (cost_models/deepspeed_zero3.py), against hand-worked
numbers: its coordinator's prefetch and reuse, and the gather of the whole tensors every step."""
from types import SimpleNamespace

import pytest

from cost_models.collectives import OVERLAP_INTERFERENCE, Collective
from cost_models.deepspeed_zero3 import (GATHER_VIEW_S, HOST_VIEW_S, MAX_LIVE_PARAMETERS, MAX_REUSE_DISTANCE,
                                         PERSISTENCE_THRESHOLD, REDUCE_BUCKET_ELEMENTS, PerTensorZero3, TensorUse,
                                         exposed_gather_s, per_tensor_buffers, persistent_regather_s)


def _wire_s(op, nbytes, group):
    """A stand-in collective: 1 ms per GB, and 1 ms more for a reduce-scatter."""
    return nbytes * 1e-12 + (1e-3 if op is Collective.REDUCE_SCATTER else 0.0)


def _traffic(numels, ranks=100):
    return PerTensorZero3(tuple(numels), weights_bytes=2, grads_bytes=4, group=SimpleNamespace(size=ranks),
                          launch_overhead_s=9e-6, memory_bandwidth_Bps=1e12)


def _scatter_s(numel, ranks=100, memory_passes=6):
    return numel * 4 * 1e-12 + 1e-3 + ranks * (HOST_VIEW_S + 9e-6) + memory_passes * numel * 4 / 1e12


def _gather_s(numel, ranks=100):
    """Wire, the per-rank views (and get_rank) on the host, and four bytes of memory traffic per
    byte gathered."""
    return numel * 2 * 1e-12 + ranks * GATHER_VIEW_S + 4 * numel * 2 / 1e12


def test_a_tensor_reused_right_away_is_kept_between_its_rerun_and_its_backward():
    """Without compute to hide behind: one tensor is gathered for forward and once more for the
    re-run forward, whose gather the backward right after it reuses (reuse distance 0); two
    tensors of 6e7 elements: the first's reuse distance (the second's re-run and backward, 1.2e8
    elements) passes stage3_max_reuse_distance (1e8), so it is gathered a third time."""
    one = 1_000_000
    assert _traffic([one]).seconds(_wire_s, 0.0, 0.0, full_recompute=True) == pytest.approx(
        2 * _gather_s(one) + _scatter_s(one))
    assert _traffic([one]).seconds(_wire_s, 0.0, 0.0, full_recompute=False) == pytest.approx(
        2 * _gather_s(one) + _scatter_s(one))
    big = 60_000_000  # above the reduction bucket: reduced where it lies (4 passes, not 6)
    assert 2 * big >= MAX_REUSE_DISTANCE > big > REDUCE_BUCKET_ELEMENTS
    assert _traffic([big, big]).seconds(_wire_s, 0.0, 0.0, full_recompute=True) == pytest.approx(
        5 * _gather_s(big) + 2 * _scatter_s(big, memory_passes=4))


def test_the_prefetch_hides_a_gather_behind_the_module_before_it_unless_too_much_is_live():
    """With compute far longer than any gather, every gather is hidden: each module prefetches the
    next one's tensor, the last one the next layer's first; both tensors are reused within
    stage3_max_reuse_distance, so the backward gathers nothing. What is left is the host's views
    of the forward's and the re-run's gathers (they run while the GPU waits) and the
    reduce-scatters, and the overlapped gathers' interference with the compute beside them
    (collectives.OVERLAP_INTERFERENCE). Tensors of stage3_max_live_parameters elements are never
    prefetched (and never kept): nothing is hidden."""
    small = [1_000_000, 2_000_000]
    hidden = _traffic(small).seconds(_wire_s, 10.0, 20.0, full_recompute=True)
    host = sum(2 * 100 * GATHER_VIEW_S for _ in small)
    wire = sum(2 * (_gather_s(n) - 100 * GATHER_VIEW_S) for n in small)
    assert hidden == pytest.approx(host + OVERLAP_INTERFERENCE * wire + sum(_scatter_s(n) for n in small))
    large = [MAX_LIVE_PARAMETERS, MAX_LIVE_PARAMETERS]
    exposed = _traffic(large).seconds(_wire_s, 10.0, 20.0, full_recompute=True)
    assert exposed == pytest.approx(_traffic(large).seconds(_wire_s, 0.0, 0.0, full_recompute=True))


def test_a_tensor_below_the_persistence_threshold_is_only_reduce_scattered():
    small = PERSISTENCE_THRESHOLD - 1
    assert _traffic([small]).seconds(_wire_s, 1.0, 2.0, full_recompute=True) == pytest.approx(_scatter_s(small))


def test_a_gradient_larger_than_the_reduction_bucket_is_not_copied_into_it():
    """Stage 3 reduces a gradient of more than reduce_bucket_size elements where it lies: divided
    and flattened (4 bytes of traffic per byte), not copied into the bucket first (6)."""
    large, fits = REDUCE_BUCKET_ELEMENTS + 1, REDUCE_BUCKET_ELEMENTS
    assert _traffic([large]).seconds(_wire_s, 0.0, 0.0, False) - 2 * _gather_s(large) == pytest.approx(
        _scatter_s(large, memory_passes=4))
    assert _traffic([fits]).seconds(_wire_s, 0.0, 0.0, False) - 2 * _gather_s(fits) == pytest.approx(
        _scatter_s(fits, memory_passes=6))


def test_the_host_work_grows_with_the_ranks_and_one_rank_moves_nothing():
    """Each collective builds one view per rank (the gather asks its rank in the group at each of
    them, and the reduce-scatter copies one piece per rank)."""
    few, many = _traffic([10**6], ranks=10), _traffic([10**6], ranks=1000)
    per_rank = 2 * GATHER_VIEW_S + HOST_VIEW_S + 9e-6
    assert many.seconds(_wire_s, 0.0, 0.0, True) - few.seconds(_wire_s, 0.0, 0.0, True) == pytest.approx(
        990 * per_rank)
    assert _traffic([10**6], ranks=1).seconds(_wire_s, 0.0, 0.0, True) == 0.0


def test_every_step_ends_regathering_the_whole_tensors_one_piece_per_rank_from_python():
    """`_post_step` gathers every tensor kept whole again, copying each rank's piece (ceil(numel /
    ranks) elements) into place: a 20480-element norm on 2240 ranks has pieces of 10, 2048 of them
    inside it, each a narrow, a view, a narrow and a copy launch. Gathered tensors are not in it."""
    per_piece = 3 * HOST_VIEW_S + 9e-6
    assert persistent_regather_s((20480,), 2240, 9e-6) == pytest.approx(2048 * per_piece)
    assert persistent_regather_s((20480, PERSISTENCE_THRESHOLD), 8, 9e-6) == pytest.approx(8 * per_piece)
    assert _traffic([20480, 10**6], ranks=2240).persistent_regather_s() == pytest.approx(2048 * per_piece)


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


def test_deepspeed_holds_its_largest_tensors_in_flight_where_fsdp2_holds_two_blocks():
    """Beside the model states DeepSpeed's 2021 stage 3 holds the largest tensor gathered, a second
    one prefetched beside it (below stage3_max_live_parameters elements) and that gather's flat
    output, the largest gradient (and the reduce-scatter's flat input), and all the while its two
    gradient buckets (reduce_bucket_size elements each); FSDP2 holds a block gathered and the next prefetched, and the
    block's fp32 gradient. A tensor of stage3_max_live_parameters elements is held alone."""
    import math

    from cost_models.step import ParallelLayout, TrainSpec, estimate
    from cost_models.topology import ClusterConfig, ClusterSpec
    from tests.profiles import gpt

    profile = gpt()
    cluster = ClusterSpec.from_config(ClusterConfig(name="t", gpu="A100-80GB", nodes=2, gpus_per_node=8))
    zero3 = ParallelLayout(dp=16, zero_stage=3, micro_batch_size=1, num_micro_batches=1)
    # DeepSpeed reduces its 16-bit gradients as computed; FSDP2 from an fp32 copy.
    train = {"fsdp2": TrainSpec(global_batch_size=16, zero3_runtime="fsdp2", precision="bf16"),
             "deepspeed_2021": TrainSpec(global_batch_size=16, zero3_runtime="deepspeed_2021", precision="bf16",
                                         grad_reduce_dtype="compute")}
    buffers = {runtime: estimate(profile, cluster, zero3, spec).memory_breakdown["buffers"]
               for runtime, spec in train.items()}
    block = max(layer.param_count for layer in profile.layers)
    tensor = max(math.prod(shape) for shape in profile.param_shapes.values())
    # bf16 weights and gradients (2 bytes each); FSDP2 reduces from fp32 (4 bytes).
    fsdp2, deepspeed = 2 * block * 2 + block * 4, 3 * tensor * 2 + 2 * tensor * 2 + 2 * REDUCE_BUCKET_ELEMENTS * 2
    assert buffers["fsdp2"] - buffers["deepspeed_2021"] == fsdp2 - deepspeed
    alone, prefetched = (per_tensor_buffers(n, 2, 2)["zero3_gathered_params"]
                         for n in (MAX_LIVE_PARAMETERS, MAX_LIVE_PARAMETERS - 1))
    assert (alone, prefetched) == (2 * MAX_LIVE_PARAMETERS * 2, 3 * (MAX_LIVE_PARAMETERS - 1) * 2)


def test_two_layers_price_a_layer_in_steady_state():
    """`PerTensorZero3.seconds` prices a layer as the walk over two identical layers less the walk
    over one: exact when every further layer costs the same, which the walk over three layers
    shows (forward, and re-run forward then backward), with tensors below and above the live
    limit and compute that hides some gathers and not others. A layer's first gather is
    prefetched behind the layer before only when that layer's last tensor is under the limit."""
    compute = (0.003, 0.0005, 0.02)

    def walk(numels: tuple[float, ...], layers: int, backward: bool) -> float:
        order = [(i, compute[i]) for i in range(3)]
        if backward:
            order = order + [(i, 2 * compute[i]) for i in reversed(range(3))]
        uses = [TensorUse((copy, i), s) for copy in range(layers) for i, s in order]
        keys = {(copy, i) for copy in range(layers) for i in range(3)}
        return exposed_gather_s(uses, {k: numels[k[1]] for k in keys}, {k: 1e-3 * (1 + k[1]) for k in keys},
                                {k: 1e-4 for k in keys})

    last_large, last_small = (4e7, 2e7, 1.5 * MAX_LIVE_PARAMETERS), (4e7, 1.5 * MAX_LIVE_PARAMETERS, 2e7)
    for numels in (last_large, last_small):
        for backward in (False, True):
            one, two, three = (walk(numels, n, backward) for n in (1, 2, 3))
            assert three - two == pytest.approx(two - one)
    assert walk(last_large, 2, False) - walk(last_large, 1, False) == pytest.approx(walk(last_large, 1, False))
    assert walk(last_small, 2, False) - walk(last_small, 1, False) < walk(last_small, 1, False)

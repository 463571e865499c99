"""DeepSpeed's 2021 ZeRO-3 priced per tensor (cost_models/deepspeed_zero3.py), against hand-worked
numbers, and as the A4 runs behaved: at a fixed batch, more GPUs do not shorten its step."""
from types import SimpleNamespace

import pytest

from cost_models.collectives import Collective
from cost_models.deepspeed_zero3 import HOST_VIEW_S, PERSISTENCE_THRESHOLD, PerTensorZero3


def _wire_s(op, nbytes, group):
    """A stand-in collective: 1 ms per GB, and 1 ms more for a reduce-scatter."""
    return nbytes * 1e-12 + (1e-3 if op is Collective.REDUCE_SCATTER else 0.0)


def _traffic(numels, ranks=100):
    return PerTensorZero3(tuple(numels), weights_bytes=2, grads_bytes=4, group=SimpleNamespace(size=ranks),
                          launch_overhead_s=9e-6, memory_bandwidth_Bps=1e12)


def test_a_large_tensor_is_gathered_per_pass_and_reduce_scattered_once():
    numel = 1_000_000  # 2 MB of weights, 4 MB of gradients
    gather = 2e6 * 1e-12 + 100 * HOST_VIEW_S + 4 * 2e6 / 1e12
    scatter = 4e6 * 1e-12 + 1e-3 + 100 * (HOST_VIEW_S + 9e-6) + 2 * 4e6 / 1e12
    assert _traffic([numel]).seconds(_wire_s, gathers=3) == pytest.approx(3 * gather + scatter)
    assert _traffic([numel]).seconds(_wire_s, gathers=2) == pytest.approx(2 * gather + scatter)


def test_a_tensor_below_the_persistence_threshold_is_only_reduce_scattered():
    small = PERSISTENCE_THRESHOLD - 1
    scatter = small * 4 * 1e-12 + 1e-3 + 100 * (HOST_VIEW_S + 9e-6) + 2 * small * 4 / 1e12
    assert _traffic([small]).seconds(_wire_s, gathers=3) == pytest.approx(scatter)


def test_the_host_work_grows_with_the_ranks_and_one_rank_moves_nothing():
    """Each collective builds one view per rank (and the reduce-scatter copies one piece per rank)."""
    few, many = _traffic([10**6], ranks=10), _traffic([10**6], ranks=1000)
    per_rank = 3 * HOST_VIEW_S + HOST_VIEW_S + 9e-6
    assert many.seconds(_wire_s, 3) - few.seconds(_wire_s, 3) == pytest.approx(990 * per_rank)
    assert _traffic([10**6], ranks=1).seconds(_wire_s, 3) == 0.0

"""The generated gradient exchanges as collectives: each sums exactly what gloo's all-reduce sums."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autopar.sections.gradient_sync import halving_doubling_all_reduce
from tests.dist.harness import run_ranks


def _halving_doubling_vs_all_reduce(rank: int, world_size: int, numel: int) -> float:
    """Largest difference between recursive halving-doubling and gloo's all-reduce on this rank,
    over every rank's own random vector (odd lengths split unevenly between partners)."""
    torch.manual_seed(rank)
    mine = torch.randn(numel, dtype=torch.float64)
    expected = mine.clone()
    dist.all_reduce(expected)
    halving_doubling_all_reduce(mine, list(range(world_size)))
    return float((mine - expected).abs().max())


@pytest.mark.parametrize("world_size", [3])  # one surplus rank folded into a core of 2 (dp4 in test_equivalence)
def test_halving_doubling_sums_like_all_reduce(world_size):
    assert run_ranks(_halving_doubling_vs_all_reduce, world_size, 37) == pytest.approx([0.0] * world_size, abs=1e-12)

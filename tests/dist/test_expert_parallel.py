"""Expert parallelism (autopar/codegen/sections/expert_parallel.py) trains like one process.

Property: on 4 gloo ranks (dp=4), experts sharded over ep ranks with FSDP over the rest
(ZeRO-2/3), three steps give the losses of one process on the whole batch and the same final
parameters, within fp32 rounding of differently ordered sums (1e-5). Cases, in one spawn of
ranks: ep=2 with ZeRO-3 (experts sharded over 2 expert-data-parallel ranks) and ep=4 with
ZeRO-2 (each rank alone with its experts), for a Mixtral-like model (4 experts, top-2), a
Qwen2-MoE-like one (plus a shared expert) and a DeepSeek-V3-like one (16 small experts, top-4).
The router's auxiliary loss is part of the loss compared.
"""
from __future__ import annotations

import copy

import pytest
import torch

from tests.dist.harness import run_ranks

pytestmark = [pytest.mark.dist]

MODELS = {
    "mixtral": dict(experts=4, top_k=2, ffn=64),
    "qwen2_moe": dict(experts=4, top_k=2, ffn=64, shared_ffn=64),
    "deepseek_v3": dict(experts=16, top_k=4, ffn=16, capacity_factor=4.0),
}
CASES = [(model, ep, zero) for model in MODELS for ep, zero in ((2, 3), (4, 2))]
DP, SAMPLES_PER_RANK, STEPS, LR = 4, 2, 3, 0.2


def _case(rank: int, dp_mesh, model_name: str, ep: int, zero: int) -> tuple[float, float]:
    """(largest loss difference, largest parameter difference) against one process."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    from autopar.codegen.sections.expert_parallel import apply_ep, expert_meshes, scale_expert_gradients, shard_experts
    from tests import moe_model

    kwargs = dict(layers=2, hidden=32, heads=2, seq_len=16, vocab=64, **MODELS[model_name])
    torch.manual_seed(0)
    model = moe_model.build_model(**kwargs)
    reference = copy.deepcopy(model)
    # The same seed on every rank: the same global batches, each rank training on its slice.
    batches = [moe_model.example_batch(DP * SAMPLES_PER_RANK, seq_len=16, vocab=64) for _ in range(STEPS)]
    ep_mesh, edp_mesh = expert_meshes(dp_mesh, ep)
    names = apply_ep(model, ep_mesh)
    assert len(names) == 2
    shard_experts(model, names, edp_mesh, zero == 3, MixedPrecisionPolicy())
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=zero == 3)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    worst_loss = 0.0
    mine = slice(rank * SAMPLES_PER_RANK, (rank + 1) * SAMPLES_PER_RANK)
    for batch in batches:
        local = {key: value[mine] for key, value in batch.items()}
        loss = moe_model.loss_fn(model(local["tokens"]), local)
        loss.backward()
        scale_expert_gradients(model, names, ep)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        ref_loss = moe_model.loss_fn(reference(batch["tokens"]), batch)
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        worst_loss = max(worst_loss, abs(mean.item() / DP - ref_loss.item()))
    worst_param = 0.0
    ep_rank = ep_mesh.get_local_rank()
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        value = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        want = ref_params[name].detach()
        if ".experts." in name:
            share = want.shape[0] // ep
            want = want[ep_rank * share:(ep_rank + 1) * share]
        assert value.shape == want.shape, name
        worst_param = max(worst_param, (value - want).abs().max().item())
    return worst_loss, worst_param


def _all_cases(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    dp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    return {case: _case(rank, dp_mesh, *case) for case in CASES}


def test_expert_parallel_trains_like_one_process():
    results = run_ranks(_all_cases, DP)
    for case in CASES:
        for rank, found in enumerate(results):
            loss, param = found[case]
            assert loss < 1e-5 and param < 1e-5, (case, rank, loss, param)

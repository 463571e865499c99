"""The generated module's optimizer: learning-rate schedules against hand-worked numbers, which
parameters weight decay exempts, ZeRO-1's ShardedAdamW against torch's AdamW, the optim config
group's checks, and the price of gradient clipping's all-reduce."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from autopar.sections.optimizer import (ShardedAdamW, build_optimizer, learning_rate, no_decay_names,
                                                 set_learning_rate)
from autopar.config import OptimConfig, compose_config, optimizer_settings
from autopar.errors import ConfigError
from autopar.model_file import load_model_file
from cost_models.collectives import Collective, collective_time_s
from cost_models.step import ParallelLayout, PlanPricer, TrainSpec
from cost_models.topology import ClusterConfig, ClusterSpec
from tests.dist.plans import GPT, LLAMA
from tests.profiles import B, gpt, planner_splitter

# lr 1 -> 0.1 with 2 warmup steps over a run of 10 steps: progress t = (step - 2) / 8.
BASE = {"lr": 1.0, "min_lr": 0.1, "warmup_steps": 2, "wsd_decay_fraction": 0.2}


@pytest.mark.parametrize("schedule, expected", [
    # steps 0 and 1 warm up (lr/2, lr); then each schedule at steps 2, 4, 6, 9, 10, 12.
    ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
    ("linear", [0.5, 1.0, 1.0, 0.775, 0.55, 0.2125, 0.1, 0.1]),  # 1 - 0.9 t
    # 0.1 + 0.45 (1 + cos(pi t)): t = 1/4 -> 0.1 + 0.45 (1 + 0.70711), t = 7/8 -> 0.1 + 0.45 (1 - 0.92388)
    ("cosine", [0.5, 1.0, 1.0, 0.1 + 0.45 * (1 + math.sqrt(0.5)), 0.55, 0.1 + 0.45 * (1 - math.cos(math.pi / 8)),
                0.1, 0.1]),
    # stable until the last 0.2 x 10 = 2 steps (from step 8), then linear: step 9 halfway (0.55)
    ("wsd", [0.5, 1.0, 1.0, 1.0, 1.0, 0.55, 0.1, 0.1]),
])
def test_schedules_by_hand(schedule, expected):
    settings = {**BASE, "schedule": schedule}
    got = [learning_rate(step, 10, settings) for step in (0, 1, 2, 4, 6, 9, 10, 12)]
    assert got == pytest.approx(expected, abs=1e-12)


def test_decay_steps_ends_the_schedule_before_the_run():
    """decay_steps=6 reaches min_lr at step 6 of a 10-step run: t = (step - 2) / 4."""
    settings = {**BASE, "schedule": "linear", "decay_steps": 6}
    assert [learning_rate(step, 10, settings) for step in (4, 6, 8)] == pytest.approx([0.55, 0.1, 0.1])


def test_no_warmup_starts_at_lr():
    assert learning_rate(0, 5, {"lr": 3e-4, "schedule": "cosine"}) == pytest.approx(3e-4)


def _build(tiny) -> nn.Module:
    return load_model_file(tiny.path).build_model(**tiny.kwargs)


def test_gpt_decays_matrices_only():
    """GPT: embeddings (and the head tied to wte), LayerNorms and every bias are exempt; the
    attention and MLP weights decay."""
    model = _build(GPT)
    exempt = no_decay_names(model)
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    decayed = names - exempt
    assert {"wte.weight", "wpe.weight", "lm_head.weight", "ln_f.weight", "ln_f.bias", "blocks.0.ln_1.weight",
            "blocks.0.attn.q_proj.bias", "blocks.3.mlp.fc_out.bias"} <= exempt
    assert decayed == {f"blocks.{i}.{m}.weight" for i in range(4)
                       for m in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "mlp.fc_in",
                                 "mlp.fc_out")}


def test_hugging_face_llama_exempts_rms_norms_and_the_embedding():
    """LlamaRMSNorm is no torch norm class: its name (ending in RMSNorm) exempts it. The untied
    head decays."""
    model = _build(LLAMA)
    exempt = no_decay_names(model)
    assert exempt == {"model.embed_tokens.weight", "model.norm.weight",
                      *(f"model.layers.{i}.{n}.weight" for i in range(4)
                        for n in ("input_layernorm", "post_attention_layernorm"))}
    assert "lm_head.weight" in {n for n, _ in model.named_parameters()}


def test_build_optimizer_groups_by_decay():
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    settings = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    optimizer = build_optimizer(list(model.named_parameters()), settings, no_decay_names(model))
    by_decay = {group["weight_decay"]: len(group["params"]) for group in optimizer.param_groups}
    assert by_decay == {0.1: 1, 0.0: 4}  # 1.weight decays; embedding, bias, norm weight and bias do not
    everything = build_optimizer(list(model.named_parameters()), {**settings, "decay_all": True}, no_decay_names(model))
    assert [group["weight_decay"] for group in everything.param_groups] == [0.1]
    set_learning_rate(optimizer, 0.5)
    assert {group["lr"] for group in optimizer.param_groups} == {0.5}


@pytest.fixture()
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_sharded_adamw_with_a_decay_mask_is_torch_adamw(one_rank_group):
    """On one rank, ShardedAdamW's per-parameter decay and update equal torch's AdamW with a decayed
    and an exempt group bit for bit, through a learning-rate change; its flat state names each
    parameter's decay, and loading it back keeps the mask."""
    torch.manual_seed(0)
    shapes, decayed = [(4, 3), (3,), (5, 2), (2,)], [True, False, True, False]
    ours = [nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    options = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    sharded = ShardedAdamW(ours, one_rank_group, decayed=decayed, **options)
    reference = torch.optim.AdamW([{"params": [p for p, d in zip(theirs, decayed) if d]},
                                   {"params": [p for p, d in zip(theirs, decayed) if not d], "weight_decay": 0.0}],
                                  **options)
    for step in range(4):
        grads = [torch.randn(s) for s in shapes]
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        set_learning_rate(sharded, 0.01 / (step + 1))
        set_learning_rate(reference, 0.01 / (step + 1))
        sharded.step()
        reference.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    fqns = ["a.weight", "a.bias", "b.weight", "b.bias"]
    flat = sharded.flat_state_dict(fqns)
    assert [flat[f"param_groups.{f}.weight_decay"] for f in fqns] == [0.1, 0.0, 0.1, 0.0]
    again = ShardedAdamW(ours, one_rank_group, decayed=decayed, **options)
    again.load_flat_state_dict(flat, fqns)
    assert again.decay_ranges == sharded.decay_ranges and again.inner.param_groups[0]["weight_decay"] == 0.0


@pytest.mark.parametrize("grad_placement", ["as_parameter", "partial"])
def test_local_adamw_is_torch_adamw_on_dtensors(one_rank_group, grad_placement):
    """The generated optimizer (`build_optimizer`: AdamW's update run on the local shards where
    each gradient is laid out as its parameter) equals torch's AdamW on the same DTensors bit for
    bit over 4 steps, a decayed and an exempt group, sharded and replicated parameters, through a
    learning-rate change; where a gradient is a pending partial sum it takes torch's own step
    (the sum's reduction is DTensor's), equal too. Its state is torch's: DTensors placed as their
    parameters (what DCP checkpoints)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    shapes = {"a.weight": ((4, 3), Shard(0)), "a.bias": ((3,), Replicate()), "b.weight": ((5, 2), Shard(1))}
    values = {name: torch.randn(shape) for name, (shape, _) in shapes.items()}

    def parameters() -> dict[str, nn.Parameter]:
        return {name: nn.Parameter(distribute_tensor(values[name].clone(), mesh, [placement]))
                for name, (_, placement) in shapes.items()}

    ours, theirs = parameters(), parameters()
    settings = {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    optimizer = build_optimizer(list(ours.items()), settings, no_decay={"a.bias"})
    reference = torch.optim.AdamW([{"params": [theirs["a.weight"], theirs["b.weight"]]},
                                   {"params": [theirs["a.bias"]], "weight_decay": 0.0}], foreach=True, **settings)
    for step in range(4):
        for name, (shape, placement) in shapes.items():
            grad = torch.randn(shape)
            for params in (ours, theirs):
                params[name].grad = (DTensor.from_local(grad.clone(), mesh, [Partial()]) if grad_placement == "partial"
                                     else distribute_tensor(grad.clone(), mesh, [placement]))
        set_learning_rate(optimizer, 0.01 / (step + 1))
        set_learning_rate(reference, 0.01 / (step + 1))
        optimizer.step()
        reference.step()
    for name in shapes:
        torch.testing.assert_close(ours[name].full_tensor(), theirs[name].full_tensor(), rtol=0, atol=0)
        state = optimizer.state[ours[name]]
        assert isinstance(state["exp_avg"], DTensor) and state["exp_avg"].placements == ours[name].placements
        torch.testing.assert_close(state["exp_avg_sq"].full_tensor(),
                                   reference.state[theirs[name]]["exp_avg_sq"].full_tensor(), rtol=0, atol=0)


@pytest.mark.parametrize("start, stop", [(0, 26), (5, 14), (12, 20), (13, 14), (20, 26)])
def test_sharded_adamw_takes_its_slice_of_the_gradients_and_decay_without_a_flat_copy(one_rank_group, start, stop):
    """A rank's slice of the flattened parameters (here set by hand: 12, 3, 10 and 1 elements,
    slices inside one parameter and across several): its gradient slice and decay ranges equal
    those read off the whole flattened gradient and decay mask, which the step no longer builds
    (a 4-byte-per-parameter copy beside the all-gather's output, measured on a ZeRO-1 rank)."""
    torch.manual_seed(0)
    shapes, decayed = [(4, 3), (3,), (5, 2), (1,)], [True, False, True, False]
    params = [nn.Parameter(torch.randn(s)) for s in shapes]
    for p in params[::2]:
        p.grad = torch.randn(p.shape)
    sharded = ShardedAdamW(params, one_rank_group, decayed=decayed, lr=0.01)
    sharded.start, sharded.stop = start, stop
    sharded.shard = nn.Parameter(torch.zeros(stop - start))
    # A parameter without a gradient (unused this step) counts as zeros.
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros(p.shape)).reshape(-1) for p in params])
    assert torch.equal(sharded._shard_of_gradients(), flat[start:stop])
    mask = torch.cat([torch.full((p.numel(),), d) for p, d in zip(params, decayed)])[start:stop]
    expected = torch.zeros(stop - start, dtype=torch.bool)
    for low, high in sharded._decay_ranges():
        expected[low:high] = True
    assert torch.equal(expected, mask)


@pytest.mark.parametrize("override, field", [("optim.schedule=step", "schedule"), ("optim.lr=-1", "lr"),
                                             ("optim.max_grad_norm=-0.5", "max_grad_norm"),
                                             ("optim.betas=[0.9,1.0]", "betas"), ("optim.lr=nan", "lr"),
                                             ("optim.wsd_decay_fraction=0", "wsd_decay_fraction")])
def test_bad_optim_values_name_their_field(override, field):
    with pytest.raises(ConfigError, match=rf"optim\.{field}="):
        compose_config([override])


def test_optim_group_defaults_reach_the_module_settings():
    settings = optimizer_settings(compose_config(["optim.warmup_steps=3", "optim.schedule=wsd"]).optim)
    assert settings == {**{f.name: f.default for f in dataclasses.fields(OptimConfig) if f.default is not
                           dataclasses.MISSING}, "betas": (0.9, 0.95), "warmup_steps": 3, "schedule": "wsd"}


def test_clipping_prices_one_all_reduce_over_every_rank():
    """Clipping adds one 8-byte all-reduce over all 8 ranks to the step (under dp_comm) and one
    all-reduce per pipeline rank to the issued collectives; without it neither."""
    profile = gpt()
    cluster = ClusterSpec.from_config(ClusterConfig(name="t", gpu="A100-80GB", nodes=1, gpus_per_node=8))
    layout = ParallelLayout(dp=2, tp=2, pp=2, micro_batch_size=B, num_micro_batches=4)
    on, off = (PlanPricer(profile, cluster, TrainSpec(global_batch_size=4 * B * 2, clip_grad_norm=clip),
                          planner_splitter(profile)) for clip in (True, False))
    all_reduce = collective_time_s(Collective.ALL_REDUCE, 8, cluster.group_links(list(range(8))))
    assert all_reduce > 0
    estimate_on, estimate_off = on.estimate(layout), off.estimate(layout)
    assert estimate_on.step_time_s - estimate_off.step_time_s == pytest.approx(all_reduce, rel=1e-6)
    assert (estimate_on.time_breakdown["dp_comm"] - estimate_off.time_breakdown["dp_comm"]
            == pytest.approx(all_reduce, rel=1e-6))
    issued_on, issued_off = on.issued_collectives(layout), off.issued_collectives(layout)
    assert issued_on.pop("all_reduce") - issued_off.pop("all_reduce", 0) == 2 and issued_on == issued_off

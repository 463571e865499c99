"""Selective recomputation reruns products of two activations (an attention written out: its
scores and weighted values, Megatron-LM's attention core) and keeps products with a weight: the
generated code's checkpoint policy (autopar/sections/recompute.py) decides it from autograd
history, the cost model (cost_models.weights.activation_products) from the trace, and the two
agree on what a block keeps."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.model_file import build_model, load_model_file
from autopar.sections import recompute
from cost_models.compute import ComputeModel, op_roofline_s
from cost_models.hardware import get_gpu
from cost_models.memory import layer_activations
from cost_models.weights import activation_products
from tests.profiles import EXAMPLES, traced

aten = torch.ops.aten
SHAPE = dict(layers=2, hidden=64, heads=4, seq_len=32, vocab=128, attention="unfused",
             attention_dropout=0.1, hidden_dropout=0.1)
BATCH = 2


class WrittenOutAttention(nn.Module):
    """Scores by baddbmm with a constant causal bias, softmax, weighted values by bmm, and a
    product with stacked weights in bmm form (as grouped experts are written)."""

    def __init__(self, hidden: int = 8, tokens: int = 4):
        super().__init__()
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.stacked = nn.Parameter(torch.randn(2, hidden, hidden) / hidden ** 0.5)
        self.register_buffer("bias", torch.full((tokens, tokens), float("-inf")).triu(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(x.shape[-1], dim=-1)
        scores = torch.baddbmm(self.bias.expand(x.shape[0], -1, -1), q, k.transpose(1, 2))
        mixed = self.out(torch.bmm(scores.softmax(dim=-1), v))
        return torch.bmm(mixed, self.stacked)


class Decisions:
    """The policy's decision for each product the forward ran, in order."""

    def __enter__(self) -> list[tuple[str, str]]:
        self.seen: list[tuple[str, str]] = []
        self.policy = recompute._selective_policy

        def spy(ctx, op, *args, **kwargs):
            decision = self.policy(ctx, op, *args, **kwargs)
            if op in recompute._PRODUCT_OPS:
                self.seen.append((op.__name__.split(".")[0], decision.name))
            return decision

        recompute._selective_policy = spy
        return self.seen

    def __exit__(self, *exc) -> None:
        recompute._selective_policy = self.policy


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _run(block: nn.Module, leaf: torch.Tensor, selective: bool, autocast: bool = False):
    """Forward and backward of ``block`` on a tensor computed from ``leaf`` (it has a history)."""
    forward = recompute.recomputed(block.forward, selective=True) if selective else block.forward
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = forward(leaf * 2)
    out.float().pow(2).sum().backward()
    return out.detach(), [p.grad.clone() for p in block.parameters()]


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_products_of_two_activations_are_rerun_and_products_with_a_weight_kept(autocast):
    torch.manual_seed(0)
    block = WrittenOutAttention()
    x = torch.randn(2, 4, 8, requires_grad=True)
    with Decisions() as seen, CountOps() as counter:
        out, grads = _run(block, x, selective=True, autocast=autocast)
    assert seen == [("addmm", "MUST_SAVE"), ("baddbmm", "PREFER_RECOMPUTE"), ("bmm", "PREFER_RECOMPUTE"),
                    ("addmm", "MUST_SAVE"), ("bmm", "MUST_SAVE")]
    # Forward ran each product once; backward reran the scores and the weighted values only
    # (and runs its own bmm for the gradients: two per bmm, two for the baddbmm).
    assert counter.counts["addmm"] == 2
    assert counter.counts["baddbmm"] == 2
    assert counter.counts["bmm"] == 2 + 1 + 2 * 3
    for p in block.parameters():
        p.grad = None
    reference, reference_grads = _run(block, x, selective=False, autocast=autocast)
    torch.testing.assert_close(out, reference)
    for grad, expected in zip(grads, reference_grads):
        torch.testing.assert_close(grad, expected)


def test_a_leaf_input_is_an_activation_and_a_frozen_weight_a_constant():
    """A pipeline stage's input is a leaf that requires grad: its Gram product is rerun. A frozen
    weight has no history: the product with it reads one activation and is kept."""
    frozen = nn.Linear(8, 8).requires_grad_(False)

    def gram(x):
        return torch.bmm(x, x.transpose(1, 2)).sum(-1, keepdim=True) * frozen(x)

    with Decisions() as seen:
        out = recompute.recomputed(gram, selective=True)(torch.randn(2, 4, 8, requires_grad=True))
        out.sum().backward()
    assert seen == [("bmm", "PREFER_RECOMPUTE"), ("addmm", "MUST_SAVE")]


@pytest.fixture(scope="module")
def written_out_gpt():
    return traced("gpt.py", "fp32", BATCH, **SHAPE)


def test_the_trace_names_the_attention_cores_products(written_out_gpt):
    by_name = {op.name: op for op in written_out_gpt.ops}
    found = sorted((by_name[name].layer, by_name[name].target) for name in activation_products(written_out_gpt))
    core = ("aten.baddbmm.default", "aten.bmm.default")
    assert found == [(f"blocks.{i}", target) for i in range(2) for target in core]


def test_the_cost_model_keeps_what_the_policy_keeps(written_out_gpt):
    """A block of examples/gpt.py with its attention written out and both dropouts: the bytes the
    cost model says selective recomputation keeps are those the policy saves, plus the input."""
    profile = written_out_gpt
    compute = ComputeModel(profile)
    layer = profile.layer("blocks.0")
    forward = [op for op in compute.ops_by_layer["blocks.0"] if op.phase == "forward"]
    predicted = layer_activations(layer, forward, rerun_products=compute.rerun_products)
    kept_predicted = predicted.selective_replicated_bytes + predicted.selective_sharded_bytes

    torch.manual_seed(0)
    model = build_model(load_model_file(EXAMPLES / "gpt.py"), SHAPE)
    block = model.blocks[0]
    x = torch.randn(BATCH, SHAPE["seq_len"], SHAPE["hidden"], requires_grad=True) * 1.0
    kept = [x.numel() * x.element_size()]
    policy = recompute._selective_policy

    def measuring(ctx, op, *args, **kwargs):
        decision = policy(ctx, op, *args, **kwargs)
        if decision == recompute.CheckpointPolicy.MUST_SAVE:
            kept.append(ctx.op_output.numel() * ctx.op_output.element_size())
        return decision

    recompute._selective_policy = measuring
    try:
        recompute.recomputed(block.forward, selective=True)(x).sum().backward()
    finally:
        recompute._selective_policy = policy
    assert kept_predicted == sum(kept)
    # The scores alone (b x a x s x s floats) are more than the rest of what is kept here: keeping
    # them, as the policy did before, is what this accounting tells apart.
    scores = BATCH * SHAPE["heads"] * SHAPE["seq_len"] ** 2 * 4
    assert layer_activations(layer, forward).selective_replicated_bytes >= kept_predicted + scores


def test_selective_reruns_the_attention_cores_products(written_out_gpt):
    compute = ComputeModel(written_out_gpt)
    gpu = get_gpu("A100-80GB")
    ops = [op for op in compute.ops_by_layer["blocks.0"] if op.phase == "forward" and op.op_class != "view"]
    element_wise = sum(op_roofline_s(op, gpu, compute.dtype) for op in ops if op.op_class not in ("gemm", "attention"))
    core = sum(op_roofline_s(op, gpu, compute.dtype) for op in ops if op.name in compute.rerun_products)
    priced = compute.layer("blocks.0", gpu)
    assert core > 0
    assert priced.selective_rerun_s == pytest.approx(element_wise + core)
    assert priced.selective_rerun_launches == len([op for op in ops if op.op_class not in ("gemm", "attention")]) + 2


def test_under_sequence_parallelism_the_rerun_of_the_slices_ops_is_a_slices_too(written_out_gpt):
    """Selective recomputation reruns the norms, residual adds and dropouts that sequence
    parallelism runs on the rank's slice of the sequence: 1/t of them, as their first run."""
    from cost_models.step import ParallelLayout, PlanPricer, TrainSpec
    from cost_models.topology import ClusterConfig, ClusterSpec
    from tests.profiles import planner_splitter

    cluster = ClusterSpec.from_config(ClusterConfig(name="t", gpu="A100-80GB", nodes=1, gpus_per_node=2))
    pricer = PlanPricer(written_out_gpt, cluster, TrainSpec(global_batch_size=4, tp_runtime="plain"),
                        planner_splitter(written_out_gpt), recompute_options=("none", "selective"))
    layout = ParallelLayout(tp=2, micro_batch_size=BATCH, num_micro_batches=2, sequence_parallel=True)
    gpu = pricer.ranks.reference_gpu(layout)
    split = pricer.split("blocks.0", layout, gpu)
    assert split.sp.forward_s > 0
    rerun = pricer.layer_prices._compute_s(split, layout, 1.0, gpu, 1.0, 1.0) - \
        pricer.layer_prices._compute_s(split, layout, 1.0, gpu, 1.0, 0.0)
    expected = split.compute.selective_rerun_s - split.sp.forward_s / 2 + \
        split.compute.selective_rerun_launches * gpu.launch_overhead_s
    assert rerun == pytest.approx(expected)


@pytest.fixture(scope="module")
def llama():
    return traced("llama_hf.py", "bf16", 1)


def test_torchtitans_op_policy_reruns_every_second_matrix_product(llama):
    """torchtitan's op-level selective AC (its published D7 runs, and plans written for it) keeps
    `aten.mm` outputs but every second one of a layer: in a Llama layer, forward order q, k, v, o,
    gate, up, down, it reruns k, o and up."""
    from cost_models.weights import selective_reruns

    by_name = {op.name: op for op in llama.ops}
    rerun = selective_reruns(llama, "torchtitan_op")
    first_layer = sorted(by_name[name].module.rpartition(".")[2] for name in rerun
                         if by_name[name].layer == "model.layers.0")
    assert first_layer == ["k_proj", "o_proj", "up_proj"]
    assert selective_reruns(llama, "autopar") == frozenset()  # fused attention: every product has a weight


def test_the_pricer_and_its_splitter_price_one_selective_runtime(llama):
    from autopar.solver.tp_split import ILPSplitter
    from cost_models.step import PlanPricer, TrainSpec
    from cost_models.topology import ClusterConfig, ClusterSpec

    cluster = ClusterSpec.from_config(ClusterConfig(name="t", gpu="H100-SXM", nodes=1, gpus_per_node=2))
    train = TrainSpec(global_batch_size=2, selective_runtime="torchtitan_op")
    with pytest.raises(ValueError, match="same runtime"):
        PlanPricer(llama, cluster, train, ILPSplitter(llama))
    pricer = PlanPricer(llama, cluster, train, ILPSplitter(llama, selective_runtime="torchtitan_op"))
    gpu = get_gpu("H100-SXM")
    ops = [op for op in pricer.compute.ops_by_layer["model.layers.0"] if op.phase == "forward"]
    theirs = pricer.compute.layer("model.layers.0", gpu)
    ours = ComputeModel(llama).layer("model.layers.0", gpu)
    rerun = pricer.compute.rerun_products
    rerun_mm = sum(op_roofline_s(op, gpu, pricer.compute.dtype) for op in ops if op.name in rerun)
    assert theirs.selective_rerun_s == pytest.approx(ours.selective_rerun_s + rerun_mm)
    layer = llama.layer("model.layers.0")
    kept = layer_activations(layer, ops, rerun_products=rerun)
    assert kept.selective_replicated_bytes < layer_activations(layer, ops).selective_replicated_bytes


def test_plans_for_torchtitan_are_priced_with_its_policy_and_a_wrong_runtime_is_named():
    from autopar.config import compose_config
    from autopar.errors import ConfigError
    from autopar.specs import train_spec

    assert train_spec(compose_config([])).selective_runtime == "autopar"
    assert train_spec(compose_config(["plan.engine=torchtitan"])).selective_runtime == "torchtitan_op"
    assert train_spec(compose_config(["plan.engine=torchtitan", "train.selective_runtime=autopar"])
                      ).selective_runtime == "autopar"
    with pytest.raises(ConfigError, match="torchtitan_op"):
        train_spec(compose_config(["train.selective_runtime=megatron"]))

"""Planning code whose shapes or branches depend on tensor values (autopar/data_dependent.py)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.data_dependent import (concrete, data_dependent_fake_mode, is_data_dependent, real_values,
                                    register_missing_fake_kernels, tracing_in)
from autopar.model_file import load_model_file
from autopar.profile import profile_model

ZOO_MODEL = Path(__file__).resolve().parents[1] / "zoo" / "models" / "value_dependent.py"
BATCH, SEQ, HIDDEN, VOCAB = 2, 16, 32, 64


@pytest.fixture(scope="module")
def profile():
    return profile_model(load_model_file(ZOO_MODEL), {}, BATCH)


def test_value_dependent_model_is_profiled_with_its_estimates_named(profile):
    assert profile.data_dependent
    read, guessed, decided = profile.estimated
    # The mask's count comes from the batch: the line that selects by it is named.
    assert "read from the example batch" in read and "logits[keep]" in read
    # Each expert's share of the tokens depends on the weights: all 32 tokens, its upper bound.
    assert "torch.nonzero(choice == index)" in guessed and f"({BATCH * SEQ})" in guessed
    # The labels check is settled by torch on the batch's labels (its branch, not a size).
    assert "labels.max() >= logits.shape[-1]" in decided


def test_expert_flops_are_priced_at_the_bound_and_the_loss_at_the_real_count(profile):
    layer = next(layer for layer in profile.layers if layer.name == "layers.0")
    tokens = BATCH * SEQ
    router = 2 * tokens * HIDDEN * 2
    experts = 2 * (2 * tokens * HIDDEN * HIDDEN)
    assert layer.flops_forward == router + experts
    losses = [op for op in profile.ops if "nll_loss_forward" in op.target]
    assert len(losses) == 1
    rows = losses[0].input_shapes[0][0]
    # Boolean selection of the kept tokens: between the shortest (8 per sample) and all of them.
    assert BATCH * SEQ // 2 <= rows <= BATCH * SEQ
    assert profile.token_loss  # a mean over the kept tokens: a batch split weighs parts by count
    assert all(isinstance(op.flops, int) for op in profile.ops)  # no symbolic sizes left
    assert profile.uncosted_ops() == []  # nonzero, index_add, size and value reads have a cost class


def test_weight_dependent_branch_is_guessed_and_said(tmp_path):
    path = tmp_path / "branchy.py"
    path.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.a = torch.nn.Linear(4, 4)\n"
        "        self.b = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        h = self.a(x)\n"
        "        if h.sum() > 0:\n"
        "            h = self.b(h)\n"
        "        return h\n"
        "def build_model():\n    return M()\n"
        "def example_batch(batch_size):\n    return torch.randn(batch_size, 4)\n")
    profile = profile_model(load_model_file(path), {}, 2)
    assert profile.data_dependent
    # A branch on a comparison is a 0/1 value: taken at its bound, 1 (the branch runs), and said.
    (line,) = profile.estimated
    assert "depend on the weights" in line and "branchy.py:9 (`if h.sum() > 0:`)" in line and "(1)" in line
    assert sum(layer.flops_forward for layer in profile.layers) == 2 * (2 * 2 * 4 * 4)  # both linears priced



def test_values_read_while_building_send_a_small_model_to_real_tensors(tmp_path):
    """ConvNeXt's and many vision models' __init__ read a drop-path schedule's values
    (``torch.linspace(...).tolist()``), which no fake tensor has; forward then branches on them.
    The build is retried with symbols, and where forward still needs their values, the small
    model is traced with real tensors instead of refused, and the profile says so."""
    path = tmp_path / "schedule.py"
    path.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.rates = torch.linspace(0, 0.0, 2).tolist()\n"
        "        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in self.rates)\n"
        "    def forward(self, x):\n"
        "        for rate, block in zip(self.rates, self.blocks):\n"
        "            x = block(x) if rate == 0.0 else x\n"
        "        return x\n"
        "def build_model():\n    return M()\n"
        "def example_batch(batch_size):\n    return torch.randn(batch_size, 4)\n")
    profile = profile_model(load_model_file(path), {}, 2)
    assert profile.real_values  # the reason the plan gives for tracing with real tensors
    assert sum(layer.flops_forward for layer in profile.layers) == 2 * (2 * 2 * 4 * 4)  # both blocks run


PADDED_EXPERTS = (
    "import torch\n"
    "class Experts(torch.nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.router = torch.nn.Linear(8, 4)\n"
    "        self.w = torch.nn.Parameter(torch.randn(4 * 8, 8))\n"
    "    def forward(self, x):\n"
    "        top = self.router(x).topk(2, dim=-1).indices\n"
    "        mask = torch.nn.functional.one_hot(top, num_classes=5).permute(2, 1, 0)\n"
    "        out = torch.zeros_like(x)\n"
    "        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():\n"
    "            _, tokens = torch.where(mask[e[0]])\n"
    "            out = out.index_add(0, tokens, x[tokens] @ self.w.view(-1, 8, 8)[e[0]])\n"
    "        return out\n"
    "def build_model():\n    return Experts()\n"
    "def example_batch(batch_size):\n    return torch.randn(batch_size, 8)\n")


def test_an_expert_loop_over_a_padded_one_hot_is_guessed_the_same_every_time(tmp_path):
    """DBRX's experts: a loop over ``nonzero`` of a one-hot padded by a class no token takes,
    indexing the experts by what it returns. None of it has values (the router's weights have
    none): torch once kept values a factory gave the one-hot (uninitialised memory) and the trace
    differed run to run, or indexed expert 4 of 4. Now the sizes are taken at their upper bounds
    (all five classes, every (token, choice) pair), the expert index at its lower bound, and the
    plan says each came from the weights."""
    path = tmp_path / "padded_experts.py"
    path.write_text(PADDED_EXPERTS)
    flops = set()
    for _ in range(3):
        profile = profile_model(load_model_file(path), {}, 4)
        flops.add(sum(layer.flops_forward for layer in profile.layers))
        assert all("read from the example batch" not in line for line in profile.estimated)
        assert any("padded_experts.py:11" in line and "depend on the weights" in line for line in profile.estimated)
    # The router (2 x 4 tokens x 8 x 4), then five passes of 8 rows (4 tokens x 2 choices) x 8 x 8.
    assert flops == {2 * 4 * 8 * 4 + 5 * 2 * 8 * 8 * 8}

def test_ordinary_models_take_the_plain_path(tmp_path):
    path = tmp_path / "plain.py"
    path.write_text("import torch\n"
                    "def build_model():\n    return torch.nn.Linear(4, 4)\n"
                    "def example_batch(batch_size):\n    return torch.randn(batch_size, 4)\n")
    profile = profile_model(load_model_file(path), {}, 2)
    assert not profile.data_dependent and profile.estimated == []


def test_ctc_loss_runs_forward_and_backward_on_fake_tensors():
    register_missing_fake_kernels()
    with FakeTensorMode():
        log_probs = torch.randn(50, 4, 20, requires_grad=True)
        targets = torch.randint(1, 20, (4, 10))
        loss = F.ctc_loss(log_probs.log_softmax(-1), targets, torch.full((4,), 50), torch.full((4,), 10))
        loss.backward()
    assert loss.shape == () and log_probs.grad.shape == (50, 4, 20)


def test_batch_values_are_real_and_sizes_follow_them():
    fake_mode, hints = data_dependent_fake_mode()
    with tracing_in(fake_mode):
        mask = torch.tensor([[1, 1, 0], [1, 0, 0]]).bool()
        values = torch.randn(2, 3)[mask]
        count = int(mask.sum())
    assert values.shape[0] == 3 and count == 3 and not hints.guesses


def test_stops_at_values_are_recognised():
    with FakeTensorMode():
        with pytest.raises(Exception) as stop:
            torch.nonzero(torch.ones(3))
    assert is_data_dependent(stop.value)
    assert not is_data_dependent(ValueError("shapes differ"))


def test_concrete_replaces_symbols_inside_dataclasses():
    @dataclasses.dataclass(frozen=True)
    class Sizes:
        rows: object
        shapes: list

    fake_mode, hints = data_dependent_fake_mode()
    with fake_mode, real_values(fake_mode, False):
        weights = torch.randn(2, 2)  # as build_fake makes weights: no real values
    with tracing_in(fake_mode):
        rows = torch.nonzero(torch.ones(4, 2)).shape[0]  # from values known for real: 8
        guessed = torch.nonzero(weights > 0).shape[0]  # from the weights: its upper bound, 4
    result = concrete(Sizes(rows=guessed, shapes=[[guessed, 2], (rows, 1)]))
    assert result == Sizes(rows=4, shapes=[[4, 2], (8, 1)])
    assert len(hints.guesses) == 1
    assert isinstance(result.rows, int)


CTC_MODEL = '''
import torch
import torch.nn.functional as F

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Linear(8, 16)
        self.head = torch.nn.Linear(16, 12)

    def forward(self, frames, labels):
        log_probs = self.head(torch.tanh(self.encoder(frames))).log_softmax(-1).transpose(0, 1)
        if labels.max() >= 12:
            raise ValueError("labels outside the vocabulary")
        kept = labels >= 0
        targets = labels.masked_select(kept)
        lengths = torch.full((frames.shape[0],), frames.shape[1])
        return F.ctc_loss(log_probs, targets, lengths, kept.sum(-1))

def build_model():
    return Model()

def example_batch(batch_size):
    labels = torch.randint(1, 12, (batch_size, 4))
    labels[0, 2:] = -100
    return {"frames": torch.randn(batch_size, 10, 8), "labels": labels}
'''


def test_ctc_model_is_planned_without_loss_parallelism(tmp_path):
    """A CTC loss reads the log-probabilities whole: the head may split (its output gathered), but
    torch's loss parallelism covers log-softmax into nll_loss only."""
    from autopar.solver.intra_op import IntraOpSolver

    path = tmp_path / "ctc.py"
    path.write_text(CTC_MODEL)
    profile = profile_model(load_model_file(path), {}, 2)
    assert profile.data_dependent and "masked_select" in profile.estimated[0]
    by_name = {op.name: op for op in profile.ops}
    (log_softmax,) = [op for op in profile.ops if op.target.startswith("aten._log_softmax.")]
    assert not IntraOpSolver._feeds_nll_only(log_softmax, by_name)
    gpt = profile_model(load_model_file(Path(__file__).resolve().parents[2] / "examples" / "gpt.py"),
                        {"layers": 1, "hidden": 16, "heads": 2, "seq_len": 8, "vocab": 32}, 2)
    gpt_ops = {op.name: op for op in gpt.ops}
    (gpt_log_softmax,) = [op for op in gpt.ops if op.target.startswith("aten._log_softmax.")]
    assert IntraOpSolver._feeds_nll_only(gpt_log_softmax, gpt_ops)


def test_dtensor_finds_shapes_without_running_ops_on_placeholder_values(monkeypatch):
    """Loss-parallel cross entropy on a fake group of 2 ranks, logits without values (they come
    from the weights), targets with the batch's: DTensor finds an op's global shape by running it
    on arguments made from shapes alone (uninitialised memory), which must not run for real (it
    ran nll_loss's backward with a garbage target: DBRX's tensor-parallel proof)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    fake_mode, _ = data_dependent_fake_mode()
    values_on = []
    shapes = ShardingPropagator._propagate_tensor_meta_non_cached

    def watched(self, op_schema):
        values_on.append(fake_mode.propagate_real_tensors)
        return shapes(self, op_schema)

    monkeypatch.setattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", watched)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        with fake_mode:
            local_logits = torch.randn(4, VOCAB // 2, requires_grad=True)
            with real_values(fake_mode):
                target = torch.randint(0, VOCAB, (4,))
        with tracing_in(fake_mode), loss_parallel():
            logits = DTensor.from_local(local_logits, mesh, [Shard(1)], run_check=False)
            F.cross_entropy(logits, target).backward()
    finally:
        dist.destroy_process_group()
    assert values_on and not any(values_on)
    assert local_logits.grad is not None and local_logits.grad.shape == (4, VOCAB // 2)

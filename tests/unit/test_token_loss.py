"""Token-level losses (autopar/trace/loss_tokens.py, autopar/sections/token_loss.py): the
profile finds a loss that averages over the targets it counts, each micro-batch's mean is
weighed by its count read from autograd, and the gradients after `TokenCounts.finish` are those
of the one-process mean over the whole batch, however the counts fall."""
from __future__ import annotations

import textwrap

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from autopar.sections.token_loss import TokenCounts, counted_targets
from tests.profiles import traced

IGNORED = -100


def _profile(tmp_path, loss: str):
    from autopar.model_file import load_model_file
    from autopar.profile import profile_model

    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(f"""
        import torch
        from torch.nn import functional as F

        def build_model():
            return torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))

        def example_batch(batch_size):
            return torch.randint(0, 16, (batch_size, 6))

        def loss_fn(logits, tokens):
            logits = logits.flatten(0, 1)
            return {loss}
    """))
    return profile_model(load_model_file(path), {}, micro_batch_size=2, precision="fp32")


def test_profile_finds_the_mean_over_counted_targets(tmp_path):
    assert "nll_loss_forward" in traced("gpt.py", "fp32", 2, layers=1, hidden=32, heads=4, seq_len=16,
                                        vocab=64).token_loss
    assert "nll_loss_forward" in _profile(tmp_path, "F.cross_entropy(logits, tokens.flatten())").token_loss
    # A sum, an element mean (every part counts as many) and two means (one weight cannot carry
    # two counts) are not token-level means.
    assert _profile(tmp_path, "F.cross_entropy(logits, tokens.flatten(), reduction='sum')").token_loss is None
    assert _profile(tmp_path, "F.mse_loss(logits, logits.detach() + 1)").token_loss is None
    two = "F.cross_entropy(logits, tokens.flatten()) + F.cross_entropy(logits.t(), torch.arange(16))"
    assert _profile(tmp_path, two).token_loss is None


def test_the_count_is_read_from_the_loss_autograd_graph():
    logits = torch.randn(6, 5, requires_grad=True)
    targets = torch.tensor([1, IGNORED, 3, 4, IGNORED, 2])
    assert counted_targets(F.cross_entropy(logits, targets)) == 4
    # Past other terms of the loss (an auxiliary loss added, a scale), and with class weights: their sum
    aux = logits.pow(2).mean()
    assert counted_targets(0.5 * F.cross_entropy(logits, targets) + 0.01 * aux) == 4
    weights = torch.tensor([1.0, 2.0, 3.0, 0.5, 1.0])
    assert counted_targets(F.cross_entropy(logits, targets, weight=weights)) == 2.0 + 0.5 + 1.0 + 3.0
    with pytest.raises(RuntimeError, match="mean over its targets"):
        counted_targets(F.cross_entropy(logits, targets, reduction="sum"))
    with pytest.raises(RuntimeError, match="mean over its targets"):
        counted_targets(F.mse_loss(logits, torch.zeros(6, 5)))


@pytest.fixture()
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("averaged_over", [1, 4])
def test_weighed_micro_batches_give_the_whole_batch_mean(one_rank_group, averaged_over):
    """Micro-batches counting 5, 1 and 0 targets: each mean weighed by its count, backward
    divided by the number of micro-batches (as the step does) and the gradients averaged over
    ``averaged_over`` data-parallel ranks that all saw these micro-batches (so the average is
    theirs), then `finish`: the gradient and the logged loss of one cross-entropy over the whole
    batch. Without the weights the micro-batch with one target would weigh as much as the one
    with five."""
    torch.manual_seed(0)
    head = torch.nn.Linear(4, 7)
    inputs = torch.randn(3, 5, 4)
    targets = torch.randint(0, 7, (3, 5))
    targets[0, 0] = targets[1, 1:] = targets[2] = IGNORED  # 4 + 1 + 0 counted

    F.cross_entropy(head(inputs).flatten(0, 1), targets.flatten()).backward()
    expected_loss = F.cross_entropy(head(inputs).flatten(0, 1), targets.flatten()).item()
    expected = head.weight.grad.clone()
    head.weight.grad = None

    counts = TokenCounts(torch.device("cpu"))
    counts.start()
    total = torch.zeros(())
    for micro in range(3):
        loss = counts.weigh(F.cross_entropy(head(inputs[micro]), targets[micro]))
        (loss / 3).backward()
        total += loss.detach()
    head.weight.grad /= averaged_over  # data-parallel averaging over ranks holding the same sums
    head.bias.grad /= averaged_over
    logged = counts.finish([head], averaged_over, 3, 1, total / 3)

    torch.testing.assert_close(head.weight.grad, expected)
    assert logged.item() * 1 / averaged_over == pytest.approx(expected_loss, rel=1e-6)  # global_loss averages ranks
    assert [c.item() for c in counts.counts] == [4, 1, 0]
    assert not counts.weighing  # validation after the step is not weighed
    assert counts.weigh(torch.tensor(2.0)).item() == 2.0


def test_a_pipeline_shape_inference_call_before_the_micro_batches_is_not_counted(one_rank_group):
    """torch's schedule calls the loss function once more on its first step, before the
    micro-batches: only the last ``micro_batches`` counts make the global count."""
    head = torch.nn.Linear(4, 3)
    inputs, targets = torch.randn(2, 4), torch.tensor([[0, IGNORED], [1, 2]])
    counts = TokenCounts(torch.device("cpu"))
    counts.start()
    counts.weigh_output(F.cross_entropy(head(inputs), targets[1]), None)  # shape inference: 2 targets
    for micro in range(2):
        (counts.weigh_output(F.cross_entropy(head(inputs), targets[micro]), None) / 2).backward()
    counts.finish([head], 1, 2, 1, None)
    expected = torch.nn.Linear(4, 3)
    expected.load_state_dict(head.state_dict())
    F.cross_entropy(expected(torch.cat([inputs, inputs])), targets.flatten()).backward()
    torch.testing.assert_close(head.weight.grad, expected.weight.grad)


def test_plans_weigh_tokens_only_where_the_batch_is_split():
    """The plan's token_loss and its price: one scalar all-reduce per step over every rank,
    counted on each pipeline rank, where data/context ranks or micro-batches split the batch."""
    from autopar.domain.layout import ParallelLayout, TrainSpec
    from cost_models.step import PlanPricer
    from cost_models.topology import ClusterConfig, ClusterSpec

    profile = traced("gpt.py", "fp32", 2, layers=2, hidden=32, heads=4, seq_len=16, vocab=64)
    cluster = ClusterSpec.from_config(ClusterConfig(name="t", gpu="A100-80GB", nodes=1, gpus_per_node=8))
    pricer = PlanPricer(profile, cluster, TrainSpec(global_batch_size=8, precision="fp32", clip_grad_norm=False))
    whole = ParallelLayout(dp=1, tp=2, pp=1, cp=1, micro_batch_size=8, num_micro_batches=1)
    for layout in (ParallelLayout(dp=2, micro_batch_size=4),
                   ParallelLayout(dp=1, tp=2, micro_batch_size=2, num_micro_batches=4)):
        assert pricer.structure.weighs_tokens(layout)
        assert pricer.fixed_time_s(layout) > 0
        assert pricer.issued.scalar_collectives(layout) == {"all_reduce": 1}
    assert not pricer.structure.weighs_tokens(whole)
    assert pricer.fixed_time_s(whole) == 0 and pricer.issued.scalar_collectives(whole) == {}


def test_validation_counts_are_recorded_without_autograd(one_rank_group):
    """Validation runs under no_grad, so no graph keeps the count: the counting mode records it
    as each mean nll_loss runs (a sum-reduced one is not a mean), and the summed micro-batch
    losses over the global count give the whole batch's mean."""
    torch.manual_seed(0)
    head = torch.nn.Linear(4, 7)
    inputs, targets = torch.randn(2, 5, 4), torch.randint(0, 7, (2, 5))
    targets[0, :4] = IGNORED  # 1 + 5 counted
    counts = TokenCounts(torch.device("cpu"))
    with torch.no_grad():
        with counts.counting():
            means = torch.stack([F.cross_entropy(head(inputs[m]), targets[m]) for m in range(2)])
            F.cross_entropy(head(inputs[0]), targets[0], reduction="sum")
        expected = F.cross_entropy(head(inputs).flatten(0, 1), targets.flatten())
    assert [c.item() for c in counts.counts] == [1, 5]
    whole = counts.summed(means).sum() / counts.global_count(2)
    assert whole.item() == pytest.approx(expected.item(), rel=1e-6)

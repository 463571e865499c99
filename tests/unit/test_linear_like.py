"""Linear-like modules recognised by what their forward computes (autopar.trace.linear_like),
and the share of a model a tensor-parallel plan splits (autopar.solver.tp_coverage)."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.errors import UserError
from autopar.trace.linear_like import AffineLayout, affine_layout
from autopar.solver.tp_coverage import FASTER_WHOLE, TPCoverage, check_pinned_coverage, coverage_line


class Conv1D(nn.Module):
    """GPT-2's transposed linear, as transformers writes it (sizes read from its attributes)."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class FalconLinear(nn.Linear):
    def forward(self, x):
        y = x @ self.weight.T
        return y if self.bias is None else y + self.bias


class Scaled(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


class WithScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x @ self.weight.T * self.scale


def test_a_transposed_weight_is_recognised_with_its_sizes():
    assert affine_layout(Conv1D(6, 4)) == AffineLayout(transposed=True, in_features=4, out_features=6)
    assert affine_layout(Conv1D(6, 4)).out_dim == 1


def test_a_linear_subclass_with_an_affine_forward_is_recognised_and_one_that_scales_is_not():
    assert affine_layout(FalconLinear(4, 6)) == AffineLayout(transposed=False, in_features=4, out_features=6)
    assert affine_layout(FalconLinear(4, 6, bias=False)) == AffineLayout(False, 4, 6)
    assert affine_layout(nn.Linear(4, 6)) == AffineLayout(False, 4, 6)
    assert affine_layout(Scaled(4, 4)) is None


def test_a_square_weight_is_told_apart_by_its_values():
    """With in == out both layouts fit the shapes; only the values say which map it computes."""
    assert affine_layout(Conv1D(5, 5)).transposed
    assert not affine_layout(FalconLinear(5, 5)).transposed


def test_modules_with_more_state_or_no_matrix_are_not_affine():
    assert affine_layout(WithScale()) is None
    assert affine_layout(nn.Embedding(8, 4)) is None
    assert affine_layout(nn.LayerNorm(4)) is None
    assert affine_layout(nn.Conv1d(4, 4, 3)) is None


def test_modules_built_on_fake_tensors_are_probed_on_real_ones():
    """Planning builds the model under FakeTensorMode; the probe needs values, and gets them
    also while the mode is active."""
    with FakeTensorMode():
        conv, scaled = Conv1D(8, 8), Scaled(8, 8)
        assert affine_layout(conv) == AffineLayout(True, 8, 8)
        assert affine_layout(scaled) is None


def _coverage(split: int, refused: int, total: int = 100) -> TPCoverage:
    return TPCoverage(tp=4, linear_params=total, split_params=split, refused_params=refused, flops=1000.0,
                      split_flops=400.0,
                      replicated={"h.0.attn.qkv": "h.0.attn.qkv's output is cut along its split dimension",
                                  "h.0.mlp.up": FASTER_WHOLE})


def test_coverage_shares_and_line():
    coverage = _coverage(75, 20)
    assert coverage.param_share == 0.75 and coverage.flop_share == 0.4 and coverage.splittable_share == 0.8
    assert coverage_line(4, 0.75, 0.4) == ("tensor parallel (tp=4) splits 75% of the blocks' linear parameters, "
                                           "40% of their forward FLOPs")
    assert TPCoverage(tp=2).param_share is None


def test_a_pinned_tp_whose_code_lets_less_than_half_split_is_refused_naming_modules_and_reasons():
    check_pinned_coverage(_coverage(50, 50))  # half can split: accepted
    check_pinned_coverage(_coverage(0, 0))  # all could split, the search replicated it: the share says so
    with pytest.raises(UserError) as refused:
        check_pinned_coverage(_coverage(40, 51))
    text = str(refused.value)
    assert "plan.tp=4" in text and "could split at most 49%" in text and "keeps 51 of 100 whole" in text
    assert "h.0.attn.qkv (h.0.attn.qkv's output is cut along its split dimension)" in text
    assert "h.0.mlp.up" not in text  # replicated by the search's choice, not by the model's code
    assert "Fix: pin a smaller plan.tp" in text and "plan.dp" in text


MODEL_FILE = '''
import torch
import torch.nn.functional as F
from torch import nn


class Conv1D(nn.Module):
    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(32, 8), Conv1D(8, 32)
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x):
        y = self.c_proj(F.gelu(self.c_fc(x)))
        z = self.down(F.gelu(self.up(x + y)))
        z.view(-1)[:1] += 1  # in place, through a view
        return x + z


def build_model():
    return nn.Sequential(Block())


def example_batch(batch_size):
    return torch.randn(batch_size, 4, 8)


def loss_fn(output, batch):
    return output.pow(2).mean()
'''


def test_codegen_marks_transposed_linears_and_outputs_modified_in_place(tmp_path):
    from autopar.codegen.model_facts import inspect_model
    from autopar.codegen.tp_plan import StyleSpec, with_transposed_styles

    path = tmp_path / "model.py"
    path.write_text(MODEL_FILE)
    facts = inspect_model(path, {})
    assert facts.kind("0.c_fc") == "linear" and facts.modules["0.c_fc"].transposed
    assert facts.kind("0.up") == "linear" and not facts.modules["0.up"].transposed
    assert {name for name, m in facts.modules.items() if m.output_modified_in_place} == {"0.down"}
    styles = with_transposed_styles({"0.c_fc": StyleSpec("ColwiseParallel"), "0.c_proj": StyleSpec("RowwiseParallel"),
                                     "0.up": StyleSpec("ColwiseParallel"), "0.down": StyleSpec("RowwiseParallel")},
                                    facts)
    assert [spec.source() for spec in styles.values()] == [
        "TransposedColwiseParallel()", "TransposedRowwiseParallel()", "ColwiseParallel()",
        "OwnedOutput(style=RowwiseParallel())"]


def test_plan_json_carries_the_shares_and_an_older_file_without_them_loads():
    import json
    from dataclasses import replace

    from autopar.plans import Plan, Predicted
    from autopar.solver.tp_coverage import coverage_notes

    plan = Plan(dp=1, tp=2, pp=1, cp=1, predicted=Predicted(tp_param_share=0.75, tp_flop_share=0.6875))
    data = json.loads(plan.to_json())
    assert data["predicted"]["tp_param_share"] == 0.75
    assert Plan.from_json(plan.to_json()).predicted.tp_flop_share == 0.6875
    assert coverage_notes(plan) == ["tensor parallel (tp=2) splits 75% of the blocks' linear parameters, "
                                    "69% of their forward FLOPs."]
    for key in ("tp_param_share", "tp_flop_share"):
        del data["predicted"][key]
    older = Plan.from_json(json.dumps(data))
    assert older.predicted.tp_param_share is None and coverage_notes(older) == []
    corrupted = Plan.from_json(json.dumps({**data, "predicted": {**data["predicted"], "tp_param_share": 1.5}}))
    assert any("tp_param_share" in problem for problem in corrupted.problems())
    assert coverage_notes(replace(plan, tp=1)) == []


SCALED_MLP = '''
import torch
import torch.nn.functional as F
from torch import nn


class Scaled(nn.Linear):
    """No affine map of its input alone (it doubles it): no style splits it."""

    def forward(self, x):
        return super().forward(x) * 2


class Block(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
        self.mlp = nn.Sequential(Scaled(hidden, 4 * hidden), nn.GELU(), Scaled(4 * hidden, hidden))

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (t(self.norm(x)).view(b, s, -1, 16).transpose(1, 2) for t in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h))
        return x + self.mlp(x)


class Model(nn.Module):
    def __init__(self, hidden=64, vocab=128):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList([Block(hidden) for _ in range(2)])
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model():
    return Model()


def example_batch(batch_size):
    return {"tokens": torch.randint(0, 128, (batch_size, 32))}


def loss_fn(logits, batch):
    return logits.float().pow(2).mean()
'''


def test_autopar_plan_prints_the_share_and_refuses_a_pinned_tp_that_splits_under_half(tmp_path, capsys,
                                                                                      examples_dir):
    from autopar.cli import main

    common = ["cluster=cpu_gloo", "cluster.gpus_per_node=2", "train.global_batch_size=8", "train.precision=fp32"]
    out = tmp_path / "plan.json"
    gpt = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.seq_len=32", "model.vocab=128"]
    assert main(["plan", str(examples_dir / "gpt.py"), *common, *gpt, "plan.tp=2", "--out", str(out)]) == 0
    share = Plan_load(out).predicted.tp_param_share
    assert f"splits {share:.0%} of the blocks' linear parameters" in capsys.readouterr().out
    model = tmp_path / "scaled.py"
    model.write_text(SCALED_MLP)
    assert main(["plan", str(model), *common, "plan.tp=2", "--out", str(tmp_path / "refused.json")]) == 1
    err = " ".join(capsys.readouterr().err.split())
    # q, k, v and o split (4 h^2 and 3 biases of h), the MLP's 8 h^2 (and its biases) replicated
    assert "plan.tp=2 is pinned, but tensor parallelism could split at most 33% of the blocks' linear parameters" in err
    assert "blocks.0.mlp.0 (blocks.0.mlp.0 is a Scaled, whose forward is not an affine map" in err
    assert "Fix: pin a smaller plan.tp" in err
    assert not (tmp_path / "refused.json").exists()


def Plan_load(path):
    from autopar.plans import Plan

    return Plan.load(path)


def test_experts_count_as_linear_parameters_split_only_under_expert_tp():
    """The MoE test model's experts (stacked feed-forward weights) are most of its block
    parameters: split by expert TP, replicated over the TP group without it, never 'refused'."""
    import math
    from pathlib import Path

    from autopar.model_file import load_model_file
    from autopar.profile import profile_model
    from autopar.solver.tp_coverage import NO_EXPERT_TP, tp_coverage

    profile = profile_model(load_model_file(Path(__file__).resolve().parents[1] / "moe_model.py"), {}, 1, "fp32")
    experts = sum(math.prod(shape) for name, shape in profile.param_shapes.items() if ".experts." in name)
    whole, split = (tp_coverage(profile, {}, 2, expert_tp=flag) for flag in (False, True))
    assert experts > 0 and whole.linear_params == split.linear_params
    assert whole.split_params == 0 and split.split_params == experts
    assert whole.refused_params == 0 and NO_EXPERT_TP in whole.replicated.values()
    assert split.flop_share > 0 and whole.flop_share == 0

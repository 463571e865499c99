"""Legality of tensor-parallel splits before pricing (autopar.solver.tp_legality): the planner
prices only splits the model's own code runs correctly on one rank's share, and says which op
or module decided each refusal.

One small model file, its attention written five ways (as models in the wild write it)."""
from __future__ import annotations

import dataclasses
import json
import re
import textwrap
from pathlib import Path

import pytest

from autopar.model_file import load_model_file
from autopar.profile import profile_model
from autopar.solver.tp_legality import TPLegality
from autopar.solver.intra_op import IntraOpSolver
from autopar.solver.tp_split import ILPSplitter, _GroupCosts, illegal_splits
from cost_models.hardware import get_gpu
from cost_models.topology import ClusterConfig, ClusterSpec

MODEL = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from torch import nn


    class Conv1D(nn.Module):
        """GPT-2's transposed linear."""

        def __init__(self, nf, nx):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
            self.bias = nn.Parameter(torch.zeros(nf))

        def forward(self, x):
            return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], -1)


    class Attention(nn.Module):
        def __init__(self, style, hidden, heads):
            super().__init__()
            self.style, self.heads, self.head_dim = style, heads, hidden // heads
            if style in ("fused", "fused_heads"):
                self.qkv = nn.Linear(hidden, 3 * hidden)
            elif style == "conv1d":
                self.qkv = Conv1D(3 * hidden, hidden)
            else:
                self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
            self.o = nn.Linear(hidden, hidden)

        def forward(self, x):
            b, s, h = x.shape
            if self.style in ("fused", "conv1d"):
                q, k, v = self.qkv(x).split(h, dim=2)
            elif self.style == "fused_heads":  # Falcon's way: viewed into heads, then cut along them
                qkv = self.qkv(x).view(b, s, 3 * self.heads, self.head_dim)
                q, k, v = (qkv[:, :, i * self.heads:(i + 1) * self.heads].reshape(b, s, h) for i in range(3))
            else:
                q, k, v = self.q(x), self.k(x), self.v(x)
            if self.style == "folded":  # OPT's view: -1 for the sequence, the global head count
                q, k, v = (t.view(b, -1, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
            else:
                heads = -1 if self.style == "local" else self.heads  # "hardcoded": view by the global count
                q, k, v = (t.view(b, s, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o(y.transpose(1, 2).reshape(b, s, -1))


    class LearnedActivation(nn.Module):
        """Apertus's xIELU, shortened: trainable scalars, a constant buffer."""

        def __init__(self):
            super().__init__()
            self.alpha = nn.Parameter(torch.tensor([0.5]))
            self.register_buffer("beta", torch.tensor(0.5))

        def forward(self, x):
            return F.softplus(self.alpha) * x * torch.sigmoid(x) + self.beta * x


    class BiasAfter(nn.Linear):
        """Falcon's linear: its bias added beside the matmul, not inside it."""

        def forward(self, x):
            return x @ self.weight.T + self.bias


    class Block(nn.Module):
        def __init__(self, style, hidden, heads):
            super().__init__()
            self.norm = nn.LayerNorm(hidden)
            self.attn = Attention(style, hidden, heads)
            linear = BiasAfter if style == "bias_after" else nn.Linear
            width = 2 * hidden if style == "joined" else 4 * hidden  # joined: two halves side by side
            self.up, self.down = linear(hidden, width), linear(4 * hidden, hidden)
            self.up_other = nn.Linear(hidden, width) if style == "joined" else None
            self.act = LearnedActivation() if style == "learned_activation" else nn.GELU()
            self.in_place = style == "in_place"
            self.activated_fused = style == "activated_fused"
            self.gate = nn.Linear(hidden, 1) if style == "gated" else None  # Qwen2-MoE's shared-expert gate

        def forward(self, x):
            x = x + self.attn(self.norm(x))
            # joined: one half activated first (the walk goes through the block's own ops), one not
            up = self.up(x) if self.up_other is None else torch.cat([F.gelu(self.up(x)), self.up_other(x)], -1)
            if self.activated_fused:  # a fused gate and value, activated together, then cut
                gate, value = self.act(up).chunk(2, dim=-1)
                y = self.down(torch.cat([gate * value, gate], dim=-1))
            else:
                y = self.down(self.act(up))
            if self.gate is not None:
                y = torch.sigmoid(self.gate(x)) * y
            if self.in_place:
                y += x  # Falcon's mlp_output += attention_output
                return y
            return x + y


    class Model(nn.Module):
        def __init__(self, style, hidden=64, heads=4, vocab=128):
            super().__init__()
            self.embed = nn.Embedding(vocab, hidden)
            self.blocks = nn.ModuleList([Block(style, hidden, heads) for _ in range(2)])
            self.head = nn.Linear(hidden, vocab, bias=False)

        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(x)


    def build_model(style: str = "local", hidden: int = 64):
        return Model(style, hidden)


    def example_batch(batch_size: int):
        return {"tokens": torch.randint(0, 128, (batch_size, 32))}


    def loss_fn(logits, batch):
        return logits.float().pow(2).mean()
''')


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("legality") / "attention_styles.py"
    path.write_text(MODEL)
    return path


def _profile(path: Path, style: str, **kwargs):
    return profile_model(load_model_file(path), {"style": style, **kwargs}, 1, "fp32")


def _styles(profile, tp: int = 2) -> tuple[dict[str, str], ILPSplitter]:
    """The ILP's styles for the first block, priced on one H100 pair."""
    cluster = ClusterSpec.from_config(ClusterConfig(name="pair", gpu="H100-SXM", nodes=1, gpus_per_node=2))
    splitter = ILPSplitter(profile)
    splitter.split("blocks.0", tp, cluster.group_links([0, 1]), get_gpu("H100-SXM"))
    return splitter.solutions[("blocks.0", tp)], splitter


def test_separate_projections_viewed_by_minus_one_split_like_megatron(model_path):
    """The control: separate q/k/v viewed with -1 heads pass every rule; nothing is refused."""
    profile = _profile(model_path, "local")
    legality = TPLegality(profile)
    assert legality.static("blocks.0", 2) == {}
    styles = {"blocks.0.attn.q": "colwise", "blocks.0.attn.k": "colwise", "blocks.0.attn.v": "colwise",
              "blocks.0.attn.o": "rowwise"}
    assert legality.probe("blocks.0", 2, styles) == {}


def test_fused_projection_cut_into_parts_splits_as_its_parts(model_path):
    """``qkv(x).split(h, dim=2)``: the cuts are read as three parts, each rank holds its share of
    each (autopar.solver.tp_fused), so nothing is refused and the region runs."""
    legality = TPLegality(_profile(model_path, "fused"))
    assert legality.static("blocks.0", 2) == {}
    assert legality.fused_parts("blocks.0", 2) == {"blocks.0.attn.qkv": [64, 64, 64]}
    styles = {"blocks.0.attn.qkv": "colwise", "blocks.0.attn.o": "rowwise"}
    assert legality.probe("blocks.0", 2, styles) == {}
    # It views the parts by its global head count: the region keeps DTensor activations.
    assert legality.dtensor_regions("blocks.0", 2, styles) == {"blocks.0.attn"}


def test_fused_projection_cut_after_a_view_into_heads_is_refused_by_the_cut(model_path):
    """Falcon's way: the fused output is viewed into heads and then sliced along them; that is no
    cut of the output into parts, and a contiguous share would hand rank 0 q and half of k."""
    legality = TPLegality(_profile(model_path, "fused_heads"))
    found = legality.static("blocks.0", 2)
    assert set(found) == {"blocks.0.attn.qkv"}
    assert found["blocks.0.attn.qkv"].kind == "fused output"
    assert "aten.slice" in found["blocks.0.attn.qkv"].reason
    assert legality.fused_parts("blocks.0", 2) == {}


def test_view_by_a_hard_coded_head_count_fails_on_a_share_and_runs_on_dtensors(model_path):
    """Shapes alone cannot tell `view(b, s, self.heads, d)` from `view(b, s, -1, d)` (the traced
    graph holds the same numbers); one rank's share run on fake tensors can. The region is split
    keeping DTensor activations, where the global count is right (autopar.solver.tp_global_shapes)."""
    legality = TPLegality(_profile(model_path, "hardcoded"))
    assert legality.static("blocks.0", 2) == {}
    styles = {"blocks.0.attn.q": "colwise", "blocks.0.attn.k": "colwise", "blocks.0.attn.v": "colwise",
              "blocks.0.attn.o": "rowwise", "blocks.0.up": "colwise", "blocks.0.down": "rowwise"}
    assert legality.probe("blocks.0", 2, styles) == {}
    assert legality.dtensor_regions("blocks.0", 2, styles) == {"blocks.0.attn"}


def test_a_view_that_folds_the_sequence_on_a_share_runs_on_dtensors(model_path):
    """OPT's attention runs on one rank's share without an error and computes something else:
    the sequence, not the heads, is what the view cuts. On DTensors `-1` is the whole sequence."""
    legality = TPLegality(_profile(model_path, "folded"))
    styles = {"blocks.0.attn.q": "colwise", "blocks.0.attn.k": "colwise", "blocks.0.attn.v": "colwise",
              "blocks.0.attn.o": "rowwise", "blocks.0.up": "colwise", "blocks.0.down": "rowwise"}
    assert legality.probe("blocks.0", 2, styles) == {}
    assert legality.dtensor_regions("blocks.0", 2, styles) == {"blocks.0.attn"}


def test_features_as_wide_as_the_sequence_are_not_read_as_a_cut_sequence(model_path):
    """hidden = sequence length = 32: a column split halves a 32-wide feature dim, which is not
    the sequence (a 1B GPT has hidden 2048 and sequence 2048)."""
    legality = TPLegality(_profile(model_path, "local", hidden=32))
    styles = {"blocks.0.attn.q": "colwise", "blocks.0.attn.k": "colwise", "blocks.0.attn.v": "colwise",
              "blocks.0.attn.o": "rowwise", "blocks.0.up": "colwise", "blocks.0.down": "rowwise"}
    assert legality.probe("blocks.0", 2, styles) == {}


def test_an_output_modified_in_place_does_not_keep_its_module_whole(model_path):
    """Codegen copies such an output (autopar.codegen.in_place; tests/unit/test_linear_like.py)."""
    found = TPLegality(_profile(model_path, "in_place")).static("blocks.0", 2)
    assert "blocks.0.down" not in found


def test_a_transposed_linear_is_judged_by_what_it_computes_not_by_its_class(model_path):
    """GPT-2's Conv1D computes x @ W + b: the class rule lets it through, and its fused output,
    cut by ``split``, splits as its parts; tests/unit/test_linear_like.py refuses a module that is
    no affine map."""
    legality = TPLegality(_profile(model_path, "conv1d"))
    assert legality.static("blocks.0", 2) == {}
    assert legality.fused_parts("blocks.0", 2) == {"blocks.0.attn.qkv": [64, 64, 64]}


def test_a_weight_narrower_than_tp_stays_replicated_and_does_not_refuse_the_degree(model_path):
    """A gate with one output feature cannot be split over 2 ranks (one would hold none of it):
    that module is refused, not tp=2 for the whole model."""
    from autopar.solver.space import ModelShape

    profile = _profile(model_path, "gated")
    found = TPLegality(profile).static("blocks.0", 2)
    assert set(found) == {"blocks.0.gate"} and found["blocks.0.gate"].kind == "too small"
    assert TPLegality(profile).static("blocks.0", 1) == {}
    shape = ModelShape.from_profile(profile)
    assert 1 in shape.split_dims and shape.tp_divides(2) and shape.tp_problem(2) is None


@pytest.mark.parametrize("style", ["fused_heads", "gated"])
def test_the_ilp_replicates_what_is_illegal_and_says_why(model_path, style):
    """End to end through the splitter the planner prices with: the illegal modules come back
    replicated, the legal rest may still split, and each refused kind has one report line."""
    profile = _profile(model_path, style)
    styles, splitter = _styles(profile)
    refused = splitter.illegal[("blocks.0", 2)]
    assert refused
    for module in refused:
        assert styles.get(module, "replicate") == "replicate", (module, styles)
    assert any(s in ("colwise", "rowwise") for s in styles.values()), styles  # the MLP still splits
    lines = illegal_splits(splitter, 2)
    assert len(lines) == len({item.kind for item in refused.values()})


def test_a_parameter_no_style_shards_keeps_the_ops_reading_it_whole(model_path):
    """A learned activation between the MLP's projections (Apertus's xIELU) would run on each
    rank's share of the features with a whole, plain copy of its scalars, leaving each rank its
    share of their gradient, never summed: its ops run replicated, so the MLP cannot pair around
    it, and the attention still pairs. A column-parallel linear whose bias is added beside its
    matmul (Falcon's) still adds it on the rank's share: that bias is split with its module."""
    styles, splitter = _styles(_profile(model_path, "learned_activation"))
    assert (styles["blocks.0.attn.q"], styles["blocks.0.attn.o"]) == ("colwise", "rowwise")
    assert styles.get("blocks.0.down") != "rowwise"
    activation = [op.name for op in splitter.profile.ops if op.module == "blocks.0.act" and op.phase == "forward"]
    assert activation and not set(activation) & splitter.sharded_ops[("blocks.0", 2)]
    control, _ = _styles(_profile(model_path, "local"))
    assert (control["blocks.0.up"], control["blocks.0.down"]) == ("colwise", "rowwise")
    beside = _profile(model_path, "bias_after")
    pair = ClusterSpec.from_config(ClusterConfig(name="pair", gpu="H100-SXM", nodes=1, gpus_per_node=2))
    solver = IntraOpSolver(beside, _GroupCosts(get_gpu("H100-SXM"), "fp32", pair.group_links([0, 1])), 2)
    ops = {op.name: op for op in beside.ops if op.layer == "blocks.0" and op.phase == "forward"}
    bias_add = [op for op in ops.values() if op.module == "blocks.0.up" and op.target.startswith("aten.add")]
    assert len(bias_add) == 1 and {s.name for s in solver._strategies(bias_add[0], ops)} == {"R", "S"}


def test_projections_concatenated_along_their_split_dimension_stay_whole(model_path):
    """Two up projections joined by torch.cat along the features before the down projection:
    split by columns, each rank would join its shares of the two (the first half of each) where
    the row split of `down` reads the first half of the whole, and train something else with
    every shape right (compile's check measured a loss 0.034 off at step 0). Both stay whole,
    named by the rule; the attention still pairs."""
    styles, splitter = _styles(_profile(model_path, "joined"))
    refused = splitter.illegal[("blocks.0", 2)]
    assert {module: item.kind for module, item in refused.items()} == {
        "blocks.0.up": "joined output", "blocks.0.up_other": "joined output"}
    assert "aten.cat" in refused["blocks.0.up"].reason
    assert styles.get("blocks.0.up", "replicate") == styles.get("blocks.0.up_other", "replicate") == "replicate"
    assert styles.get("blocks.0.down") != "rowwise"
    assert (styles["blocks.0.attn.q"], styles["blocks.0.attn.o"]) == ("colwise", "rowwise")


def test_a_fused_projection_cut_after_the_block_activates_it_is_read_as_fused(model_path):
    """`act(up(x)).chunk(2, -1)`: the cut comes after an op of the block, not of `up`; read as a
    fused projection all the same (split as its parts, or kept whole), never a plain column
    split whose ranks would each take the first half of their own share."""
    profile = _profile(model_path, "activated_fused")
    legality = TPLegality(profile)
    refused = legality.static("blocks.0", 2)
    parts = legality.fused_parts("blocks.0", 2)
    assert parts.get("blocks.0.up") == [128, 128] or refused["blocks.0.up"].kind == "fused output"


def test_sequence_parallelism_is_not_searched_where_a_block_calls_a_linear_on_the_stream(model_path):
    """The test model's blocks call `up` directly on the residual stream (OPT's fc1): no torch
    style gathers the sequence for it, so no candidate has SP, and the reason names it."""
    from autopar.solver.space import ModelShape, sp_blocker

    profile = _profile(model_path, "local")
    assert re.fullmatch(r"blocks\.0\.(up|down) is a linear layer called directly on the residual stream in blocks\.0",
                        sp_blocker(profile))
    assert ModelShape.from_profile(profile).sp_blocker is not None


def test_a_gpt_keeps_sequence_parallelism():
    from autopar.solver.space import sp_blocker
    from tests.profiles import gpt

    assert sp_blocker(gpt()) is None


def test_the_plan_result_names_what_decided_each_refused_split(model_path):
    """Under a tp=2 pin the plan trains the Falcon-style fused model with its fused projection
    replicated, and the planning result carries one line per refused kind for the report; the
    split-into-parts model's plan splits it and lists its parts."""
    from autopar.config import PlanPins, SolverConfig
    from autopar.solver.planner import Planner
    from cost_models.step import TrainSpec

    cluster = ClusterSpec.from_config(ClusterConfig(name="cpu2", gpu="cpu", nodes=1, gpus_per_node=2,
                                                    intra_node_latency_us=3.0, intra_node_bandwidth_GBps=1.5))

    def plan(style: str):
        return Planner(_profile(model_path, style), cluster, TrainSpec(global_batch_size=4, precision="fp32"),
                       SolverConfig(top_k=0), PlanPins(tp=2)).run()

    result = plan("fused_heads")
    assert result.plan.tp == 2 and not result.plan.sequence_parallel
    assert result.plan.tp_styles.get("blocks.0.attn.qkv", "replicate") == "replicate" and result.plan.tp_fused == {}
    fused = [line for line in result.illegal_splits if "(fused output)" in line]
    assert len(fused) == 1 and "blocks.0.attn.qkv" in fused[0] and "aten.slice" in fused[0]
    assert any(line.startswith("sequence parallelism not considered: blocks.0.") for line in result.illegal_splits)
    split = plan("fused").plan
    assert split.tp_styles["blocks.0.attn.qkv"] == "colwise"
    assert split.tp_fused == {f"blocks.{i}.attn.qkv": [64, 64, 64] for i in range(2)}


def test_a_pin_of_sequence_parallelism_it_cannot_wrap_is_refused_naming_the_module(model_path):
    from autopar.config import PlanPins, SolverConfig
    from autopar.errors import UserError
    from autopar.solver.planner import Planner
    from cost_models.step import TrainSpec

    cluster = ClusterSpec.from_config(ClusterConfig(name="cpu2", gpu="cpu", nodes=1, gpus_per_node=2,
                                                    intra_node_latency_us=3.0, intra_node_bandwidth_GBps=1.5))
    with pytest.raises(UserError, match=r"plan.sequence_parallel=true cannot run on this model: blocks\.0\.(up|down) "
                                        r"is a linear layer called directly on the residual stream"):
        Planner(_profile(model_path, "local"), cluster, TrainSpec(global_batch_size=4, precision="fp32"),
                SolverConfig(top_k=0), PlanPins(tp=2, sequence_parallel=True)).run()


def test_a_layer_that_fails_on_fake_tensors_unsplit_is_not_blamed_on_the_split(model_path, monkeypatch):
    """Qwen3-MoE's experts take a grouped GEMM whose fake kernel wants bf16, so its decoder layer
    fails on fake tensors whether or not its attention is split, on plain or DTensor activations:
    the probe must not read that failure as the attention failing on a share (it kept Qwen3-MoE's
    attention whole, 0% split at tp=2); it finds nothing and compile's proof, which runs the plan,
    judges the split. The same failure on the shares alone is a finding."""
    import autopar.solver.tp_global_shapes as global_shapes
    import autopar.solver.tp_probe as probes

    real_run = probes.run_narrowed
    grouped_gemm = "RuntimeError: Expected inputs of BF16 type"
    styles = {"blocks.0.attn.q": "colwise", "blocks.0.attn.k": "colwise", "blocks.0.attn.v": "colwise",
              "blocks.0.attn.o": "rowwise", "blocks.0.up": "colwise", "blocks.0.down": "rowwise"}
    profile = _profile(model_path, "local")
    monkeypatch.setattr(global_shapes, "dtensor_region_error", lambda *args: grouped_gemm)

    def failing(unsplit_too: bool):
        def run(build, named, linears, *rest, **kwargs):
            error, shapes = real_run(build, named, linears, *rest, **kwargs)
            return (grouped_gemm if linears or unsplit_too else error), shapes
        return run

    monkeypatch.setattr(probes, "run_narrowed", failing(unsplit_too=True))
    assert TPLegality(profile).probe("blocks.0", 2, styles) == {}
    monkeypatch.setattr(probes, "run_narrowed", failing(unsplit_too=False))
    found = TPLegality(dataclasses.replace(profile, findings={})).probe("blocks.0", 2, styles)  # not the answer kept
    assert set(found) == set(styles) and {split.kind for split in found.values()} == {"local shapes"}


@pytest.mark.parametrize("style", ["fused", "hardcoded", "fused_heads"])
def test_answers_kept_with_the_profile_are_given_again_without_building_the_model(model_path, style, monkeypatch):
    """What a plan found by running the model (kept beside a kept profile as JSON,
    autopar.profile_cache) answers the next plan of it exactly, with no rebuild of the model."""
    from autopar.serialize import compact_json

    profile = _profile(model_path, style)
    first = TPLegality(profile)
    styles = {"blocks.0.attn.q": "colwise", "blocks.0.attn.k": "colwise", "blocks.0.attn.v": "colwise",
              "blocks.0.attn.o": "rowwise"}
    if style != "hardcoded":
        styles = {"blocks.0.attn.qkv": "colwise", "blocks.0.attn.o": "rowwise"}

    def answers(legality):
        return (legality.static("blocks.0", 2), legality.fused_parts("blocks.0", 2),
                legality.probe("blocks.0", 2, styles), legality.dtensor_regions("blocks.0", 2, styles),
                legality.region_attributes("blocks.0", 2, styles))

    found = answers(first)
    assert any(found[:4])  # something was found that needed the model
    kept = dataclasses.replace(profile, findings=json.loads(compact_json(profile.findings)))
    monkeypatch.setattr(TPLegality, "_model", lambda self: pytest.fail("the model was built again"))
    assert answers(TPLegality(kept)) == found

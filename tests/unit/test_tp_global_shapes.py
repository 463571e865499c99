"""Paired regions whose code views by global sizes run with DTensor activations
(autopar.solver.tp_global_shapes): which the probe accepts, which it still refuses and why, and
the styles codegen writes for them. Training equality: tests/dist/test_global_shapes.py."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from autopar.codegen.model_facts import inspect_model
from autopar.codegen.tp_plan import build_tp_plan
from autopar.model_file import load_model_file
from autopar.profile import profile_model
from autopar.solver.tp_legality import TPLegality
from tests.dist.plans import REPO, TinyModel, make_plan

GLOBAL_GPT = REPO / "tests" / "dist" / "models" / "gpt_global_shapes.py"
BLOCK = {"blocks.0.attn.q": "colwise", "blocks.0.attn.k": "colwise", "blocks.0.attn.v": "colwise",
         "blocks.0.attn.proj": "rowwise", "blocks.0.mlp.fc": "colwise", "blocks.0.mlp.out": "rowwise"}

# The GPT's MLP with a softmax over its features before the global view: DTensor keeps it
# correct by gathering the features, a collective the pricer does not count.
GATHERING_MLP = textwrap.dedent('''
    class MLP(nn.Module):
        def __init__(self, hidden: int):
            super().__init__()
            self.ffn = 4 * hidden
            self.fc = nn.Linear(hidden, self.ffn)
            self.out = nn.Linear(self.ffn, hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            return self.out(torch.softmax(self.fc(x), dim=-1).view(b, s, self.ffn))
''')


def _legality(path: Path, **kwargs) -> TPLegality:
    size = dict(layers=2, hidden=32, heads=4, seq_len=16, vocab=64)
    return TPLegality(profile_model(load_model_file(path), {**size, **kwargs}, 1, "fp32"))


@pytest.mark.parametrize("tp", [2, 4])
def test_attention_and_mlp_viewing_by_global_sizes_run_as_dtensor_regions(tp):
    legality = _legality(GLOBAL_GPT)
    assert legality.probe("blocks.0", tp, BLOCK) == {}
    assert legality.dtensor_regions("blocks.0", tp, BLOCK) == {"blocks.0.attn", "blocks.0.mlp"}


def test_regions_written_for_shares_keep_local_tensors():
    legality = _legality(REPO / "examples" / "gpt.py")
    styles = {"blocks.0.attn.q_proj": "colwise", "blocks.0.attn.k_proj": "colwise",
              "blocks.0.attn.v_proj": "colwise", "blocks.0.attn.out_proj": "rowwise",
              "blocks.0.mlp.fc_in": "colwise", "blocks.0.mlp.fc_out": "rowwise"}
    assert legality.probe("blocks.0", 2, styles) == {}
    assert legality.dtensor_regions("blocks.0", 2, styles) == set()


def test_heads_the_split_does_not_divide_are_refused_on_dtensors_too():
    """3 heads over 2 ranks: the view cannot shard the heads evenly on DTensors either."""
    legality = _legality(GLOBAL_GPT, hidden=48, heads=3)
    found = legality.probe("blocks.0", 2, BLOCK)
    assert set(found) == {"blocks.0.attn.q", "blocks.0.attn.k", "blocks.0.attn.v", "blocks.0.attn.proj"}
    assert found["blocks.0.attn.q"].kind == "local shapes"
    assert "with DTensor activations" in found["blocks.0.attn.q"].reason
    assert legality.dtensor_regions("blocks.0", 2, BLOCK) == {"blocks.0.mlp"}


def test_a_region_dtensor_would_gather_is_refused_naming_the_collective(tmp_path):
    source = GLOBAL_GPT.read_text()
    start, end = source.index("class MLP"), source.index("class Block")
    path = tmp_path / "gathering_mlp.py"
    path.write_text(source[:start] + GATHERING_MLP.lstrip() + "\n\n" + source[end:])
    legality = _legality(path)
    found = legality.probe("blocks.0", 2, BLOCK)
    assert set(found) == {"blocks.0.mlp.fc", "blocks.0.mlp.out"}
    assert "DTensor redistributes inside the region (1 all_gather_into_tensor, 1 all_reduce" in \
        found["blocks.0.mlp.fc"].reason
    assert legality.dtensor_regions("blocks.0", 2, BLOCK) == {"blocks.0.attn"}


def test_codegen_keeps_dtensor_outputs_only_in_dtensor_regions():
    model = TinyModel(name="gpt_global_shapes", path=GLOBAL_GPT, kwargs=dict(layers=2, hidden=32, heads=4,
                      seq_len=16, vocab=64), prologue=["wte", "wpe"], container="blocks", blocks=2,
                      epilogue=["ln_f", "lm_head"])
    plan = make_plan(model, tp=2)
    facts = inspect_model(GLOBAL_GPT, model.kwargs)
    plan = plan.with_updates(tp_dtensor_regions=["blocks.0.attn"])
    styles = {name: spec.source() for name, spec in build_tp_plan(plan, facts).styles.items()}
    assert styles["blocks.0.attn.q"] == "ColwiseParallel(use_local_output=False)"
    assert styles["blocks.0.attn.proj"] == "RowwiseParallel(input_layouts=Shard(-1))"
    assert styles["blocks.0.attn"].startswith("GlobalShapes(inner=PrepareModuleInput(")
    assert styles["blocks.0.mlp.fc"] == styles["blocks.1.attn.q"] == "ColwiseParallel()"
    assert styles["blocks.0.mlp.out"] == "RowwiseParallel()"
    assert not styles.get("blocks.1.attn", "").startswith("GlobalShapes")

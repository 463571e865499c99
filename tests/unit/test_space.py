"""Search space: legality rules (divisibility, TP inside a node, batch arithmetic, pins)."""
from __future__ import annotations

import dataclasses

import pytest

from autopar.config import PlanPins, SolverConfig
from autopar.solver.space import ModelShape, distinct_mesh_orders, enumerate_candidates, _group_span

SHAPE = ModelShape(num_blocks=8, num_layers=11, heads=16, kv_heads=4, head_dim=64, tokens_per_sample=1024,
                   split_dims=(1024, 4096))


def candidates(world=16, per_node=8, batch=32, **pins):
    return list(enumerate_candidates(SHAPE, world, per_node, batch, SolverConfig(), PlanPins(**pins)))


def test_every_candidate_is_consistent():
    found = candidates()
    assert found
    for c in found:
        assert c.world_size == 16
        assert c.dp * c.micro_batch_size * c.num_micro_batches == 32
        # tp divides the key/value heads, or is a whole multiple of them (key/value groups)
        assert (SHAPE.kv_heads % c.tp == 0 or c.tp % SHAPE.kv_heads == 0) and SHAPE.heads % c.tp == 0
        assert c.pp <= SHAPE.num_blocks and c.pp * c.chunks <= SHAPE.num_blocks
        assert c.pp == 1 or c.num_micro_batches >= c.pp


def test_candidates_are_the_layouts_the_constructor_builds():
    """The enumeration builds candidates without the dataclass conversions: each must hold what
    ParallelLayout(...) would from the same values (enum members, tuples), pinned strings included."""
    from dataclasses import fields

    from autopar.domain.layout import ParallelLayout

    for found in (candidates(), candidates(schedule="gpipe", cp_strategy="ring", dp_sync="ring", zero_stage=1)):
        assert found
        for c in found:
            built = ParallelLayout(**{f.name: getattr(c, f.name) for f in fields(c)})
            assert vars(c) == vars(built) and hash(c) == hash(built)
            assert all(type(getattr(c, f.name)) is type(getattr(built, f.name)) for f in fields(c))
    with pytest.raises(TypeError, match="degree"):
        ParallelLayout.of_final_values(degree=2)


def test_tp_limited_by_heads_and_kept_inside_a_node():
    tps = {c.tp for c in candidates(world=64)}
    # 16 query heads, 4 key/value heads: tp=8 computes each key/value head on a group of 2
    # ranks (autopar.solver.tp_kv_groups); 16 would leave the node
    assert tps == {1, 2, 4, 8}
    for c in candidates(world=64):
        degrees = {"tp": c.tp, "cp": c.cp, "pp": c.pp, "dp": c.dp}
        assert _group_span(c.mesh_order, "tp", degrees, 8)[0] == 1


def test_pins_fix_decisions():
    found = candidates(tp=2, pp=2, zero_stage=1)
    assert found and {(c.tp, c.pp, c.zero_stage) for c in found} == {(2, 2, 1)}


def test_contradictory_pin_leaves_nothing():
    assert candidates(tp=3) == []


def test_equivalent_orders_are_collapsed():
    # Everything inside one node: every order uses the same links.
    assert len(distinct_mesh_orders({"tp": 2, "cp": 1, "pp": 2, "dp": 2}, 8)) == 1
    # TP 8 fills a node; PP 2 x DP 4 across nodes: which of PP or DP is "inner" changes nothing
    # about node counts per group here except the order of their strides.
    orders = distinct_mesh_orders({"tp": 8, "cp": 1, "pp": 2, "dp": 4}, 8)
    assert ("tp", "cp", "pp", "dp") in orders


def test_shape_from_profile_reads_heads_and_kv_heads(examples_dir):
    from autopar.model_file import load_model_file
    from autopar.profile import profile_model

    profile = profile_model(load_model_file(examples_dir / "llama_hf.py"),
                            {"layers": 2, "hidden": 128, "heads": 8, "kv_heads": 2, "ffn": 256}, 1, "fp32")
    shape = ModelShape.from_profile(profile)
    assert (shape.heads, shape.kv_heads, shape.head_dim, shape.num_blocks) == (8, 2, 16, 2)
    # tp=4: 2 query heads per rank, each group of 2 ranks computing one key/value head
    assert shape.tp_divides(2) and shape.tp_divides(4) and shape.kv_grouped(4) and not shape.kv_grouped(2)
    assert "8 attention heads are not divisible by tp=16" == shape.tp_problem(16)
    uneven = dataclasses.replace(shape, heads=12, kv_heads=3)
    assert not uneven.kv_grouped(4)
    assert uneven.tp_problem(4) == "3 key/value heads are not divisible by tp=4 (nor is tp=4 a multiple of them)"



def test_only_weights_a_matmul_reads_must_divide_by_tp(tmp_path):
    """A table the block indexes (Swin's relative position bias: 49 rows) is read whole on every
    rank; a linear with 49 outputs is what tp would split."""
    from autopar.model_file import load_model_file
    from autopar.profile import profile_model

    path = tmp_path / "tables.py"
    path.write_text(
        "import torch\n"
        "class Block(torch.nn.Module):\n"
        "    def __init__(self, out):\n"
        "        super().__init__()\n"
        "        self.proj = torch.nn.Linear(8, out)\n"
        "        self.back = torch.nn.Linear(out, 8)\n"
        "        self.table = torch.nn.Parameter(torch.zeros(49, 2))\n"
        "    def forward(self, x):\n"
        "        return x + self.back(self.proj(x)) + self.table[3, 0]\n"
        "class Model(torch.nn.Module):\n"
        "    def __init__(self, out):\n"
        "        super().__init__()\n"
        "        self.blocks = torch.nn.ModuleList(Block(out) for _ in range(2))\n"
        "    def forward(self, x):\n"
        "        for block in self.blocks:\n"
        "            x = block(x)\n"
        "        return x\n"
        "def build_model(out=16):\n    return Model(out)\n"
        "def example_batch(batch_size, out=16):\n    return torch.randn(batch_size, 8)\n")
    tables = ModelShape.from_profile(profile_model(load_model_file(path), {"out": 16}, 2))
    assert 49 not in tables.split_dims and tables.tp_problem(2) is None
    odd = ModelShape.from_profile(profile_model(load_model_file(path), {"out": 49}, 2))
    assert odd.tp_problem(2) == "weight dimension 49 is not divisible by tp=2"

def test_solver_bounds_shrink_the_space_to_exactly_the_bounded_part():
    """solver.max_tp/max_pp/max_cp, zero_stages and interleave_chunks remove candidates outside
    them and keep every other one."""
    everything = candidates()
    bounded = SolverConfig(max_tp=2, max_pp=2, max_cp=1, zero_stages=[0, 3], interleave_chunks=[2])
    found = list(enumerate_candidates(SHAPE, 16, 8, 32, bounded, PlanPins()))
    inside = [c for c in everything if c.tp <= 2 and c.pp <= 2 and c.cp == 1 and c.zero_stage in (0, 3)
              and c.chunks in (1, 2)]
    assert found == inside and len(found) < len(everything)

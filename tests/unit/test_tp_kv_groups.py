"""Grouped-query attention with more TP ranks than key/value heads (autopar.solver.tp_kv_groups):
the analysis finds the key/value projections from the traced shapes, the ILP computes them by
group (``kv_group``), the probe finds the attention's repeat count, and the price counts the
key/value work repeated within a group, the weights split by tp, and each micro-batch's gather
of the weights and reduce-scatter of their gradients."""
from __future__ import annotations

import pytest
import torch

from autopar.solver.tp_kv_groups import kv_groups
from autopar.solver.tp_legality import TPLegality
from cost_models.compute import compute_dtype, op_roofline_s
from cost_models.topology import ClusterConfig, ClusterSpec
from tests.profiles import tp_split, traced

HIDDEN, HEADS, KV_HEADS, FFN = 256, 4, 2, 688
HEAD_DIM = HIDDEN // HEADS


@pytest.fixture(scope="module")
def llama():
    return traced("llama_hf.py", "bf16", 1, layers=2, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, ffn=FFN,
                  vocab=1024, seq_len=128)


def _block(profile) -> str:
    return next(layer.name for layer in profile.layers if layer.is_block)


def test_key_value_projections_are_found_from_the_traced_shapes(llama):
    """Projections with kv_heads * head_dim outputs whose GEMM computes the attention's keys or
    values (walked up the traced graph from the SDPA op)."""
    from autopar.solver.tp_kv_groups import _key_value_producers

    # The walk stops at the first GEMM: not q_proj (the query), nor anything before the norms
    assert _key_value_producers(llama) == {f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "kv"}
    assert kv_groups(llama, 2) is None  # 2 key/value heads split over 2 ranks as usual
    assert kv_groups(llama, 8) is None  # 4 query heads do not divide over 8 ranks
    groups = kv_groups(llama, 4)
    assert (groups.heads, groups.kv_heads, groups.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)
    assert sorted(groups.modules) == [f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "kv"]
    assert {groups.rows_per_rank(m) for m in groups.modules} == {HEAD_DIM}  # one head per rank


def test_tp4_splits_attention_with_key_value_heads_by_group(llama):
    block = _block(llama)
    split = tp_split(llama, block, 4)
    styles = {module.rsplit(".", 1)[-1]: style for module, style in split.styles.items()}
    assert styles == {"q_proj": "colwise", "k_proj": "kv_group", "v_proj": "kv_group", "o_proj": "rowwise",
                      "gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}
    # Megatron's four all-reduces per micro-batch (two forward, two of the inputs' gradients),
    # and per micro-batch each key/value weight gathered in forward, its gradient reduce-scattered.
    comm, forward = split.collectives(sequence_parallel=False)
    kv_bytes = 4.0 * KV_HEADS * HEAD_DIM * HIDDEN
    assert sorted(kind for kind, _ in comm[:forward]) == ["all_gather"] * 2 + ["all_reduce"] * 2
    assert sorted(kind for kind, _ in comm[forward:]) == ["all_reduce"] * 2 + ["reduce_scatter"] * 2
    assert sorted(nbytes for kind, nbytes in comm if kind in ("all_gather", "reduce_scatter")) == [kv_bytes] * 4
    # A fully recomputed block gathers the key/value weights again (they precede attention).
    assert sorted(kind for kind, _ in split.rerun_comm if kind == "all_gather") == ["all_gather"] * 2


def test_key_value_weights_are_split_by_tp_in_the_price(llama):
    """The key/value weights are held split by rows (each rank 1/tp, gathered per forward), so
    only the two RMSNorms stay whole."""
    block = _block(llama)
    split = tp_split(llama, block, 4)
    params = llama.layer(block).param_count
    whole = 2 * HIDDEN  # two RMSNorms
    assert params == 2 * HIDDEN * HIDDEN + 2 * KV_HEADS * HEAD_DIM * HIDDEN + 3 * HIDDEN * FFN + 2 * HIDDEN
    assert split.tp_sharded_param_fraction == pytest.approx((params - whole) / params)


def test_key_value_work_divides_by_the_key_value_heads_not_by_tp(llama):
    """At tp=2 every split op divides by 2, k and v included; at tp=4 the same ops divide by 4
    except k's and v's GEMMs, which each of the 2 ranks of a group computes whole for its head:
    still halved."""
    block = _block(llama)
    one, two, four = (tp_split(llama, block, t) for t in (1, 2, 4))
    gpu = ClusterSpec.from_config(ClusterConfig(name="t", gpu="A100-80GB", nodes=1, gpus_per_node=4)).node_gpus[0]
    kv_s = sum(op_roofline_s(op, gpu, compute_dtype(llama.precision)) for op in llama.ops
               if op.layer == block and op.phase == "forward" and op.op_class == "gemm"
               and (op.module or "").endswith(("k_proj", "v_proj")))
    assert kv_s > 0
    whole = two.replicated_forward_s  # norms, residual adds, rotary tables: replicated at either degree
    assert four.replicated_forward_s == pytest.approx(whole + kv_s / 2)
    assert four.compute.forward_s == pytest.approx(whole + kv_s / 2 + (one.compute.forward_s - whole - kv_s) / 4)


def test_probe_finds_the_repeat_count_by_value(llama):
    """Hugging Face repeats each key/value head num_key_value_groups (= 4 / 2) times; with one
    head per rank beside one query head that count must be 1. The probe finds the attribute by
    its value and keeps the region legal with it set."""
    block = _block(llama)
    styles = {f"{block}.self_attn.{p}": s for p, s in (("q_proj", "colwise"), ("k_proj", "kv_group"),
                                                       ("v_proj", "kv_group"), ("o_proj", "rowwise"))}
    legality = TPLegality(llama)
    assert legality.probe(block, 4, styles) == {}
    assert legality.region_attributes(block, 4, styles) == {f"{block}.self_attn": {"num_key_value_groups": 1}}
    assert legality.dtensor_regions(block, 4, styles) == set()


def test_codegen_runs_key_value_groups_only_inside_a_local_region():
    from autopar.codegen.errors import CodegenError
    from autopar.codegen.tp_plan import _kv_group_style

    spec = _kv_group_style("model.layers.0.self_attn.k_proj", in_region=True, dtensor_region=False, kv_heads=2)
    assert spec.source() == "KVGroupColwise(groups=2)"
    for in_region, dtensor_region in ((False, False), (True, True)):
        with pytest.raises(CodegenError, match="by key/value group"):
            _kv_group_style("model.layers.0.self_attn.k_proj", in_region, dtensor_region, 2)


def test_a_plan_computing_key_value_groups_names_how_many():
    from autopar.plans import Plan

    plan = Plan(tp=4, layer_names=["a"], stages=[["a"]], tp_styles={"a.k_proj": "kv_group"})
    assert any("tp_kv_heads" in problem for problem in plan.problems())
    assert not any("tp_kv_heads" in problem for problem in plan.with_updates(tp_kv_heads=2).problems())
    assert any("tp_kv_heads" in problem for problem in plan.with_updates(tp_kv_heads=3).problems())


class _HeadViews(torch.nn.Module):
    """Attention viewing by the head counts it holds: queries by ``num_heads``, keys by
    ``num_key_value_heads``, keys repeated ``num_key_value_groups`` times (StableLM's way), or,
    with ``views_by_heads`` False, by -1 as Hugging Face's Llama does (only the repeat count read)."""

    def __init__(self, views_by_heads: bool) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.num_key_value_groups = HEADS, KV_HEADS, HEADS // KV_HEADS
        self.head_dim, self.layer_idx, self.views_by_heads = HEAD_DIM, KV_HEADS, views_by_heads

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        b, s, _ = q.shape
        q = q.view(b, s, self.num_heads if self.views_by_heads else -1, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.num_key_value_heads if self.views_by_heads else -1, self.head_dim).transpose(1, 2)
        k = k.repeat_interleave(self.num_key_value_groups, dim=1)
        if q.shape != k.shape:  # as SDPA without enable_gqa: one key head per query head
            raise RuntimeError(f"query heads {q.shape[1]} and key heads {k.shape[1]} differ")
        return (q * k).sum()


@pytest.mark.parametrize("views_by_heads, expected", [
    (False, {"num_key_value_groups": 1}),
    (True, {"num_heads": 1, "num_key_value_heads": 1, "num_key_value_groups": 1}),
])
def test_probe_sets_every_head_count_the_region_views_by(views_by_heads, expected):
    """At tp=4 over 4 query and 2 key/value heads a rank holds one of each. The probe sets the
    fewest attributes that make the region run on that share, found by value (``layer_idx``,
    equal to a head count here by chance, is tried and left alone since changing it fixes nothing)."""
    from autopar.solver.tp_kv_groups import KVGroups
    from autopar.solver.tp_probe import group_count_attribute

    region = _HeadViews(views_by_heads)
    q, k = torch.zeros(1, 3, HEAD_DIM), torch.zeros(1, 3, HEAD_DIM)  # one head each

    def error():
        try:
            region(q, k)
        except RuntimeError as failure:
            return str(failure)
        return None

    assert error() is not None
    groups = KVGroups(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, tp=4, modules={})
    assert group_count_attribute(region, groups, 4, error) == expected
    assert (region.num_heads, region.num_key_value_heads, region.num_key_value_groups) == (HEADS, KV_HEADS, 2)


def test_each_key_value_parameter_is_gathered_and_reduced_on_its_own():
    """KVGroupColwise gathers the weight and the bias (Qwen2's k_proj has one) one collective
    each, so the price lists one per parameter, in name order, at fp32."""
    from types import SimpleNamespace

    from autopar.solver.tp_kv_groups import parameter_bytes

    profile = SimpleNamespace(param_shapes={"a.k_proj.weight": [16, 64], "a.k_proj.bias": [16],
                                            "a.q_proj.weight": [64, 64]})
    assert parameter_bytes(profile, "a.k_proj") == (4.0 * 16, 4.0 * 16 * 64)


def test_key_value_groups_left_unpaired_are_kept_by_pairing_the_region_when_that_is_cheaper():
    """Granite multiplies o_proj's output by a residual multiplier in the block, and at the zoo's
    widths the ILP's first split once gathered o_proj's column shards after that multiply, leaving
    the attention unpaired and its key/value groups unread (the splitter then also solved with
    o_proj offered no column split). A split module's shards now stay in its region, so the first
    split already pairs (o_proj row-parallel) and keeps k and v by group; that split is priced
    below the one that replicates them, and is the one chosen."""
    from autopar.solver.intra_op import IntraOpSolver
    from autopar.solver.tp_split import _GroupCosts
    from cost_models.compute import compute_dtype
    from tests.profiles import planner_splitter

    granite = traced("../tests/zoo/models/hf_zoo.py", "fp32", 1, arch="granite", layers=2, seq_len=16)
    block = _block(granite)
    spec = ClusterSpec.from_config(ClusterConfig(name="t", gpu="A100-80GB", nodes=1, gpus_per_node=4))
    costs = _GroupCosts(spec.node_gpus[0], compute_dtype(granite.precision), spec.group_links(list(range(4))))
    splitter = planner_splitter(granite)
    attention = f"{block}.self_attn"
    first = IntraOpSolver(granite, costs, 4, index=splitter.index, kv_group_modules=splitter.kv_group_modules(block, 4),
                          head_norms=splitter.head_norms).solve(block)
    assert first.module_style[f"{attention}.o_proj"].value == "rowwise"  # paired at once
    styles = {m.rsplit(".", 1)[-1]: s for m, s in tp_split(granite, block, 4).styles.items() if m.startswith(attention)}
    assert styles == {"q_proj": "colwise", "k_proj": "kv_group", "v_proj": "kv_group", "o_proj": "rowwise"}
    whole = IntraOpSolver(granite, costs, 4, index=splitter.index, head_norms=splitter.head_norms,
                          replicated_modules=frozenset({f"{attention}.k_proj", f"{attention}.v_proj"})).solve(block)
    paired = IntraOpSolver(granite, costs, 4, index=splitter.index,
                           kv_group_modules=splitter.kv_group_modules(block, 4),
                           not_colwise=frozenset({f"{attention}.o_proj"})).solve(block)
    assert paired.time_s < whole.time_s


@pytest.fixture(scope="module")
def phi3():
    """Hugging Face's Phi-3 at the zoo's size: one fused qkv_proj of parts [32, 16, 16] (4 query
    heads and 2 key/value heads of 8 features), cut by the attention's code with slices."""
    return traced("../tests/zoo/models/hf_zoo.py", "fp32", 1, arch="phi3", layers=2, seq_len=16)


def test_key_heads_are_read_before_the_attention_repeats_them(phi3):
    """Phi-3 repeats its 2 key/value heads to the 4 query heads before SDPA, and no projection
    shows their width (q, k and v are one fused linear): the heads come from the key tensor
    before the repeat."""
    from autopar.solver.space import ModelShape

    shape = ModelShape.from_profile(phi3)
    assert (shape.heads, shape.kv_heads, shape.head_dim) == (4, 2, 8)
    assert shape.kv_grouped(4) and not shape.kv_grouped(2)


def test_a_fused_projection_computes_its_key_value_parts_by_group(phi3):
    """At tp=4 each rank computes 1/4 of the query part (one head) and its group's head of k and
    of v: 24 of the 64 rows (2.67 times less work than one GPU), gathering the key/value parts'
    rows (half the weight) each forward."""
    from tests.profiles import planner_splitter

    block = _block(phi3)
    qkv = f"{block}.self_attn.qkv_proj"
    groups = planner_splitter(phi3).groups_of(block, 4)
    assert groups.fused == {qkv: [32, 16, 16]}
    assert groups.grouped(qkv) == [False, True, True] and groups.local_parts(qkv) == [8, 8, 8]
    assert groups.work_divisor(qkv) == pytest.approx(64 / 24) and groups.gathered_share(qkv) == 0.5
    assert planner_splitter(phi3).kv_group_modules(block, 4)[qkv] == (pytest.approx(64 / 24), (4.0 * 64 * 32 / 2,))
    styles = {m.rsplit(".", 1)[-1]: s for m, s in tp_split(phi3, block, 4).styles.items()}
    assert styles == {"qkv_proj": "kv_group", "o_proj": "rowwise", "gate_up_proj": "colwise", "down_proj": "rowwise"}
    assert planner_splitter(phi3).grouped_parts[(block, 4)] == {qkv: [1, 2]}
    # the attention repeats its key/value head by num_key_value_groups: set to the query heads per rank
    assert planner_splitter(phi3).region_attributes[(block, 4)] == {f"{block}.self_attn": {"num_key_value_groups": 1}}


def test_codegen_computes_a_fused_projections_key_value_parts_by_group():
    from autopar.codegen.errors import CodegenError
    from autopar.codegen.tp_plan import _kv_group_style

    qkv = "model.layers.0.self_attn.qkv_proj"
    spec = _kv_group_style(qkv, True, False, 2, [32, 16, 16], [1, 2])
    assert spec.source() == "FusedKVGroupColwise(parts=[32, 16, 16], groups=2, grouped=[False, True, True])"
    for grouped, transposed in ((None, False), ([1, 2], True)):
        with pytest.raises(CodegenError, match="fused projection"):
            _kv_group_style(qkv, True, False, 2, [32, 16, 16], grouped, transposed)


def test_a_fused_outputs_parts_are_read_at_their_local_sizes():
    """The region cuts the fused output by global sizes; a rank holding [8 query, 8 key, 8 value]
    features of parts [32, 16, 16] gets each part's own 8."""
    from autopar.sections.fused import FusedCuts, tag_fused_output

    output = tag_fused_output(torch.arange(24.0).reshape(1, 24), [32, 16, 16], [8, 8, 8])
    with FusedCuts():
        query, key, value = output[..., :32], output[..., 32:48], output[..., 48:]
    assert [piece.tolist()[0] for piece in (query, key, value)] == [list(map(float, range(a, a + 8)))
                                                                   for a in (0, 8, 16)]

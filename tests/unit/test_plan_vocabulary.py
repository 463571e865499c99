"""One plan vocabulary: the mesh arithmetic, the technique registry and the tensor-parallel
layout that the pricer and codegen share, each checked against what actually runs."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from autopar.codegen.model_facts import inspect_model
from autopar.codegen.tp_plan import paired_regions
from autopar.plans import Plan
from autopar.report.words import describe_axes
from autopar.solver.tp_split import ILPSplitter
from cost_models.collectives import Collective, collective_time_s
from autopar.domain.layout import ParallelLayout
from autopar.domain.vocabulary import DPSync
from autopar.domain.mesh import Mesh
from cost_models.step import PlanPricer, TrainSpec
from autopar.domain.techniques import REGISTRY, Family, chosen, searchable
from cost_models.topology import ClusterConfig, ClusterSpec
from cost_models.tp_layout import ModuleTree, SPRole, sp_role
from tests.dist.plans import GPT, LLAMA, _profile
from tests.profiles import traced

REPO = Path(__file__).resolve().parents[2]


# -- mesh ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("order", [("tp", "cp", "pp", "dp"), ("dp", "tp", "pp", "cp"), ("pp", "dp", "cp", "tp")])
def test_mesh_coordinates_are_the_device_mesh_grid(order):
    """Rank r sits at r's index in arange(world).reshape(shape outermost first), as DeviceMesh
    places it; a group along axes is the ranks differing only there."""
    degrees = {"tp": 2, "cp": 1, "pp": 3, "dp": 2}
    mesh = Mesh.from_degrees(order, degrees)
    grid = torch.arange(mesh.world_size).reshape(mesh.shape())
    names = mesh.dim_names()
    for index in torch.cartesian_prod(*[torch.arange(n) for n in mesh.shape()]).tolist():
        rank = int(grid[tuple(index)])
        assert mesh.coordinates(rank) == {axis: index[names.index(axis)] for axis in order}
    for rank in range(mesh.world_size):
        same = [r for r in range(mesh.world_size)
                if all(mesh.coordinate(r, a) == mesh.coordinate(rank, a) for a in order if a not in ("dp", "tp"))]
        assert mesh.group_ranks(("dp", "tp"), rank) == same


def _node_spread(group: list[int], gpus_per_node: int) -> tuple[int, int]:
    """(nodes a group touches, fewest of its ranks on one of them)."""
    counts: dict[int, int] = {}
    for rank in group:
        counts[rank // gpus_per_node] = counts.get(rank // gpus_per_node, 0) + 1
    return len(counts), min(counts.values())


@pytest.mark.parametrize("seed", range(4))
def test_the_slowest_group_of_every_axis_is_found_among_the_bases(seed):
    """Against every group of random meshes (degrees 1-8, 2- to 8-GPU nodes): the groups through
    `group_bases` include one spreading over the most nodes with the fewest ranks on one, `span`
    counts that group's nodes, and where `tiles_nodes` holds all groups sit alike. With tp=3 on
    8-GPU nodes the group through rank 0 stays in a node while {6, 7, 8} crosses one boundary:
    tensor parallelism priced on NVLink ran partly over the network."""
    import random

    rng = random.Random(seed)
    checked = 0
    while checked < 150:
        gpus_per_node = rng.choice([2, 4, 6, 8])
        mesh = Mesh(("tp", "cp", "pp", "dp"), tuple(rng.choice([1, 2, 3, 4, 6, 8]) for _ in range(4)))
        if mesh.world_size > 600:
            continue
        checked += 1
        for axes in (("tp",), ("cp",), ("pp",), ("dp",), ("dp", "cp")):
            spreads = {_node_spread(group, gpus_per_node) for group in mesh.groups(axes)}
            worst = max(spreads, key=lambda spread: (spread[0], -spread[1]))
            found = {_node_spread(mesh.group_ranks(axes, base), gpus_per_node)
                     for base in mesh.group_bases(axes, gpus_per_node)}
            assert max(found, key=lambda spread: (spread[0], -spread[1])) == worst
            if len(axes) == 1:
                assert mesh.span(axes[0], gpus_per_node)[0] == worst[0]
            if mesh.tiles_nodes(gpus_per_node):
                assert len(spreads) == 1
    three = Mesh(("tp", "dp"), (3, 8))
    assert _node_spread(three.group_ranks("tp"), 8) == (1, 3) and three.span("tp", 8) == (2, 1)


def test_mesh_arithmetic_lives_in_one_module():
    """No stride or coordinate arithmetic outside autopar/domain/mesh.py: a rank's coordinate,
    a stride built by multiplying degrees, or a rank stepped by a stride."""
    pattern = re.compile(r"//\s*strides?\b|\bstrides?\s*\*=|//\s*stride\[|\*\s*strides?\[|mesh_strides\(")
    offenders = []
    for folder in ("autopar", "cost_models"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.name == "mesh.py" and path.parent.name == "domain":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


# -- the technique registry ---------------------------------------------------------------------

def test_every_searchable_technique_names_code_that_exists():
    """A technique can be chosen only if the generated code runs it: the runtime each entry
    names is a function or class of a codegen section."""
    sections = {path.stem: path.read_text() for path in (REPO / "autopar" / "sections").glob("*.py")}
    for entry in REGISTRY:
        if entry.runtime is None or not entry.pinnable or entry.value == DPSync.AUTO:
            continue
        match = re.match(r"(\w+)\.(\w+)", entry.runtime)
        assert match, entry
        section, name = match.groups()
        assert re.search(rf"^(def|class) {name}\b", sections[section], re.M), entry


def test_a_technique_without_runtime_cannot_be_chosen(monkeypatch):
    """A value priced but not generated is neither searched nor accepted as a pin or in a plan
    file (halving-doubling was such a value until gradient_sync.py ran it): with its runtime
    taken away, it disappears from the search and is refused with the choices that run."""
    import dataclasses

    import autopar.domain.techniques as techniques

    assert "halving_doubling" in searchable(Family.DP_SYNC)
    assert chosen(Family.DP_SYNC, "halving_doubling").runtime == "gradient_sync.HalvingDoublingSync"
    monkeypatch.setattr(techniques, "REGISTRY", tuple(
        dataclasses.replace(entry, runtime=None) if entry.value == "halving_doubling" else entry
        for entry in techniques.REGISTRY))
    assert "halving_doubling" not in searchable(Family.DP_SYNC)
    with pytest.raises(ValueError, match="no generated implementation"):
        chosen(Family.DP_SYNC, "halving_doubling")
    plan = Plan(layer_names=["a"], stages=[["a"]], dp_sync="halving_doubling")
    assert any("no generated implementation" in p for p in plan.problems())
    assert not Plan(layer_names=["a"], stages=[["a"]], dp_sync="reduce_scatter").problems()


def test_layout_is_frozen_and_keys_caches():
    """Strings, lists and dicts become enum members, tuples and a hashable mapping: two
    layouts built from equal choices are equal and hash alike."""
    a = ParallelLayout(dp=2, schedule="1f1b", stages=[["x"], ["y"]], recompute={"x": "full"})
    b = ParallelLayout(dp=2, schedule="1f1b", stages=(("x",), ("y",)), recompute={"x": "full"})
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert a.projected("dp") == ParallelLayout(dp=2)


# -- the tensor-parallel layout -----------------------------------------------------------------

@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt", "llama"])
def test_pricer_and_codegen_read_the_same_roles(model):
    """The pricer reads the module tree from the profile, codegen from the model: for every
    block child and any choice of split, both give the same sequence-parallel role."""
    tree = ModuleTree.of_profile(_profile(model))
    facts = inspect_model(model.path, model.kwargs)
    block = model.block_names[0]
    linears = [m for m in facts.modules if m.startswith(block + ".") and facts.kind(m) == "linear"]
    for styles in ({}, {m: ("colwise" if i % 2 == 0 else "rowwise") for i, m in enumerate(linears)}):
        regions = paired_regions(styles, facts)
        from_model = {child: sp_role(facts.kind(child), facts.modules[child].has_parameters, child in regions)
                      for child in facts.children[block]}
        assert tree.roles(block, styles) == {c: r for c, r in from_model.items() if c in tree.roles(block, styles)}
        assert {c for c, r in from_model.items() if r != SPRole.LOCAL} <= set(tree.roles(block, styles))


def _replicating_pricer(tp_runtime: str = "plain"):
    """A tiny GPT on 2 H100s whose link latency (1 s) makes the operator-wise split replicate
    every module; the GPU's work alone unless ``tp_runtime`` is dtensor (cost_models.host)."""
    profile = traced("gpt.py", "bf16", 2)
    cluster = ClusterSpec.from_config(ClusterConfig(name="t", gpu="H100-SXM", nodes=1, gpus_per_node=2,
                                                    intra_node_latency_us=1e6))
    train = TrainSpec(global_batch_size=4, tp_runtime=tp_runtime)
    return profile, cluster, PlanPricer(profile, cluster, train, ILPSplitter(profile))


def test_replicated_tp_plan_under_sp_is_priced_as_it_runs():
    """The issue's bug: with every module replicated, sequence parallelism leaves the GEMMs whole
    (only norms and residual adds run on a slice), and each block's attention and MLP gather
    the sequence in forward and backward, the first block's entry gathers in backward and the
    replicated head in forward: 4 x 4 + 2 all-gathers of b·s·h per micro-batch. Before, the
    pricer divided all of it by t and priced no collective (compute 0.5-0.65 of this)."""
    profile, cluster, pricer = _replicating_pricer()
    plain = pricer.estimate(ParallelLayout(tp=2, micro_batch_size=2, num_micro_batches=2))
    sp = pricer.estimate(ParallelLayout(tp=2, micro_batch_size=2, num_micro_batches=2, sequence_parallel=True))
    assert set(pricer.split("blocks.0", ParallelLayout(tp=2), cluster.node_gpus[0]).styles.values()) == {"replicate"}
    assert plain.time_breakdown["tp_comm"] == 0.0
    assert 0.95 * plain.time_breakdown["compute"] < sp.time_breakdown["compute"] < plain.time_breakdown["compute"]
    stream = profile.layer("blocks.0").input_bytes
    gather = collective_time_s(Collective.ALL_GATHER, stream, cluster.group_links([0, 1]))
    assert sp.time_breakdown["tp_comm"] == pytest.approx(2 * (4 * 4 + 2) * gather, rel=1e-6)
    assert pricer.issued.tp_collectives(ParallelLayout(tp=2, micro_batch_size=2, num_micro_batches=2,
                                                sequence_parallel=True)) == {"all_gather": 2 * 18}


def test_sequence_parallel_norms_are_dispatched_on_the_host():
    """Run by autopar's module, the same replicated plan splits nothing, so no host floor without
    sequence parallelism; with it each norm runs as a SequenceParallel DTensor module, whose
    dispatch (cost_models.host) bounds the tiny GPT's compute from below: 2 norms a block, the
    final norm, per micro-batch."""
    from cost_models.host import host_s

    profile, cluster, pricer = _replicating_pricer("dtensor")
    layout = dict(tp=2, micro_batch_size=2, num_micro_batches=2)
    gpu_only = _replicating_pricer()[2]
    assert pricer.estimate(ParallelLayout(**layout)).time_breakdown["compute"] == pytest.approx(
        gpu_only.estimate(ParallelLayout(**layout)).time_breakdown["compute"])
    blocks = sum(1 for layer in profile.layers if layer.name.startswith("blocks."))
    floor = 2 * host_s(2 * blocks + 1)
    with_sp = ParallelLayout(**layout, sequence_parallel=True)
    sp = pricer.estimate(with_sp).time_breakdown["compute"]
    assert floor <= sp <= floor + gpu_only.estimate(with_sp).time_breakdown["compute"]


def test_report_says_what_tp_costs_the_host():
    """A split plan's words give its DTensor modules' host dispatch (cost_models.host: 12 modules
    at 1.92 ms is 23 ms a micro-batch); replicated modules dispatch nothing and are not counted."""
    from autopar.report.words import host_dispatch_words
    from cost_models.host import DTENSOR_MODULE_HOST_S

    styles = {f"blocks.{i}.{name}": style for i in range(3)
              for name, style in (("q", "colwise"), ("k", "colwise"), ("v", "colwise"), ("o", "rowwise"))}
    words = host_dispatch_words(Plan(tp=2, tp_styles={**styles, "wte": "replicate"}))
    assert "12 split modules" in words and f"{12 * DTENSOR_MODULE_HOST_S * 1e3:,.0f} ms" in words
    assert host_dispatch_words(Plan(tp=2, tp_styles={"wte": "replicate"})) == ""


def test_report_does_not_claim_split_matrices_for_a_replicated_plan():
    base = dict(tp=2, layer_names=["a"], stages=[["a"]], mesh_order=["tp", "cp", "pp", "dp"])
    replicated = describe_axes(Plan(**base, tp_styles={"a.fc": "replicate"}, sequence_parallel=True), 8)[0]
    split = describe_axes(Plan(**base, tp_styles={"a.fc": "colwise"}), 8)[0]
    assert "matrices split" not in replicated and "no matrix split" in replicated
    assert "each layer's matrices split" in split


# -- TP collectives as the styles issue them ------------------------------------------------------

def _op(name: str, module: str | None, inputs: tuple[str, ...] = (), op_class: str = "gemm", phase: str = "forward"):
    from types import SimpleNamespace
    return SimpleNamespace(name=name, module=module, inputs=list(inputs), op_class=op_class, phase=phase)


def test_issued_collectives_of_a_block_match_a_hand_count():
    """A GPT-like block by hand: ln_1 feeds q, k, v (column-parallel, inside the attention
    region) and a lone column-parallel probe outside any region; out_proj is row-parallel.
    Without SP: out_proj's all-reduce (forward), one all-reduce of ln_1's gradient for the three
    region matmuls and one for the probe (backward). With SP: out_proj reduce-scatters (forward)
    and all-gathers its gradient (backward); the region's input is all-gathered (forward) and its
    gradient reduce-scattered (backward); the probe still all-reduces its own.

    Full recomputation re-runs the forward up to the last tensor the backward reads (out's
    backward reads attention's output): the region's gather again, not out's reduction."""
    from autopar.solver.tp_split import issued_collectives

    ops = [_op("ln", "b.ln_1", op_class="norm"), _op("ln_view", "b.ln_1", ("ln",), "view"),
           _op("q", "b.attn.q", ("ln_view",)), _op("k", "b.attn.k", ("ln",)), _op("v", "b.attn.v", ("ln",)),
           _op("probe", "b.probe", ("ln",)), _op("attn", "b.attn", ("q", "k", "v"), "attention"),
           _op("out", "b.attn.out", ("attn",)), _op("out_grad", "b.attn.out", ("attn",), phase="backward")]
    strategy = {"q": "colwise", "k": "colwise", "v": "colwise", "probe": "colwise", "out": "rowwise"}
    events = [("P->R", "out", 100.0), ("backward all-reduce", "ln", 100.0)]
    issued = issued_collectives(events, {op.name: op for op in ops}, strategy, [], {"b.attn"})
    assert issued.without_sp == (("all_reduce", 100.0), ("all_reduce", 100.0), ("all_reduce", 100.0))
    assert issued.forward_without_sp == 1
    assert sorted(issued.under_sp[:issued.forward_under_sp]) == [("all_gather", 100.0), ("reduce_scatter", 100.0)]
    assert sorted(issued.under_sp[issued.forward_under_sp:]) == [("all_gather", 100.0), ("all_reduce", 100.0),
                                                                 ("reduce_scatter", 100.0)]
    assert issued.rerun_without_sp == ()
    assert issued.rerun_under_sp == (("all_gather", 100.0),)


def test_loss_parallel_and_a_tied_embedding_are_priced_as_issued():
    """GPT's head column-parallel with loss parallelism: its three all-reduces (max, sum of
    exponentials, target logit) are listed in forward, and the token embedding it is tied to
    runs vocabulary-parallel, one forward all-reduce of its output (both were issued and not
    priced)."""
    profile = _profile(GPT)
    cluster = ClusterSpec.from_config(ClusterConfig(name="tiny_cpu", gpu="cpu", nodes=1, gpus_per_node=2,
                                                    intra_node_latency_us=3.0, intra_node_bandwidth_GBps=1.5))
    pricer = PlanPricer(profile, cluster, TrainSpec(global_batch_size=8, precision="fp32"), ILPSplitter(profile))
    layout = ParallelLayout(dp=1, tp=2, pp=1, micro_batch_size=4, num_micro_batches=2)
    gpu = pricer.ranks.reference_gpu(layout)
    head, embedding = pricer.split("lm_head", layout, gpu), pricer.split("wte", layout, gpu)
    assert head.styles.get("lm_head") == "colwise"
    comm, forward = head.collectives(False)
    assert [c for c, _ in comm[:forward]] == ["all_reduce"] * 3
    assert embedding.collectives(False) == ((("all_reduce", embedding.comm[0][1]),), 1)


# -- one plan: the layout's decisions, pinned, saved and generated ------------------------------

# Settings of how to plan, not decisions of the plan (which stacks to split along, how to trace,
# whether to reuse a profile, which engine's rules to search under).
HOW_TO_PLAN = {"blocks", "trace_every_block", "reuse_profile", "engine"}
# Decisions no pin fixes: the mesh order is the solver's (by link speed), the number of
# micro-batches follows from the batch, and tokens reach experts one way (all_to_all).
NOT_PINNED = {"mesh_order", "num_micro_batches", "ep_dispatch"}


def test_pins_are_a_partial_plan():
    """Every plan.* pin is a field of the layout (layer_recompute: recompute per layer) or a
    setting of how to plan, and every decision but the listed three can be pinned."""
    from dataclasses import fields

    from autopar.config import PlanPins
    from autopar.plans import LAYOUT_FIELDS

    pins = {f.name for f in fields(PlanPins)}
    assert pins - HOW_TO_PLAN - {"layer_recompute"} == set(LAYOUT_FIELDS) - NOT_PINNED
    assert set(LAYOUT_FIELDS) <= {f.name for f in fields(Plan)}


def test_a_plan_is_its_layout_and_more():
    """The plan's decisions are the layout's fields, converted the same way (members, tuples), so
    the pricer reads a plan's layout with no field copied by hand."""
    plan = Plan(dp=2, micro_batch_size=2, num_micro_batches=2, global_batch_size=8, layer_names=["a", "b"],
                stages=[["a", "b"]], recompute={"a": "full"}, schedule="1f1b", zero_stage=2, dp_sync="reduce_scatter")
    layout = plan.layout()
    assert isinstance(plan, ParallelLayout) and type(layout) is ParallelLayout
    assert layout == ParallelLayout(dp=2, micro_batch_size=2, num_micro_batches=2, stages=(("a", "b"),),
                                    recompute={"a": "full"}, zero_stage=2, dp_sync="auto")
    rebuilt = Plan.of(layout, recompute={"a": "full"}, dp_sync="reduce_scatter", global_batch_size=8,
                      layer_names=["a", "b"])
    assert rebuilt == plan == Plan.from_json(plan.to_json())
    assert Plan(layer_names=["a"], stages=[["a"]]).layout().recompute == "none"


def test_the_generated_mesh_names_the_plan_axes():
    """The generated module imports nothing of autopar, so its mesh axes are its own enum: the
    plan's axes, with data parallelism in two (replicas of a shard group, the group)."""
    from autopar.domain.vocabulary import AXES
    from autopar.sections.mesh import MeshAxis as GeneratedAxis

    generated = {axis.value for axis in GeneratedAxis}
    assert generated == (set(AXES) - {"dp"}) | {"dp_replicate", "dp_shard"}


def test_every_technique_names_code_that_exists():
    """A registry entry names the cost-model function that prices it and the generated code that
    runs it: both resolve (a rename that leaves an entry naming nothing fails here)."""
    import importlib

    def resolve(package: str, dotted: str) -> object:
        module, *attributes = dotted.split(".")
        found: object = importlib.import_module(f"{package}.{module}")
        for attribute in attributes:
            found = getattr(found, attribute)
        return found

    for entry in REGISTRY:
        assert callable(resolve("cost_models", entry.pricing)), entry
        named = (entry.runtime or "").split(" ")[0]
        if "." in named:  # "nothing (one gradient replica)" names no code
            assert resolve("autopar.sections", named) is not None, entry

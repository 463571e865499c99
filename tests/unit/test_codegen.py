"""Code generation without ranks: what the generated module contains and how plans map to it."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel)

from autopar.runtime.generated import command_line, import_generated
from autopar.codegen import CodegenError, generate
from autopar.codegen.generate import derive_layout
from autopar.codegen.model_facts import inspect_model
from autopar.codegen.tp_plan import build_tp_plan
from autopar.plans import Plan, Predicted, SolverInfo
from tests.dist.plans import GPT, LLAMA, boundary_stages, make_plan

STDLIB = set(sys.stdlib_module_names)


def _load(path: Path):
    """Import a generated module (its top level only defines things; main() is guarded)."""
    return import_generated(path, f"generated_{path.parent.name}_{path.stem}")


@pytest.fixture(scope="module")
def gpt_3d(tmp_path_factory):
    """GPT with every technique at once: ZeRO-3 x TP+SP x interleaved PP, recompute, a prediction."""
    plan = make_plan(GPT, dp=2, tp=2, pp=2, zero=3, sp=True, schedule="interleaved_1f1b", chunks=2,
                     recompute={"blocks.1": "selective", "blocks.2": "full"}, stages=boundary_stages(GPT)).with_updates(
        predicted=Predicted(step_time_s=0.0456, tokens_per_s=98765.0, mfu=0.377, peak_memory_bytes=5 * 2**30,
                            time_breakdown={"compute": 0.04, "bubble": 0.0056}),
        solver=SolverInfo(status="OPTIMAL", candidates=321, seconds=1.5))
    out = tmp_path_factory.mktemp("gpt_3d")
    return plan, generate(plan, GPT.path, out, gpus_per_node=4)


def test_generated_module_imports_only_torch_the_stdlib_and_nothing_of_autopar(gpt_3d):
    _, files = gpt_3d
    tree = ast.parse(files.script.read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    assert roots - STDLIB == {"torch"}
    assert "autopar" not in files.script.read_text().split('"""', 2)[2]  # nothing below the header docstring


def test_header_summarises_plan_and_prediction(gpt_3d):
    plan, files = gpt_3d
    header = ast.get_docstring(ast.parse(files.script.read_text()))
    assert "8 = dp 2 x tp 2 x pp 2 x cp 1" in header
    assert "ZeRO-3" in header and "sequence parallel" in header and "loss parallel" in header
    assert "4 stages" in header and "interleaved_1f1b with 2 chunks per rank" in header
    assert "45.6 ms" in header and "98,765 tokens/s" in header and "MFU 37.7%" in header and "5.0 GiB" in header
    assert "OPTIMAL, 321 candidates" in header
    assert "torchrun --nproc-per-node 8" in header


def test_plan_holds_what_the_runtime_reads_and_nothing_else(gpt_3d):
    plan, files = gpt_3d
    module = _load(files.script)
    source = files.script.read_text()
    written = json.loads(plan.to_json())
    for key, value in module.PLAN.items():
        assert f'plan["{key}"]' in source, f"PLAN[{key!r}] is never read"
        expected = {k: v for k, v in written[key].items() if v != "none"} if key == "recompute" else written[key]
        assert value == expected, key
    # Predictions, solver statistics, priced TP styles and provenance stay in plan.json.
    assert not {"predicted", "solver", "provenance", "tp_styles", "layer_names"} & set(module.PLAN)
    assert "OPTIMAL" not in source.split('"""', 2)[2]
    config = module.parallel_config(module.PLAN)
    assert (config.dims.dp, config.dims.tp, config.dims.pp) == (2, 2, 2)
    assert config.dims.mesh_axes() == (("dp_replicate", 1), ("dp_shard", 2), ("pp", 2), ("cp", 1), ("tp", 2))
    assert config.stages == [list(stage) for stage in plan.stages] and config.schedule == "interleaved_1f1b"
    assert config.recompute["blocks.1"] == "selective" and config.recompute["blocks.2"] == "full"
    assert config.tied_parameters == [["wte.weight", "lm_head.weight"]]
    assert config.fsdp_groups[-1] == ["ln_f", "lm_head"] and ["blocks.0"] in config.fsdp_groups
    assert module.PIPELINE_SPLIT == "modules"


def test_user_facing_functions_exist(gpt_3d):
    module = _load(gpt_3d[1].script)
    for name in ("build_mesh", "apply_tp", "apply_recompute", "apply_fsdp", "build_pipeline", "split_stage",
                 "train_step", "train", "main"):
        assert callable(getattr(module, name)), name


def test_tp_plan_pairs_columns_with_rows_and_shards_the_sequence(gpt_3d):
    plan = _load(gpt_3d[1].script).tp_plan()
    assert isinstance(plan["blocks.2.attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["blocks.2.attn.out_proj"], RowwiseParallel)
    assert plan["blocks.2.attn.out_proj"].output_layouts == (Shard(1),)  # reduce-scatter onto the sequence
    assert isinstance(plan["blocks.2.ln_1"], SequenceParallel)
    assert isinstance(plan["blocks.2.mlp"], PrepareModuleInput)
    assert plan["blocks.0"].desired_input_layouts == (Shard(1),)  # the first block enters SP
    head = plan["lm_head"]
    assert head.output_layouts == (Shard(-1),) and not head.use_local_output  # loss parallel
    # The tied embedding shards its table like the head does (rows = vocabulary).
    assert isinstance(plan["wte"], RowwiseParallel)


def test_llama_attention_called_by_keyword_gets_a_keyword_input_style():
    facts = inspect_model(LLAMA.path, LLAMA.kwargs)
    tp = build_tp_plan(make_plan(LLAMA, tp=2, sp=True), facts)
    attention = tp.styles["model.layers.1.self_attn"]
    assert dict(attention.arguments)["input_kwarg_layouts"] == '{"hidden_states": Shard(1)}'
    assert "input_layouts" in dict(tp.styles["model.layers.1.mlp"].arguments)


def test_column_without_row_partner_gathers_its_output_and_lone_row_slices_its_input():
    facts = inspect_model(GPT.path, GPT.kwargs)
    plan = make_plan(GPT, tp=2)
    styles = dict(plan.tp_styles)
    styles["blocks.0.attn.out_proj"] = "replicate"  # q/k/v column-parallel, output replicated
    styles["blocks.0.mlp.fc_in"] = "replicate"  # fc_out row-parallel alone
    tp = build_tp_plan(plan.with_updates(tp_styles=styles), facts)
    assert dict(tp.styles["blocks.0.attn.q_proj"].arguments)["output_layouts"] == "Replicate()"
    assert dict(tp.styles["blocks.0.mlp.fc_out"].arguments)["input_layouts"] == "Replicate()"
    assert "blocks.0.attn.out_proj" not in tp.styles
    assert tp.styles["blocks.1.attn.q_proj"].arguments == ()  # untouched blocks keep the pairing


def test_tied_embedding_follows_the_head():
    facts = inspect_model(GPT.path, GPT.kwargs)
    plan = make_plan(GPT, tp=2)
    tp = build_tp_plan(plan.with_updates(tp_styles={**plan.tp_styles, "wte": "replicate"}), facts)
    assert tp.styles["wte"].style == "RowwiseParallel"
    assert any("wte: replicate -> vocab_parallel" in note for note in tp.notes)


def test_launch_scripts_name_the_cluster_shape(tmp_path):
    plan = make_plan(GPT, dp=4, tp=2, pp=2, zero=3)  # 16 ranks
    files = generate(plan, GPT.path, tmp_path, gpus_per_node=8)
    launch = files.launch.read_text()
    for flag in ("--nnodes=", "--nproc-per-node=", "--rdzv-backend=c10d", "--rdzv-endpoint=", "--rdzv-id="):
        assert flag in launch
    assert "NNODES=${NNODES:-2}" in launch and "NPROC_PER_NODE=${NPROC_PER_NODE:-8}" in launch
    sbatch = files.sbatch.read_text()
    assert "#SBATCH --nodes=2" in sbatch and "#SBATCH --gpus-per-node=8" in sbatch and "srun torchrun" in sbatch
    for script in (files.launch, files.sbatch):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert files.model_copy.read_bytes() == GPT.path.read_bytes()
    assert Plan.load(files.plan) == plan


def test_hybrid_sharding_shards_inside_a_node_and_replicates_across(tmp_path):
    plan = make_plan(GPT, dp=4, tp=2, zero=3, hybrid=True)  # 8 ranks, tp innermost
    module = _load(generate(plan, GPT.path, tmp_path, gpus_per_node=4).script)
    assert (module.DP_REPLICATE, module.DP_SHARD) == (2, 2)  # 4 GPUs per node / tp 2 = 2 dp ranks per node


def test_zero_stages_map_to_replicas_and_shard_groups(tmp_path):
    for zero, expected in ((0, (4, 1)), (1, (4, 1)), (2, (1, 4)), (3, (1, 4))):
        module = _load(generate(make_plan(GPT, dp=4, zero=zero), GPT.path, tmp_path / str(zero)).script)
        assert (module.DP_REPLICATE, module.DP_SHARD) == expected


def test_cut_inside_the_embeddings_falls_back_to_the_traced_split(tmp_path):
    stages = [["wte"], ["wpe"] + GPT.block_names + GPT.epilogue]
    module = _load(generate(make_plan(GPT, pp=2, stages=stages), GPT.path, tmp_path / "a").script)
    assert module.PIPELINE_SPLIT == "tracer"
    with pytest.raises(CodegenError, match="traced split supports neither tensor parallelism"):
        generate(make_plan(GPT, pp=2, tp=2, stages=stages), GPT.path, tmp_path / "b")


def test_plans_the_code_cannot_run_are_refused_with_a_fix(tmp_path):
    with pytest.raises(CodegenError, match="context parallelism"):
        generate(make_plan(GPT).with_updates(cp=2), GPT.path, tmp_path)
    with pytest.raises(CodegenError, match="does not have"):
        generate(make_plan(GPT, tp=2).with_updates(tp_styles={"blocks.9.attn.q_proj": "colwise"}), GPT.path, tmp_path)
    with pytest.raises(CodegenError, match="every layer exactly once"):
        generate(make_plan(GPT).with_updates(stages=[["wte"]]), GPT.path, tmp_path)
    with pytest.raises(CodegenError, match="global_batch_size"):
        generate(make_plan(GPT, dp=2).with_updates(global_batch_size=6), GPT.path, tmp_path)


def test_sections_share_one_namespace_without_clashes():
    """The generated file concatenates the sections, so no two may define the same name."""
    from autopar.codegen.assemble import SECTIONS, section_source

    owner: dict[str, str] = {}
    for section in SECTIONS:
        for node in ast.parse(section_source(section)).body:
            names = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else [
                t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
            for name in names:
                assert name not in owner, f"{name} defined in {owner.get(name)} and {section}"
                owner[name] = section



# What only other plans run: pipelines, context parallelism, TP, recomputation, ZeRO-1 and the
# generated gradient exchanges, torch's private modules.
NOT_FOR_DP_ONLY = ("pipelining", "PipelineStage", "split_stage", "shard_sequence", "ring_attention",
                   "ulysses_attention", "context_parallel", "apply_tp", "apply_recompute", "ShardedAdamW",
                   "HierarchicalSync", "HalvingDoublingSync", "ParameterServer", "_flatten", "._checkpoint",
                   "profiler", "all_gather_into_tensor", "ExpertShards", "apply_ep", "named_parameters_in_stage",
                   "replicated_beside_shards")


def _code_words(source: str) -> set[str]:
    """Every name the code defines, reads or imports (comments and docstrings left out)."""
    words = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            words.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            words |= {getattr(node, "module", None) or ""} | {alias.name for alias in node.names}
    return words


def test_dp_only_module_is_under_half_the_sections_it_is_built_from(tmp_path):
    """Specialised to a dp-only plan, the module keeps less than half of the plan-dependent
    sections' lines (its own plan section included); the code that is the same for every plan
    (checkpoints, data, metrics, pretrained weights) is in files beside it."""
    from autopar.codegen.assemble import BESIDE, SECTIONS, section_source

    files = generate(make_plan(GPT, dp=2), GPT.path, tmp_path)
    sections = sum(len(section_source(name).splitlines()) for name in SECTIONS if name not in BESIDE)
    assert len(files.script.read_text().splitlines()) < sections / 2
    beside = tmp_path / "checkpointing.py"
    assert "class Checkpointer" in beside.read_text() and "class Checkpointer" not in files.script.read_text()


def test_dp_only_module_holds_only_what_the_plan_runs(tmp_path):
    files = generate(make_plan(GPT, dp=2), GPT.path, tmp_path)
    source = files.script.read_text()
    words = _code_words(source)
    assert [word for word in NOT_FOR_DP_ONLY if any(word in w for w in words)] == []
    parallelize = source[source.index("def parallelize("):source.index("\n\n\ndef ", source.index("def parallelize("))]
    # TP and recomputation folded away; FSDP stays behind fsdp_wraps(), which depends on the device.
    assert "fully_shard" in source and "apply_fsdp(" in parallelize and "if fsdp_wraps(" in parallelize


SPECIALISED = {
    "dp2_tp2": dict(dp=2, tp=2), "zero1_dp2": dict(dp=2, zero=1), "tp2_pp2_sp": dict(tp=2, pp=2, sp=True),
    "cp2_ring_recompute": dict(cp=2, cp_strategy="ring", zero=2, recompute={"blocks.1": "selective"}),
    "dp4_hierarchical": dict(dp=4, dp_sync="hierarchical", gpus_per_node=2), "dp4_ps": dict(dp=4, dp_sync="ps"),
    "dp4_halving_doubling": dict(dp=4, dp_sync="halving_doubling"),
    "pp2_traced_split": dict(pp=2, dp=2, stages=[["wte"], ["wpe"] + GPT.block_names + GPT.epilogue]),
}


@pytest.mark.parametrize("case", list(SPECIALISED))
def test_specialised_module_defines_what_it_uses_and_its_facts_hold(case, tmp_path):
    """Pruning leaves no name undefined, and every branch folded at generation takes the side the
    runtime would take for this plan."""
    from autopar.codegen.generate import plan_facts
    from autopar.sections import train as sections_train
    from autopar.codegen.specialize import undefined_globals

    plan = make_plan(GPT, **SPECIALISED[case])
    files = generate(plan, GPT.path, tmp_path, gpus_per_node=SPECIALISED[case].get("gpus_per_node"))
    source = files.script.read_text()
    assert undefined_globals(source) == set()
    module = _load(files.script)
    config = module.parallel_config(module.PLAN)
    training = module.train_config(module.PLAN, command_line(module))
    scope = {"config": config, "dims": config.dims, "self": training, "training": training,
             "NCCL_ALGORITHMS": sections_train.NCCL_ALGORITHMS}
    layout = derive_layout(plan, inspect_model(GPT.path, GPT.kwargs), SPECIALISED[case].get("gpus_per_node") or 8)
    for test, value in plan_facts(plan, layout).items():
        if not test.startswith("parallel."):
            actual = eval(test, scope)
            assert (bool(actual) if isinstance(value, bool) else actual) == value, test
    assert ("_flatten" in source) == (plan.cp > 1)  # DeviceMesh has no public flatten (torch 2.13)
    sync = {"hierarchical": "HierarchicalSync", "ps": "ParameterServer", "halving_doubling": "HalvingDoublingSync"}
    assert {name for name in sync.values() if f"{name}(" in source} == (
        {sync[plan.dp_sync]} if plan.dp_sync in sync else set())


def test_the_runtime_generates_the_exchanges_the_registry_says_it_does():
    """The generated file cannot import the registry, so its list of dp_sync values that
    gradient_sync.py runs is its own: it must be the registry's."""
    from autopar.sections.train import GRADIENT_SYNC_ALGORITHMS
    from autopar.domain.techniques import Family, entries

    registry = {str(t.value) for t in entries(Family.DP_SYNC) if (t.runtime or "").startswith("gradient_sync.")}
    assert registry == set(GRADIENT_SYNC_ALGORITHMS)


def test_each_stack_of_an_encoder_decoder_is_split_block_by_block(tmp_path):
    """T5 has two stacks (encoder.block, decoder.block): every block of both is an FSDP unit of
    its own (the layers after the decoder's last block one unit, the rest the root's), the TP
    plan splits modules in every block, one loop per stack and layout, and the generated module
    and its plan file name both stacks."""
    from autopar.config import PlanPins, SolverConfig
    from autopar.model_file import load_model_file
    from autopar.profile import profile_model
    from autopar.solver.planner import Planner
    from cost_models.step import TrainSpec
    from cost_models.topology import ClusterConfig, ClusterSpec

    t5 = Path(__file__).resolve().parents[1] / "zoo" / "models" / "hf_zoo.py"
    profile = profile_model(load_model_file(t5), {"arch": "t5"}, 1, "fp32")
    cluster = ClusterSpec.from_config(ClusterConfig(name="c", gpu="cpu", nodes=1, gpus_per_node=2,
                                                    intra_node_latency_us=3.0, intra_node_bandwidth_GBps=1.5))
    plan = Planner(profile, cluster, TrainSpec(global_batch_size=8, precision="fp32", optimizer="adam"),
                   SolverConfig(time_limit_s=60, top_k=0), PlanPins(dp=1, tp=2, pp=1)).run().plan
    assert plan.block_containers == ["encoder.block", "decoder.block"]
    blocks = ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]
    facts = inspect_model(t5, {"arch": "t5"})
    layout = derive_layout(plan, facts, 2)
    after = plan.layer_names[plan.layer_names.index("decoder.block.1") + 1:]
    assert layout.fsdp_groups == [[block] for block in blocks] + [after]
    tp = build_tp_plan(plan, facts)
    for block in blocks:
        assert any(module.startswith(block + ".") for module in tp.styles), block
    files = generate(plan, t5, tmp_path, gpus_per_node=2, model_kwargs={"arch": "t5"})
    source = files.script.read_text()
    assert 'for block in [f"encoder.block.{i}"' in source and 'for block in [f"decoder.block.{i}"' in source
    module = _load(files.script)
    styled = set(module.tp_plan())
    assert styled == set(tp.styles)
    assert Plan.load(files.plan).block_containers == ["encoder.block", "decoder.block"]


def test_a_plan_file_with_one_block_container_still_reads():
    """Plan files written when a plan named one stack (``block_container``) read as that stack;
    today's files name the list."""
    plan = make_plan(GPT, dp=2)
    data = json.loads(plan.to_json())
    assert data["block_containers"] == ["blocks"]
    old = {key: value for key, value in data.items() if key != "block_containers"}
    old["block_container"] = "blocks"
    assert Plan.from_json(json.dumps(old)) == plan
    assert Plan.from_yaml(json.dumps({**old, "block_container": None})).block_containers == []


def test_a_block_whose_own_linears_pair_keeps_a_plain_input(tmp_path):
    """Whisper's layout: the MLP's linears sit directly in the block beside its norm, so the
    block itself is a paired region. It is not handed its input as a DTensor (the norm's weight
    is a plain tensor: torch refuses the mix); its attention module, a region of its own, is."""
    from tests.dist.plans import TinyModel
    from tests.unit.test_tp_legality import MODEL

    path = tmp_path / "direct_linears.py"
    path.write_text(MODEL)
    model = TinyModel(name="direct_linears", path=path, kwargs={"style": "local"}, prologue=["embed"],
                      container="blocks", blocks=2, epilogue=["head"])
    plan = make_plan(model, tp=2)
    split = {"up": "colwise", "down": "rowwise", "attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise",
             "attn.o": "rowwise"}
    styles = {**plan.tp_styles, **{f"blocks.0.{name}": style for name, style in split.items()}}
    tp = build_tp_plan(plan.with_updates(tp_styles=styles, sequence_parallel=False), inspect_model(path, model.kwargs))
    assert "blocks.0" not in tp.styles
    assert tp.styles["blocks.0.attn"].style == "PrepareModuleInput"
    assert tp.styles["blocks.0.up"].style == "ColwiseParallel" and tp.styles["blocks.0.down"].style == "RowwiseParallel"


def test_a_region_holding_a_norm_keeps_a_plain_input():
    """A frozen GPT's MLP is ``Sequential(LayerNorm, Linear, GELU, Linear)``: with its linears
    paired it is a region, but a replicated DTensor handed to it would meet the norm's plain
    weight (torch refuses the mix), so it keeps a plain input; its linears keep their styles."""
    from tests.dist.plans import TinyModel

    path = Path(__file__).resolve().parents[1] / "zoo" / "models" / "frozen.py"
    model = TinyModel(name="frozen", path=path, kwargs={}, prologue=["wte"], container="blocks", blocks=2,
                      epilogue=["ln_f", "lm_head"])
    plan = make_plan(model, tp=2)
    styles = {**plan.tp_styles, "blocks.1.mlp.1": "colwise", "blocks.1.mlp.3": "rowwise"}
    tp = build_tp_plan(plan.with_updates(tp_styles=styles, sequence_parallel=False), inspect_model(path, {}))
    assert "blocks.1.mlp" not in tp.styles
    assert tp.styles["blocks.1.mlp.1"].style == "ColwiseParallel"
    assert tp.styles["blocks.1.mlp.3"].style == "RowwiseParallel"

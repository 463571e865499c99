"""Plan -> ``parallel_<model>.py`` (+ launch.sh, sbatch.sh, plan.json, a copy of model.py).

The generated module is the plan made concrete: what the runtime reads of the plan as data, the
plan-specific tensor-parallel styles as code, and the runtime sections (mesh, TP, recomputation,
pipeline, ZeRO/FSDP, optimizer, checkpoints, training loop) a user can read and edit, specialised
to the plan (`specialize`): a section or branch the plan never runs is left out. It imports
torch and the user's model.py only.
"""
from __future__ import annotations

import ast
import json
import math
import pprint
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autopar.codegen.assemble import BESIDE, ImportBlock, assemble_sections, banner, drop_empty_sections, module_beside
from autopar.codegen.errors import CodegenError
from autopar.codegen.launch import launch_script, sbatch_script
from autopar.codegen.model_facts import ModelFacts, inspect_model
from autopar.codegen.reading_order import in_reading_order
from autopar.model_profile import inside_any
from autopar.sections.train import GRADIENT_SYNC_ALGORITHMS, NCCL_ALGORITHMS
from autopar.codegen.specialize import fold, prune, referenced_names
from autopar.codegen.stage_flow import LayerReads, layer_reads, skipped_read, uncarried_read
from autopar.codegen.tp_plan import SPLITTING_STYLES, TPPlan, build_tp_plan
from autopar.model_file import load_model_file
from autopar.plans import Plan
from autopar.trace.sequence import POSITION_ARGUMENT_NAMES
from autopar.domain.layout import fsdp_groups
from autopar.domain.mesh import Mesh
from autopar.domain.rules import structure_problems
from cost_models.tp_layout import stack_of
from autopar.domain.vocabulary import DPSync, Recompute, Schedule

# The `optim` config group's defaults (autopar/config.py OptimConfig): what the module trains with.
DEFAULT_OPTIMIZER = {"name": "adamw", "lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
                     "decay_all": False, "warmup_steps": 0, "schedule": "cosine", "decay_steps": None,
                     "min_lr": 0.0, "wsd_decay_fraction": 0.2, "max_grad_norm": 1.0}


@dataclass(frozen=True)
class GeneratedFiles:
    """Paths of what `generate` wrote."""

    script: Path
    launch: Path
    sbatch: Path
    plan: Path
    model_copy: Path


@dataclass(frozen=True)
class RunDefaults:
    """What the generated module trains by default (each is a command-line option of it)."""

    steps: int = 10
    checkpoint_every: int = 0
    data: dict[str, Any] = field(default_factory=dict)
    eval_every: int = 0
    eval_batches: int = 4


@dataclass(frozen=True)
class Layout:
    """Decisions code generation adds to the plan (derived, not searched).

    Attributes:
        dp_replicate, dp_shard: the data-parallel degree split into replicas x shard group.
        pipeline_split: "modules" (drop other stages' layers), "tracer" (cut an exported graph) or
            "none" without pipelining.
        fsdp_groups: module FQNs per FSDP group, bottom-up.
        notes: adjustments worth telling the reader.
    """

    dp_replicate: int
    dp_shard: int
    pipeline_split: str
    fsdp_groups: list[list[str]]
    notes: list[str]


def generate(plan: Plan, model_path: str | Path, out_dir: str | Path, *, model_kwargs: dict[str, Any] | None = None,
             gpus_per_node: int | None = None, optimizer: dict[str, Any] | None = None,
             steps: int = 10, checkpoint_every: int = 0, data: dict[str, Any] | None = None,
             eval_every: int = 0, eval_batches: int = 4) -> GeneratedFiles:
    """Write the parallel training module for ``plan`` and its launch scripts into ``out_dir``.

    Args:
        plan: the plan to realise.
        model_path: the user's model.py (copied next to the generated module).
        out_dir: folder to write into (created if missing).
        model_kwargs: build_model/example_batch keyword arguments; default: the plan's provenance.
        gpus_per_node: ranks per node of the target cluster (launch scripts, hybrid-shard group
            size); default: every rank on one node.
        optimizer: AdamW settings (the `optim` group's fields), over `DEFAULT_OPTIMIZER`.
        steps: default number of training steps of the generated script.
        checkpoint_every: default checkpoint frequency of the generated script (0: off unless
            ``--checkpoint-every`` asks).
        data: the built-in text pipeline's settings (training_data.DataConfig fields that differ
            from their defaults); none: the model's dataset() hook, else example_batch.
        eval_every, eval_batches: default validation frequency (0: none) and batches.
    """
    model_path = Path(model_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kwargs = dict(plan.provenance.model_kwargs if model_kwargs is None else model_kwargs)
    gpus_per_node = gpus_per_node or plan.world_size
    facts = inspect_model(model_path, kwargs, batch_size=max(1, plan.micro_batch_size), real_values=plan.real_values)
    check_plan(plan, facts)
    tp = build_tp_plan(plan, facts)
    reads = (layer_reads(model_path, kwargs, plan.layer_names, max(1, plan.micro_batch_size), plan.real_values)
             if plan.pp > 1 else None)
    layout = derive_layout(plan, facts, gpus_per_node, reads)
    name = model_path.stem
    script = out_dir / f"parallel_{name}.py"
    model_copy = out_dir / model_path.name
    if model_path.resolve() != model_copy.resolve():
        shutil.copyfile(model_path, model_copy)
    sha = load_model_file(model_path).sha256
    settings = {**DEFAULT_OPTIMIZER, **(optimizer or {})}
    training = RunDefaults(steps=steps, checkpoint_every=checkpoint_every, data=dict(data or {}),
                           eval_every=eval_every, eval_batches=eval_batches)
    script.write_text(render_module(plan, name, model_path.name, sha, kwargs, facts, tp, layout, settings,
                                    gpus_per_node, training))
    for section, file_name in BESIDE.items():
        (out_dir / file_name).write_text(module_beside(section))
    plan_path = out_dir / "plan.json"
    plan.save(plan_path)
    launch = out_dir / "launch.sh"
    launch.write_text(launch_script(script.name, plan.world_size, gpus_per_node))
    sbatch = out_dir / "sbatch.sh"
    sbatch.write_text(sbatch_script(script.name, plan.world_size, gpus_per_node, f"autopar-{name}"))
    for path in (launch, sbatch, script):
        path.chmod(0o755)
    return GeneratedFiles(script=script, launch=launch, sbatch=sbatch, plan=plan_path, model_copy=model_copy)


def check_plan(plan: Plan, facts: ModelFacts) -> None:
    """Refuse plans the generated code cannot run, with the reason and the fix."""
    # Each technique's preconditions, from its one registry entry (autopar.domain.techniques): a value
    # with no runtime, ps with a sharded optimizer, CP without ZeRO-2/3, ...
    from autopar.domain.techniques import LayoutFacts, problems

    try:
        found = problems(plan.layout(), LayoutFacts(dropless_experts=facts.dropless_experts,
                                                    expert_width=facts.expert_width))
    except ValueError as error:
        found = [str(error)]
    if found:
        raise CodegenError(f"the plan cannot run: {found[0]}.", "re-plan, or pin what the message names.")
    if plan.cp > 1:
        check_context_parallel(plan, facts)
    if plan.dp_sync in GRADIENT_SYNC_ALGORITHMS and plan.dp > 1 and (plan.zero_stage > 1 or plan.cp > 1):
        raise CodegenError(f"dp_sync={plan.dp_sync} averages whole gradients after backward, which ZeRO-"
                           f"{plan.zero_stage} with cp={plan.cp} shards.", "re-plan (the planner offers it with "
                           "ZeRO-0/1 and cp=1 only), or pin plan.zero_stage=0 and plan.cp=1.")
    # The structure's rules, the same the pricer and a plan file read back ask (autopar.domain.rules).
    broken = structure_problems(plan, plan.layer_names, plan.global_batch_size)
    if broken:
        raise CodegenError(f"the plan cannot run: {broken[0].problem}.", f"re-plan, or {broken[0].fix}.")
    if not plan.stages:
        raise CodegenError("the plan lists no pipeline stages.", "re-plan; stages must partition plan.layer_names.")
    layers = [layer for stage in plan.stages for layer in stage]
    missing = [layer for layer in layers if layer not in facts.modules]
    if missing:
        raise CodegenError(f"the plan names layer {missing[0]}, which the model does not have.",
                           "re-plan for this model file.")


def check_context_parallel(plan: Plan, facts: ModelFacts) -> None:
    """What context parallelism needs from the model and the plan."""
    if facts.position_argument is None:
        raise CodegenError("context parallelism gives each rank part of every sequence, so the model must take "
                           f"the global positions of its tokens, but its forward has no {POSITION_ARGUMENT_NAMES} "
                           "argument.", "add `position_ids=None` to forward (use it instead of arange), or plan "
                           "with plan.cp=1.")


def module_split_problem(plan: Plan, facts: ModelFacts, reads: LayerReads | None = None) -> str | None:
    """Why stages cannot be cut by dropping other stages' layers (None if they can).

    A stage may start at a block of a stack or at a layer after the first block, where the
    residual stream is a layer's first input; not between embeddings (token | position) before
    the first block, which do not hand on one activation. What a later stack reads of an
    earlier one (a decoder reading the encoder's output) is checked by ``reads``. Parameters
    outside every layer would belong to no stage."""
    containers = [name for name in plan.block_containers if name in facts.modules]
    if not containers:
        return "the model has no block container (ModuleList/ModuleDict of layers)"
    blocks = {block for name in containers for block in facts.children.get(name, [])}
    order = plan.layer_names
    first_block = min((order.index(b) for b in blocks if b in order), default=len(order))
    for index, stage in enumerate(plan.stages[1:], start=1):
        first = stage[0]
        if first not in blocks and order.index(first) < first_block:
            return f"stage {index} starts at {first}, before the first block ({order[first_block]})"
    for name, module in facts.modules.items():
        in_layer = inside_any(name, order)
        ancestor = name == "" or any(layer.startswith(name + ".") for layer in order)
        if module.has_parameters and not in_layer and not ancestor:
            return f"module {name} holds parameters outside every layer"
    return uncarried_read(plan.stages, reads) if reads is not None else None


def pipeline_split(plan: Plan, facts: ModelFacts, notes: list[str], reads: LayerReads | None = None) -> str:
    """"modules" when the stages can be cut by dropping layers, else "tracer" (torch's
    pipeline() on an exported graph), which supports data parallelism but not TP/recompute."""
    if plan.pp <= 1:
        return "none"
    problem = module_split_problem(plan, facts, reads)
    if problem is None:
        return "modules"
    if plan.tp > 1 or any(mode != Recompute.NONE for mode in plan.recompute.values()):
        raise CodegenError(f"the pipeline cannot be cut by modules ({problem}), and the traced split "
                           "supports neither tensor parallelism nor recomputation.",
                           "move the stage boundaries to block boundaries, or plan with plan.tp=1 "
                           "and plan.recompute=none.")
    skipped = skipped_read(plan.stages, reads) if reads is not None else None
    if skipped is not None:
        raise CodegenError(f"the pipeline cannot be cut by modules ({problem}), and the traced split sends a "
                           f"value only to the next stage, but {skipped}.",
                           "plan with fewer (virtual) stages, e.g. plan.schedule=1f1b instead of an interleaved "
                           "schedule, or pin plan.stages so that every stage reads only the one before it.")
    if plan.ep > 1 and plan.dp != plan.ep:
        # A graph stage has no experts module for FSDP to shard over the expert-data-parallel
        # group (sections/expert_parallel.py), so each expert must live on one rank alone.
        raise CodegenError(f"the pipeline cannot be cut by modules ({problem}), and the traced split runs expert "
                           f"parallelism only with every data-parallel rank in one expert-parallel group "
                           f"(ep = dp), not ep={plan.ep} of dp={plan.dp}.",
                           f"pin plan.ep={plan.dp} or plan.ep=1, or move the stage boundaries to block boundaries.")
    if plan.ep > 1 and facts.dropless_experts:
        raise CodegenError(f"the pipeline cannot be cut by modules ({problem}), and the traced split cannot carry the "
                           "dropless expert exchange: its sizes follow the routing, which an exported graph "
                           "cannot hold.",
                           "pin plan.ep=1, or move the stage boundaries to block boundaries.")
    notes.append(f"pipeline stages cut from an exported graph ({problem})")
    return "tracer"


def derive_layout(plan: Plan, facts: ModelFacts, gpus_per_node: int, reads: LayerReads | None = None) -> Layout:
    """dp split, pipeline split method and FSDP groups for the plan; ``reads``: what each layer
    reads (autopar/codegen/stage_flow.py), which decides whether a pipeline's stages can be cut
    by modules."""
    notes: list[str] = []
    dp_shard = 1 if plan.zero_stage <= 1 else plan.dp
    if plan.hybrid_shard and plan.zero_stage >= 2:
        dp_per_node = max(1, gpus_per_node // Mesh.of(plan).stride("dp"))
        dp_shard = math.gcd(plan.dp, dp_per_node)
        notes.append(f"hybrid sharding: ZeRO-{plan.zero_stage} within groups of {dp_shard} data-parallel ranks "
                     f"(one node), replicated {plan.dp // dp_shard}x across nodes")
    blocks = {block for name in plan.block_containers for block in facts.children.get(name, [])}
    groups = fsdp_groups(plan.layer_names, blocks)
    split = pipeline_split(plan, facts, notes, reads)
    return Layout(dp_replicate=plan.dp // dp_shard, dp_shard=dp_shard, pipeline_split=split, fsdp_groups=groups,
                  notes=notes)


# What autopar's own tools call on a generated module (runtime/fake_memory.py, the tests and
# benchmarks), beyond what main() reaches: pruning keeps them.
RUNTIME_API = frozenset({"main", "parse_args", "train", "train_config", "parallel_config", "setup", "parallelize",
                         "train_step", "local_batch", "open_data", "Batches", "validation_batches", "eval_step",
                         "validation_loss", "attention_context", "global_loss", "slice_batch",
                         "model_inputs", "build_model", "load_model_file", "place", "compute_dtype", "dp_rank",
                         "tp_plan", "PLAN", "MODEL_FILE"})
PIPELINE_API = frozenset({"local_stage_indices", "batch_to_kwargs", "named_parameters_in_stage"})


def custom_gradient_sync(plan: Plan) -> bool:
    """Whether gradients are averaged by the generated exchange rather than FSDP (the same rule
    as the runtime's ``ParallelConfig.custom_gradient_sync``)."""
    return plan.dp_sync in GRADIENT_SYNC_ALGORITHMS and plan.zero_stage <= 1 and plan.dp > 1 and plan.cp == 1


def plan_facts(plan: Plan, layout: Layout) -> dict[str, Any]:
    """What this plan fixes of the runtime's branch conditions, by their source text: flags, and
    the values comparisons read (see `specialize.fold`). Only what PLAN decides (a command-line
    option can change nothing here)."""
    values = {
        "tp_enabled": plan.tp > 1, "pp_enabled": plan.pp > 1, "cp_enabled": plan.cp > 1,
        "grad_sync_enabled": plan.dp * plan.cp > 1, "dp_replicate > 1": layout.dp_replicate > 1,
        "dp": plan.dp, "tp": plan.tp, "pp": plan.pp, "cp": plan.cp, "dp_replicate": layout.dp_replicate,
    }
    facts: dict[str, Any] = {f"{owner}.{name}": value for name, value in values.items()
                             for owner in ("dims", "config.dims")}
    facts.update({
        "config.custom_gradient_sync": custom_gradient_sync(plan),
        "config.expert_parallel": plan.ep > 1,
        "config.expert_tp": plan.expert_tp,
        "config.experts_split": plan.ep > 1 or plan.expert_tp,
        "parallel.schedule is not None": plan.pp > 1,
        "config.recompute_enabled": any(mode != Recompute.NONE for mode in plan.recompute.values()),
        'config.pipeline_split == "tracer"': layout.pipeline_split == "tracer",
        "config.zero_stage": plan.zero_stage,
        "config.dp_sync": str(plan.dp_sync),
        "NCCL_ALGORITHMS": tuple(NCCL_ALGORITHMS),
        "self.dp_shares": bool(plan.dp_shares),  # TrainConfig's
        "training.token_loss": plan.token_loss,
        "parallel.token_counts is not None": plan.token_loss,
        "parallel.tied_sync is not None": plan.pp > 1,
    })
    if plan.tp == 1:  # with TP, whether the head keeps loss parallelism is codegen's (tp_plan.build_tp_plan)
        facts["config.loss_parallel"] = False
    return facts


def render_module(plan: Plan, name: str, model_file: str, sha: str, model_kwargs: dict[str, Any], facts: ModelFacts,
                  tp: TPPlan, layout: Layout, optimizer: dict[str, Any], gpus_per_node: int,
                  training: RunDefaults) -> str:
    """The generated module's source: every section, specialised to the plan (branches it
    decides folded, definitions nothing reaches dropped), under one import block of the names
    it still uses."""
    imports = ImportBlock()
    facts_of_plan = plan_facts(plan, layout)
    sections = assemble_sections(imports, lambda code: fold(code, facts_of_plan))  # section by section: fast
    for module, names in (("torch.distributed.tensor", {"Replicate", "Shard"}),
                          ("torch.distributed.tensor.parallel", {"ColwiseParallel", "RowwiseParallel",
                                                                 "SequenceParallel", "PrepareModuleInput",
                                                                 "PrepareModuleInputOutput", "ParallelStyle"}),
                          ("torch.distributed.elastic.multiprocessing.errors", {"record"}),
                          ("pathlib", {"Path"})):
        imports.from_names.setdefault(module, set()).update(names)
    body = "\n\n\n".join(part.strip("\n") for part in (
        plan_section(plan, model_file, sha, model_kwargs, facts, tp, layout, optimizer, gpus_per_node, training),
        sections,
        main_section(),
    )) + "\n"
    body = prune(body, RUNTIME_API | (PIPELINE_API if plan.pp > 1 else frozenset()))
    body = drop_empty_sections(in_reading_order(body))
    used = referenced_names(ast.parse(body))
    head = header(plan, name, model_file, tp, layout, gpus_per_node) + "\n\nfrom __future__ import annotations\n\n"
    return head + imports.source(used).strip("\n") + "\n\n\n" + body


def _fmt_seconds(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def summarise_recompute(plan: Plan) -> str:
    modes: dict[str, list[str]] = {}
    for layer in plan.layer_names:
        modes.setdefault(plan.recompute.get(layer, Recompute.NONE), []).append(layer)
    if set(modes) <= {Recompute.NONE}:
        return Recompute.NONE
    return "; ".join(f"{mode}: {len(layers)} layer(s)" for mode, layers in modes.items())


def applied_techniques(plan: Plan) -> str:
    """What `parallelize` applies for this plan, in its order, in words."""
    fsdp = (plan.dp * plan.cp > 1 or plan.precision != "fp32") and not custom_gradient_sync(plan)
    found = [name for name, used in (("tensor parallelism", plan.tp > 1), ("expert parallelism", plan.ep > 1),
                                     ("recomputation", any(m != Recompute.NONE for m in plan.recompute.values())),
                                     ("FSDP", fsdp)) if used]
    if not found:
        return "nothing (one rank in full precision)"
    return ", ".join(found[:-1]) + (" and " if len(found) > 1 else "") + found[-1]


def header(plan: Plan, name: str, model_file: str, tp: TPPlan, layout: Layout, gpus_per_node: int) -> str:
    """The module docstring: what the plan is, what it should cost, how to run it."""
    p = plan.predicted
    nodes = max(1, -(-plan.world_size // gpus_per_node))
    zero = {0: "ZeRO-0 (replicated, gradients all-reduced)", 1: "ZeRO-1 (optimizer state sharded)",
            2: "ZeRO-2 (+ gradients sharded)", 3: "ZeRO-3 / FSDP (+ parameters sharded)"}[plan.zero_stage]
    lines = [
        f"Parallel training of {model_file}, generated by autopar from plan.json.",
        "",
        "Plan",
        f"  ranks        {plan.world_size} = dp {plan.dp} x tp {plan.tp} x pp {plan.pp} x cp {plan.cp}"
        f"  (mesh axes innermost first: {' -> '.join(plan.mesh_order)})",
        (f"  data         {zero}" + (", hybrid across nodes" if layout.dp_replicate > 1 and layout.dp_shard > 1 else "")
         if plan.dp > 1 else "  data         one data-parallel rank"),
        f"  batch        {plan.global_batch_size} samples = dp {plan.dp} x {plan.num_micro_batches} micro-batches"
        f" x {plan.micro_batch_size}",
    ]
    if plan.tp > 1:
        split = sum(1 for s in tp.styles.values() if s.style in SPLITTING_STYLES)
        lines.append(f"  tensor       {split} modules split over {plan.tp} ranks"
                     + (", sequence parallel" if plan.sequence_parallel else "")
                     + (", loss parallel" if tp.loss_parallel else ""))
    if plan.pp > 1:
        sizes = ", ".join(str(len(s)) for s in plan.stages)
        lines.append(f"  pipeline     {len(plan.stages)} stages ({sizes} layers), schedule {plan.schedule}"
                     + (f" with {plan.chunks} chunks per rank" if plan.schedule == Schedule.INTERLEAVED_1F1B else ""))
    lines.append(f"  recompute    {summarise_recompute(plan)}")
    lines.append(f"  precision    {plan.precision} on GPUs (fp32 on CPUs), optimizer AdamW")
    lines += ["", "Predicted by the cost model (per step)"]
    if p.step_time_s:
        lines.append(f"  step time    {_fmt_seconds(p.step_time_s)}"
                     + (f", {p.tokens_per_s:,.0f} tokens/s" if p.tokens_per_s
                        else f", {p.samples_per_s:,.1f} samples/s")
                     + (f", MFU {p.mfu:.1%}" if p.mfu else ""))
        if p.time_breakdown:
            lines.append("  time         "
                         + ", ".join(f"{k} {_fmt_seconds(v)}" for k, v in p.time_breakdown.items() if v))
        lines.append(f"  peak memory  {_fmt_bytes(p.peak_memory_bytes)} per rank")
    else:
        lines.append("  (no prediction recorded in the plan)")
    lines.append(f"  solver       {plan.solver.status}, {plan.solver.candidates} candidates, "
                 f"{plan.solver.seconds:.1f} s")
    notes = tp.notes + layout.notes
    if notes:
        lines += ["", "Adjustments made when generating"] + [f"  - {note}" for note in notes]
    lines += [
        "",
        "Run",
        f"  ./launch.sh --steps 10                      ({nodes} node(s) x {min(plan.world_size, gpus_per_node)} "
        "ranks; sbatch.sh for SLURM)",
        f"  torchrun --nproc-per-node {plan.world_size} parallel_{name}.py --steps 10   (one machine)",
        "  Uses NCCL on GPUs and gloo on CPUs; each step appends a JSON record to run.jsonl (and scalars",
        "  to tensorboard/<run id>/; --wandb PROJECT, --mlflow EXPERIMENT log there too).",
        "  --checkpoint-every N saves to checkpoints/step_<n>/ (DCP, any plan can load it) and resumes from",
        "  the latest complete one; launch.sh restarts failed ranks (MAX_RESTARTS, default 3);",
        f"  python parallel_{name}.py --export model.safetensors consolidates the latest checkpoint.",
        "  --init-from PATH starts from pretrained weights (a .safetensors file, a Hugging Face folder);",
        "  --export DIR (no suffix) writes a folder that transformers' from_pretrained loads.",
        "",
        "Read from the top: PLAN and tp_plan() (the tensor-parallel styles: edit freely), then parallelize(),",
        f"which applies {applied_techniques(plan)}, setup(), train_step(), train() and main(); what they",
        "call follows. Only the code this plan runs is here (compile again for other degrees or techniques);",
        "shared by every plan, beside it: checkpointing.py, pretrained.py, metrics.py, training_data.py, "
        "data_loading.py.",
    ]
    # A file name may hold quotes or backslashes: escaped, they cannot end the docstring early.
    text = "\n".join(lines).replace("\\", "\\\\").replace('"', '\\"')
    return '"""' + text + '\n"""'


def runtime_plan(plan: Plan) -> dict[str, Any]:
    """What the generated runtime reads of the plan (parallel_config, train_config), as plan.json
    writes it (plain values, no enums); the rest (predictions, solver statistics, TP styles as
    priced, provenance) stays in plan.json."""
    written = json.loads(plan.to_json())
    keys = ["tp", "pp", "cp"] + (["ep"] if plan.ep > 1 else []) + (["expert_tp"] if plan.expert_tp else [])
    keys += ["mesh_order", "zero_stage", "stages", "recompute"]
    keys += ["schedule"] if plan.pp > 1 else []
    keys += ["cp_strategy"] if plan.cp > 1 else []
    keys += ["dp_sync"] + (["dp_bucket_bytes"] if custom_gradient_sync(plan) else [])
    keys += ["global_batch_size", "micro_batch_size", "num_micro_batches", "precision"]
    keys += ["dp_shares"] if plan.dp_shares else []
    keys += ["token_loss"] if plan.token_loss else []
    data = {key: written[key] for key in keys}
    data["recompute"] = {layer: mode for layer, mode in data["recompute"].items() if mode != Recompute.NONE}
    return data


def plan_section(plan: Plan, model_file: str, sha: str, model_kwargs: dict[str, Any], facts: ModelFacts, tp: TPPlan,
                 layout: Layout, optimizer: dict[str, Any], gpus_per_node: int, training: RunDefaults) -> str:
    constants = [
        "# Derived when generating: dp = replicas x ZeRO shard group, FSDP groups bottom-up, tied parameters.",
        f"DP_REPLICATE, DP_SHARD = {layout.dp_replicate}, {layout.dp_shard}",
        f"FSDP_GROUPS = {pprint.pformat(layout.fsdp_groups, width=110, compact=True)}",
        f"TIED_PARAMETERS = {pprint.pformat(facts.tied_parameters, width=110)}",
    ]
    if plan.tp > 1:
        constants.append(f"LOSS_PARALLEL = {tp.loss_parallel}")
    if tp.fused_parameters:
        constants.append("# Fused projections split as their parts: parameter -> (its rows' dim, the parts' sizes).")
        constants.append(f"FUSED_PARAMETERS = {pprint.pformat(tp.fused_parameters, width=110, compact=True)}")
    if plan.pp > 1:
        constants.append(f"PIPELINE_SPLIT = {layout.pipeline_split!r}  # how stages are cut (see the pipeline section)")
    if plan.cp > 1:
        constants += [f"POSITION_ARGUMENT = {facts.position_argument!r}  # forward's token positions",
                      f"MASK_ARGUMENT = {facts.mask_argument!r}  # forward's padding mask"]
    if custom_gradient_sync(plan) and plan.dp_sync == DPSync.HIERARCHICAL:
        constants.append(f"GPUS_PER_NODE = {gpus_per_node}  # ranks per node (hierarchical gradient all-reduce)")
    body = [
        banner("The plan"),
        "# What the runtime reads of the plan (plan.json beside this file holds all of it: predictions,",
        "# solver statistics, provenance). parallel_config() and train_config() read it.",
        packed_dict_source("PLAN", runtime_plan(plan)),
        "",
        "",
        tp_plan_source(plan, tp),
        "",
        "",
        banner("The run's settings: the model file, optimizer, checkpoints and data, and the plan as dataclasses"),
        "# The user's model file (copied next to this one) and what it was planned with.",
        f"MODEL_FILE = str(Path(__file__).with_name({model_file!r}))",
        f"MODEL_SHA256 = {sha!r}",
        f"MODEL_KWARGS = {pprint.pformat(model_kwargs, width=110)}",
        packed_dict_source("OPTIMIZER", dict(optimizer)),
        f"DEFAULT_STEPS = {training.steps}",
        "# Checkpoints: CHECKPOINT_DIR/step_<n>/ every CHECKPOINT_EVERY steps; 0 turns them off.",
        'CHECKPOINT_DIR = str(Path(__file__).with_name("checkpoints"))',
        f"CHECKPOINT_EVERY = {training.checkpoint_every}",
        "# Training data (training_data.py): the built-in text pipeline's settings; without a path, the",
        "# model file's dataset() hook, else example_batch. Tokenized corpora are cached in DATA_CACHE.",
        packed_dict_source("DATA", dict(training.data)) if training.data else "DATA = {}",
        'DATA_CACHE = str(Path(__file__).with_name("data_cache"))',
        f"SEQ_LEN, VOCAB_ROWS = {facts.seq_len}, {facts.vocab_rows}  "
        "# tokens per sample planned; the largest embedding's rows",
        f"EVAL_EVERY, EVAL_BATCHES = {training.eval_every}, {training.eval_batches}  "
        "# validation loss: every N steps, over K batches",
        "",
        *constants,
        "",
        "",
        parallel_config_source(plan, bool(tp.fused_parameters)),
        "",
        "",
        train_config_source(plan),
    ]
    return "\n".join(body)


ONE_LINE = 120  # the longest line a dict is written on whole (the project's own limit)


def packed_dict_source(name: str, data: dict[str, Any], width: int = 110) -> str:
    """``NAME = {...}`` with short entries side by side and long ones on lines of their own (one
    key per line, as pprint writes a dict, would make PLAN and OPTIMIZER a screen long)."""
    whole = f"{name} = {data!r}"
    if len(whole) <= ONE_LINE:
        return whole
    lines, line = [f"{name} = {{"], "   "
    for key, value in data.items():
        entry = f"{key!r}: {pprint.pformat(value, width=width - 8 - len(repr(key)), compact=True)},"
        if "\n" in entry or len(line) + 1 + len(entry) > width:
            if line.strip():
                lines.append(line)
            line = "   "
        if "\n" in entry:
            lines.append("    " + entry.replace("\n", "\n" + " " * (6 + len(repr(key)))))
        else:
            line += " " + entry
    if line.strip():
        lines.append(line)
    return "\n".join(lines + ["}"])


def parallel_config_source(plan: Plan, tp_fused_parameters: bool = False) -> str:
    """``def parallel_config(plan)``: the ParallelConfig fields this plan sets (the others keep
    their defaults, which this plan's code never reads)."""
    fields = [
        'dims=ParallelDims(dp_replicate=DP_REPLICATE, dp_shard=DP_SHARD, pp=plan["pp"], cp=plan["cp"], tp=plan["tp"],',
        '                  mesh_order=tuple(plan["mesh_order"])),',
        'zero_stage=plan["zero_stage"],',
        'stages=plan["stages"],',
        'recompute=plan["recompute"],',
        "fsdp_groups=FSDP_GROUPS,",
        "tied_parameters=TIED_PARAMETERS,",
    ]
    if plan.tp > 1:
        fields.append("loss_parallel=LOSS_PARALLEL,")
    if tp_fused_parameters:
        fields.append("fused_parameters=FUSED_PARAMETERS,")
    if plan.pp > 1:
        fields += ['schedule=plan["schedule"],', "pipeline_split=PIPELINE_SPLIT,"]
    if plan.ep > 1:
        fields.append('ep=plan["ep"],')
    if plan.expert_tp:
        fields.append('expert_tp=plan["expert_tp"],')
    if plan.cp > 1:
        fields += ['cp_strategy=plan["cp_strategy"],', "position_argument=POSITION_ARGUMENT,",
                   "mask_argument=MASK_ARGUMENT,"]
    fields.append('dp_sync=plan["dp_sync"],')
    if custom_gradient_sync(plan):
        fields.append('dp_bucket_bytes=plan["dp_bucket_bytes"],')
        if plan.dp_sync == DPSync.HIERARCHICAL:
            fields.append("gpus_per_node=GPUS_PER_NODE,")
    lines = ["def parallel_config(plan: dict) -> ParallelConfig:",
             '    """The plan\'s parallel decisions as the training code takes them."""',
             "    return ParallelConfig("]
    lines += [f"        {field}" for field in fields]
    lines.append("    )")
    return "\n".join(lines)


def train_config_source(plan: Plan) -> str:
    shares = '        dp_shares=plan["dp_shares"],\n' if plan.dp_shares else ""
    shares += '        token_loss=plan["token_loss"],\n' if plan.token_loss else ""
    return f'''def train_config(plan: dict, args: argparse.Namespace) -> TrainConfig:
    """Batch sizes and precision from the plan; steps, seed, the optimizer's overrides, files and checkpoints
    from the command line."""
    return TrainConfig(
        model_file=args.model_file,
        model_kwargs=MODEL_KWARGS,
        global_batch_size=plan["global_batch_size"],
        micro_batch_size=plan["micro_batch_size"],
        num_micro_batches=plan["num_micro_batches"],
        precision=plan["precision"],
{shares}        optimizer=optimizer_settings(OPTIMIZER, args),
        steps=args.steps,
        seed=args.seed,
        log_file=args.log_file,
        save_final=args.save_final,
        dropout_off=args.dropout_off,
        checkpoint=checkpointing.CheckpointConfig(directory=args.checkpoint_dir, every=args.checkpoint_every,
                                                  async_save=args.async_checkpoint, export=args.export,
                                                  allow_fresh_start=args.allow_fresh_start),
        fail_at_step=args.fail_at_step,
        data=data_overrides({{"cache_dir": DATA_CACHE, "seq_len": SEQ_LEN, **DATA}}, args.data),
        vocab_rows=VOCAB_ROWS,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        init_from=args.init_from,
        metrics=metrics.MetricsConfig.from_args(args),
    )'''


def tp_plan_source(plan: Plan, tp: TPPlan) -> str:
    """``def tp_plan()``: the TP styles as code, one loop for blocks that share a layout."""
    doc = '    """Module FQN -> tensor-parallel style (from the plan\'s operator-wise split)."""'
    if not tp.styles:
        return (f"def tp_plan() -> dict[str, ParallelStyle]:\n{doc}\n"
                "    return {}  # the plan uses no tensor parallelism")
    blocks = [layer for layer in plan.layer_names if stack_of(layer, plan.block_containers) is not None]
    per_block: dict[str, dict[str, Any]] = {b: {} for b in blocks}
    top: dict[str, Any] = {}
    for module, spec in tp.styles.items():
        block = next((b for b in blocks if module.startswith(b + ".")), None)
        if block is None:
            top[module] = spec
        else:
            per_block[block][module[len(block) + 1:]] = spec
    lines = ["def tp_plan() -> dict[str, ParallelStyle]:", doc, "    plan: dict[str, ParallelStyle] = {"]
    lines += _entries({f"{module!r}": spec for module, spec in top.items()}, "        ")
    lines.append("    }")
    # Blocks of one stack with the same relative layout share one loop.
    groups: dict[tuple, list[str]] = {}
    for block, relative in per_block.items():
        key = tuple((k, v.source()) for k, v in relative.items())
        if key:
            groups.setdefault((stack_of(block, plan.block_containers), key), []).append(block)
    for (container, _), members in groups.items():
        relative = per_block[members[0]]
        names = _block_range_source(members, container)
        lines.append(f"    for block in {names}:")
        lines.append("        plan.update({")
        lines += _entries({f'f"{{block}}.{suffix}"': spec for suffix, spec in relative.items()}, "            ")
        lines.append("        })")
    lines.append("    return plan")
    return "\n".join(lines)


def _entries(specs: dict[str, Any], indent: str) -> list[str]:
    """``key: Style(...)`` lines, each run of styles with the same reason under one comment."""
    lines, previous = [], None
    for key, spec in specs.items():
        if spec.why and spec.why != previous:
            lines.append(f"{indent}# {spec.why}")
        previous = spec.why
        lines.append(_entry(f"{indent}{key}: ", spec))
    return lines


def _entry(prefix: str, spec) -> str:
    """One ``key: Style(...)`` line, its arguments wrapped when the line would be long."""
    line = f"{prefix}{spec.source()},"
    if len(line) <= 110:
        return line
    indent = " " * (len(prefix) - len(prefix.lstrip()) + 4)
    arguments = "".join(f"\n{indent}{k}={v}," for k, v in spec.arguments)
    return f"{prefix}{spec.style}({arguments}\n{indent[:-4]}),"


def _block_range_source(members: list[str], container: str) -> str:
    prefix = f"{container}." if container else ""  # a model that is itself a Sequential of blocks
    indices = [m[len(prefix):] for m in members]
    if all(i.isdigit() for i in indices):
        numbers = [int(i) for i in indices]
        if numbers == list(range(numbers[0], numbers[-1] + 1)):
            return f'[f"{prefix}{{i}}" for i in range({numbers[0]}, {numbers[-1] + 1})]'
    return repr(members)


def main_section() -> str:
    return banner("Entry point") + '''
def command_line(argv: list[str] | None = None) -> argparse.Namespace:
    """The run's settings: the compiled defaults under the command line's options (what code
    importing this module reads too, to train with it in a loop of its own)."""
    return parse_args(argv, {"steps": DEFAULT_STEPS, "lr": OPTIMIZER["lr"], "optimizer": OPTIMIZER,
                             "model_file": MODEL_FILE, "log_file": str(Path(__file__).with_name("run.jsonl")),
                             "checkpoint_dir": CHECKPOINT_DIR, "checkpoint_every": CHECKPOINT_EVERY,
                             "eval_every": EVAL_EVERY, "eval_batches": EVAL_BATCHES})


@record
def main(argv: list[str] | None = None, after_steps: Callable[..., None] | None = None) -> list[dict[str, float]]:
    """Train with the plan; see the module docstring for how to launch (``after_steps``: see train)."""
    args = command_line(argv)
    if args.export and "RANK" not in os.environ:  # not under torchrun: only consolidate the latest checkpoint
        pretrained.check_paths(None, args.export)
        model_module = load_model_file(args.model_file)  # a folder export reads the model's config
        folder = checkpointing.export_latest_checkpoint(
            args.checkpoint_dir, args.export,
            lambda state, path: write_export(state, path, TIED_PARAMETERS,
                                             lambda: meta_model(model_module, MODEL_KWARGS)))
        print(f"exported {folder} to {args.export}")
        return []
    return train(train_config(PLAN, args), parallel_config(PLAN), tp_plan, expected_sha256=MODEL_SHA256,
                 after_steps=after_steps)


if __name__ == "__main__":
    main()
    # Everything is written and closed, and what is left lives until the process ends: frozen out
    # of the collector, the interpreter's last collection on the way out does not walk all that
    # torch loaded (over a second of every rank's exit, 0.4 s then).
    import gc

    gc.freeze()'''

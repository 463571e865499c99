"""torchtitan: overrides of a torchtitan job (its ``--parallelism.*`` and ``--training.*``
options, torchtitan.config's ParallelismConfig and TrainingConfig), one per line, for
``torchrun ... -m torchtitan.train --module M --config C $(grep -v '^#' torchtitan_args.txt)``.

torchtitan shards data-parallel ranks with FSDP2 (``data_parallel_shard_degree``; ZeRO-3
reshards after forward, ZeRO-2 does not) or replicates them with DDP alone; it has no
ZeRO-1, its context parallelism passes K/V around a ring (no Ulysses all-to-all), and the
data-parallel replica/shard split of hybrid sharding is left to the file's reader. Its
activation checkpointing is a policy object of the job's config (FullAC, SelectiveAC), so the
file names the plan's mode in a comment.
"""
from __future__ import annotations

from typing import Any

from autopar.emit import EngineSettings, EngineWriter, argument_pairs, comment_lines, common_refusal, uniform_recompute
from autopar.domain.vocabulary import RECOMPUTE_OPTIONS, CPStrategy, Recompute, Schedule

AC_COMMENT = "# activation checkpointing:"
AC_POLICIES: dict[str, str] = {Recompute.FULL: "FullAC", Recompute.SELECTIVE: "SelectiveAC"}
SCHEDULES = {Schedule.ONE_F_ONE_B: "1F1B", Schedule.INTERLEAVED_1F1B: "Interleaved1F1B", Schedule.GPIPE: "GPipe"}


def layout_refusal(plan: Any) -> str | None:
    """What of the plan's degrees and techniques the engine cannot run (a Plan or a search candidate)."""
    if plan.zero_stage == 1 and plan.dp > 1:
        return "torchtitan has no ZeRO-1 (its data parallelism is FSDP or DDP); pin plan.zero_stage=2 or 3"
    if plan.zero_stage == 0 and plan.dp > 1 and plan.tp * plan.pp * plan.cp > 1:
        return "torchtitan's DDP runs only alone, not beside other parallelism; pin plan.zero_stage=2 or 3"
    if plan.hybrid_shard:
        return "hybrid sharding's group size is not one of torchtitan's settings here; pin plan.hybrid_shard=false"
    if plan.cp > 1 and plan.cp_strategy != CPStrategy.RING:
        return "torchtitan's context parallelism is a ring; pin plan.cp_strategy=ring"
    return None


def refusal(plan: Any) -> str | None:
    return layout_refusal(plan) or common_refusal(plan, "torchtitan")


def options(plan: Any) -> dict[str, Any]:
    """Option -> value (the names of torchtitan.config's ParallelismConfig and TrainingConfig)."""
    sharded = plan.zero_stage >= 2
    values: dict[str, Any] = {
        "parallelism.data_parallel_replicate_degree": 1 if sharded else plan.dp,
        "parallelism.data_parallel_shard_degree": plan.dp if sharded else 1,
        "parallelism.fsdp_reshard_after_forward": "always" if plan.zero_stage == 3 else "never",
        "parallelism.tensor_parallel_degree": plan.tp,
        "parallelism.enable_sequence_parallel": plan.sequence_parallel,
        "parallelism.pipeline_parallel_degree": plan.pp,
        "parallelism.context_parallel_degree": plan.cp,
        "parallelism.expert_parallel_degree": plan.ep,
        "training.global_batch_size": plan.global_batch_size,
        "training.local_batch_size": plan.micro_batch_size * plan.num_micro_batches,
    }
    if plan.pp > 1:
        values["parallelism.pipeline_parallel_schedule"] = SCHEDULES[plan.schedule]
        values["parallelism.pipeline_parallel_microbatch_size"] = plan.micro_batch_size
    return values


def render(plan: Any) -> str:
    lines = comment_lines(plan, "torchtitan")
    mode = uniform_recompute(plan)
    policy = AC_POLICIES.get(mode)
    lines.append(f"{AC_COMMENT} {mode}" + (f" (the job config's {policy} policy)" if policy else ""))
    if plan.pp > 1:
        lines.append(f"# stages as planned (torchtitan's own split may differ): {plan.stages}")
    for name, value in options(plan).items():
        if isinstance(value, bool):  # tyro's flags: --section.name / --section.no_name
            section, _, field_name = name.rpartition(".")
            lines.append(f"--{name}" if value else f"--{section}.no_{field_name}")
        else:
            lines.append(f"--{name}={value}")
    return "\n".join(lines) + "\n"


DEGREES = {"tensor_parallel_degree": "tp", "pipeline_parallel_degree": "pp", "context_parallel_degree": "cp",
           "expert_parallel_degree": "ep"}


def read(text: str) -> EngineSettings:
    """The plan.* and train.* settings of torchtitan overrides (``--parallelism.*``, ``--training.*``);
    other options are listed as ignored."""
    settings = EngineSettings("torchtitan")
    values = argument_pairs(text, separator="=")
    parallel = {key.removeprefix("parallelism."): value for key, value in values.items()
                if key.startswith("parallelism.")}
    training = {key.removeprefix("training."): value for key, value in values.items() if key.startswith("training.")}
    known_parallel = {*DEGREES, "data_parallel_replicate_degree", "data_parallel_shard_degree",
                      "fsdp_reshard_after_forward",
                      "enable_sequence_parallel", "no_enable_sequence_parallel", "pipeline_parallel_schedule",
                      "pipeline_parallel_microbatch_size"}
    settings.ignored += [f"--{key}" for key in values if key != "activation_checkpoint.mode"
                         and not key.startswith(("parallelism.", "training."))
                         or (key.startswith("parallelism.") and key.removeprefix("parallelism.") not in known_parallel)
                         or (key.startswith("training.") and key.removeprefix("training.") not in
                             ("local_batch_size", "global_batch_size"))]
    for key, axis in DEGREES.items():
        if key in parallel:
            settings.pin(f"plan.{axis}", int(parallel[key]))
    replicate = int(parallel.get("data_parallel_replicate_degree", 1))
    shard = int(parallel.get("data_parallel_shard_degree", -1))
    if shard > 1:
        settings.pin("plan.zero_stage", 2 if parallel.get("fsdp_reshard_after_forward") == "never" else 3)
        if replicate > 1:
            settings.pin("plan.hybrid_shard", True)
        settings.pin("plan.dp", replicate * shard)
    elif shard == 1:
        settings.pin("plan.zero_stage", 0)
        settings.pin("plan.dp", replicate)
    else:  # -1: every rank the other degrees leave (torchtitan's default), sharded
        settings.pin("plan.zero_stage", 3)
    tp = int(parallel.get("tensor_parallel_degree", 1))
    settings.sizes.update(replicate=replicate, shard=shard, tp=tp, pp=int(parallel.get("pipeline_parallel_degree", 1)),
                          cp=int(parallel.get("context_parallel_degree", 1)))
    for key in ("global_batch_size", "local_batch_size"):
        if key in training:
            settings.sizes[key] = int(training[key])
    sequence_parallel = "no_enable_sequence_parallel" not in parallel and \
        parallel.get("enable_sequence_parallel", "true").lower() not in ("false", "0")
    settings.pin("plan.sequence_parallel", tp > 1 and sequence_parallel)
    if int(parallel.get("context_parallel_degree", 1)) > 1:
        settings.pin("plan.cp_strategy", CPStrategy.RING)
    if int(parallel.get("pipeline_parallel_degree", 1)) > 1:
        schedule = parallel.get("pipeline_parallel_schedule", "1F1B")
        names = {value: key for key, value in SCHEDULES.items()}
        if schedule not in names:
            settings.refuse(f"--parallelism.pipeline_parallel_schedule={schedule} (autopar prices "
                            f"{', '.join(SCHEDULES.values())})")
        else:
            settings.pin("plan.schedule", names[schedule])
        if "pipeline_parallel_microbatch_size" in parallel:
            settings.pin("plan.micro_batch_size", int(parallel["pipeline_parallel_microbatch_size"]))
    elif "local_batch_size" in training:
        settings.pin("plan.micro_batch_size", int(training["local_batch_size"]))
    # Activation checkpointing is a policy object of the job's config: read from the comment this
    # module writes, or from --activation_checkpoint.mode (torchtitan's spelling before 0.3).
    mode = values.get("activation_checkpoint.mode") or next(
        (line.split(":", 1)[1].split()[0] for line in text.splitlines() if line.startswith(AC_COMMENT)), None)
    if mode is not None:
        if mode not in RECOMPUTE_OPTIONS:
            settings.refuse(f"activation checkpointing {mode!r} (autopar prices none, selective and full)")
        else:
            settings.pin("plan.recompute", mode)
    if "global_batch_size" in training and int(training["global_batch_size"]) > 0:
        settings.pin("train.global_batch_size", int(training["global_batch_size"]))
    return settings


def rules(settings: EngineSettings, world_size: int) -> list[str]:
    """torchtitan's own checks (ParallelDims._validate; the trainer's batch arithmetic): the degrees
    multiply to the world size (a shard degree of -1 takes what the others leave), and the global
    batch is a whole number of local batches per data-parallel rank."""
    sizes = settings.sizes
    others = sizes["replicate"] * sizes["tp"] * sizes["pp"] * sizes["cp"]
    if sizes["shard"] == -1:
        if world_size % others:
            return [f"a world size of {world_size} is not divisible by the other degrees' product {others} "
                    "(data_parallel_shard_degree=-1 takes what they leave)"]
        shard = world_size // others
    else:
        shard = sizes["shard"]
        if others * shard != world_size:
            return [f"the degrees multiply to {others * shard}, not the world size {world_size}"]
    dp = sizes["replicate"] * shard
    total, local = sizes.get("global_batch_size", -1), sizes.get("local_batch_size")
    if total > 0 and local is not None and total % (local * dp):
        return [f"--training.global_batch_size {total} is not a multiple of --training.local_batch_size {local} x "
                f"data-parallel degree {dp}"]
    return []


WRITER = EngineWriter("torchtitan", "torchtitan_args.txt", refusal, render, layout_refusal, read, rules,
                      selective_runtime="torchtitan_op")

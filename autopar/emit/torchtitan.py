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

from autopar.emit import EngineWriter, comment_lines, common_refusal, uniform_recompute

SCHEDULES = {"1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B", "gpipe": "GPipe"}


def refusal(plan: Any) -> str | None:
    if plan.zero_stage == 1 and plan.dp > 1:
        return "torchtitan has no ZeRO-1 (its data parallelism is FSDP or DDP); pin plan.zero_stage=2 or 3"
    if plan.zero_stage == 0 and plan.dp > 1 and plan.world_size > plan.dp:
        return "torchtitan's DDP runs only alone, not beside other parallelism; pin plan.zero_stage=2 or 3"
    if plan.hybrid_shard:
        return "hybrid sharding's group size is not one of torchtitan's settings here; pin plan.hybrid_shard=false"
    if plan.cp > 1 and plan.cp_strategy != "ring":
        return "torchtitan's context parallelism is a ring; pin plan.cp_strategy=ring"
    return common_refusal(plan, "torchtitan")


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
    policy = {"full": "FullAC", "selective": "SelectiveAC"}.get(mode)
    lines.append(f"# activation checkpointing: {mode}" + (f" (the job config's {policy} policy)" if policy else ""))
    if plan.pp > 1:
        lines.append(f"# stages as planned (torchtitan's own split may differ): {plan.stages}")
    for name, value in options(plan).items():
        if isinstance(value, bool):  # tyro's flags: --section.name / --section.no_name
            section, _, field_name = name.rpartition(".")
            lines.append(f"--{name}" if value else f"--{section}.no_{field_name}")
        else:
            lines.append(f"--{name}={value}")
    return "\n".join(lines) + "\n"


WRITER = EngineWriter("torchtitan", "torchtitan_args.txt", refusal, render)

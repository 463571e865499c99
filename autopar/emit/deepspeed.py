"""DeepSpeed: a config JSON (``deepspeed.initialize(config="deepspeed.json")``) with the plan's ZeRO
stage, micro-batch, gradient accumulation, precision and clipping.

A DeepSpeed config runs data parallelism and ZeRO; tensor, pipeline and context parallelism are
written in the model's code (Megatron-DeepSpeed, PipelineModule), and DeepSpeed does not run
ZeRO-2/3 with its pipeline, so plans with them are refused. Activation checkpointing is the
model's own call (``model.gradient_checkpointing_enable()`` for Hugging Face models): full
recomputation is written as DeepSpeed's checkpointing section, selective is refused.
"""
from __future__ import annotations

import json
from typing import Any

from autopar.emit import EngineSettings, EngineWriter, common_refusal, uniform_recompute
from autopar.domain.vocabulary import Recompute


def layout_refusal(plan: Any) -> str | None:
    """What of the plan's degrees and techniques the engine cannot run (a Plan or a search candidate)."""
    for axis in ("tp", "pp", "cp", "ep"):
        if getattr(plan, axis) > 1:
            degree = getattr(plan, axis)
            return f"a DeepSpeed config sets data parallelism and ZeRO only ({axis}={degree} is model code)"
    if plan.hybrid_shard:
        return "hybrid sharding is not DeepSpeed's ZeRO (hpZ partitions differently); pin plan.hybrid_shard=false"
    return None


def refusal(plan: Any) -> str | None:
    return layout_refusal(plan) or common_refusal(plan, "DeepSpeed", whole_blocks_only=True)


def config(plan: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.num_micro_batches,
        "zero_optimization": {"stage": plan.zero_stage},
        "bf16": {"enabled": plan.precision == "bf16"},
        "fp16": {"enabled": plan.precision == "fp16"},
        "gradient_clipping": 1.0,
    }
    if uniform_recompute(plan) == Recompute.FULL:
        settings["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False}
    return settings


def render(plan: Any) -> str:
    return json.dumps(config(plan), indent=2) + "\n"


KNOWN = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "zero_optimization",
         "bf16", "fp16", "gradient_clipping", "activation_checkpointing", "optimizer", "scheduler",
         "steps_per_print", "wall_clock_breakdown", "communication_data_type", "fp32_allreduce")


def read(text: str) -> EngineSettings:
    """The plan.* and train.* settings of a DeepSpeed config; keys it does not price are listed as
    ignored."""
    settings = EngineSettings("deepspeed")
    try:
        values = json.loads(text)
    except json.JSONDecodeError as err:
        settings.refuse(f"not JSON ({err.msg} at line {err.lineno})")
        return settings
    settings.ignored += [key for key in values if key not in KNOWN]
    for axis in ("tp", "pp", "cp", "ep"):
        settings.pin(f"plan.{axis}", 1)
    stage = int(values.get("zero_optimization", {}).get("stage", 0))
    if stage not in (0, 1, 2, 3):
        settings.refuse(f"zero_optimization.stage {stage} (DeepSpeed's stages are 0-3)")
    settings.pin("plan.zero_stage", stage)
    if all(values.get(precision, {}).get("enabled") for precision in ("bf16", "fp16")):
        settings.refuse("bf16 and fp16 both enabled (DeepSpeed runs one)")
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if key in values:
            settings.sizes[key] = int(values[key])
    if "train_micro_batch_size_per_gpu" in values:
        settings.pin("plan.micro_batch_size", int(values["train_micro_batch_size_per_gpu"]))
    if "train_batch_size" in values:
        settings.pin("train.global_batch_size", int(values["train_batch_size"]))
    for precision in ("bf16", "fp16"):
        if values.get(precision, {}).get("enabled"):
            settings.pin("train.precision", precision)
    if "activation_checkpointing" in values:
        settings.pin("plan.recompute", Recompute.FULL)
    # What gradients are reduced in (unset: the 16-bit gradients under fp16, the engine's default).
    reduced = values.get("communication_data_type")
    if values.get("fp32_allreduce") or reduced in ("fp32", "float32"):
        settings.pin("train.grad_reduce_dtype", "fp32")
    elif reduced in ("fp16", "bf16"):
        settings.pin("train.grad_reduce_dtype", "compute")
    return settings


def rules(settings: EngineSettings, world_size: int) -> list[str]:
    """DeepSpeed's batch check (DeepSpeedConfig._batch_assertion): the batch is micro-batch x
    accumulation x ranks; two of the three given, the third must come out whole."""
    total = settings.sizes.get("train_batch_size")
    micro = settings.sizes.get("train_micro_batch_size_per_gpu")
    steps = settings.sizes.get("gradient_accumulation_steps")
    if total is not None and micro is not None and steps is not None and total != micro * steps * world_size:
        return [f"train_batch_size {total} is not train_micro_batch_size_per_gpu {micro} x "
                f"gradient_accumulation_steps {steps} x {world_size} ranks"]
    per_rank = micro or steps  # the one of the two given
    if total is not None and per_rank and total % (per_rank * world_size):
        given = "train_micro_batch_size_per_gpu" if micro else "gradient_accumulation_steps"
        return [f"train_batch_size {total} is not divisible by {given} {micro or steps} x {world_size} ranks"]
    return []


# Under fp16 DeepSpeed's ZeRO reduces the 16-bit gradients (fp32_allreduce is off by default).
WRITER = EngineWriter("deepspeed", "deepspeed.json", refusal, render, layout_refusal, read, rules,
                      fp16_grad_reduce_dtype="compute")

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

from autopar.emit import EngineWriter, common_refusal, uniform_recompute


def refusal(plan: Any) -> str | None:
    for axis in ("tp", "pp", "cp", "ep"):
        if getattr(plan, axis) > 1:
            return f"a DeepSpeed config sets data parallelism and ZeRO only ({axis}={getattr(plan, axis)} is model code)"
    if plan.hybrid_shard:
        return "hybrid sharding is not DeepSpeed's ZeRO (hpZ partitions differently); pin plan.hybrid_shard=false"
    if uniform_recompute(plan) == "selective":
        return "DeepSpeed checkpoints whole layers only; pin plan.recompute=full or none"
    return common_refusal(plan, "DeepSpeed")


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
    if uniform_recompute(plan) == "full":
        settings["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False}
    return settings


def render(plan: Any) -> str:
    return json.dumps(config(plan), indent=2) + "\n"


WRITER = EngineWriter("deepspeed", "deepspeed.json", refusal, render)

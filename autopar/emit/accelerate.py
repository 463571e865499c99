"""accelerate: a config file for ``accelerate launch --config_file accelerate_fsdp.yaml`` running
FSDP2 (ZeRO-3: reshard after forward; ZeRO-2: not) with its tensor- and context-parallel sizes.

accelerate has no pipeline parallelism and no ZeRO-0/1 under FSDP (that is its DDP launch), so
such plans are refused; blocks are wrapped by the model's own ``_no_split_modules`` (Hugging Face
models) through TRANSFORMER_BASED_WRAP; selective recomputation is not one of its settings.
"""
from __future__ import annotations

from typing import Any

import yaml

from autopar.emit import EngineSettings, EngineWriter, common_refusal, uniform_recompute
from autopar.domain.vocabulary import CPStrategy, Recompute


def layout_refusal(plan: Any) -> str | None:
    """What of the plan's degrees and techniques the engine cannot run (a Plan or a search candidate)."""
    if plan.pp > 1:
        return "accelerate has no pipeline parallelism; pin plan.pp=1"
    if plan.ep > 1:
        return "accelerate has no expert parallelism; pin plan.ep=1"
    if plan.zero_stage < 2:
        return f"accelerate's FSDP shards gradients and parameters (ZeRO-2/3), not ZeRO-{plan.zero_stage}; pin " \
               "plan.zero_stage=2 or 3"
    if plan.hybrid_shard:
        return "hybrid sharding's replica groups are not written here; pin plan.hybrid_shard=false"
    if plan.cp > 1 and plan.cp_strategy != CPStrategy.RING:
        return "accelerate's context parallelism (torch's) is a ring; pin plan.cp_strategy=ring"
    return None


def refusal(plan: Any) -> str | None:
    return layout_refusal(plan) or common_refusal(plan, "accelerate", whole_blocks_only=True)


def config(plan: Any) -> dict[str, Any]:
    nodes = int(plan.provenance.cluster_config.get("nodes") or 1)
    settings: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "mixed_precision": {"bf16": "bf16", "fp16": "fp16"}.get(plan.precision, "no"),
        "num_machines": nodes,
        "num_processes": plan.world_size,
        "machine_rank": 0,
        "fsdp_config": {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": plan.zero_stage == 3,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_activation_checkpointing": uniform_recompute(plan) == Recompute.FULL,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        },
    }
    if plan.tp > 1 or plan.cp > 1:
        settings["parallelism_config"] = {"parallelism_config_dp_replicate_size": 1,
                                          "parallelism_config_dp_shard_size": plan.dp,
                                          "parallelism_config_tp_size": plan.tp,
                                          "parallelism_config_cp_size": plan.cp}
    return settings


def render(plan: Any) -> str:
    return yaml.safe_dump(config(plan), sort_keys=False)


def read(text: str) -> EngineSettings:
    """The plan.* and train.* settings of an accelerate config running FSDP."""
    settings = EngineSettings("accelerate")
    try:
        values = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        settings.refuse(f"not YAML ({err})")
        return settings
    if values.get("distributed_type") != "FSDP":
        settings.refuse(f"distributed_type {values.get('distributed_type')!r}: only FSDP configs are read")
        return settings
    fsdp = values.get("fsdp_config", {})
    settings.pin("plan.zero_stage", 3 if fsdp.get("fsdp_reshard_after_forward", True) in (True, "FULL_SHARD") else 2)
    settings.pin("plan.recompute", Recompute.FULL if fsdp.get("fsdp_activation_checkpointing") else Recompute.NONE)
    sizes = values.get("parallelism_config") or {}
    for key, axis in (("parallelism_config_tp_size", "tp"), ("parallelism_config_cp_size", "cp")):
        settings.pin(f"plan.{axis}", int(sizes.get(key, 1)))
    for key in ("dp_replicate", "dp_shard", "tp", "cp"):
        if f"parallelism_config_{key}_size" in sizes:
            settings.sizes[key] = int(sizes[f"parallelism_config_{key}_size"])
    settings.pin("plan.pp", 1)
    if int(sizes.get("parallelism_config_cp_size", 1)) > 1:
        settings.pin("plan.cp_strategy", CPStrategy.RING)
    precision = values.get("mixed_precision", "no")
    settings.pin("train.precision", {"bf16": "bf16", "fp16": "fp16"}.get(precision, "fp32"))
    return settings


def rules(settings: EngineSettings, world_size: int) -> list[str]:
    """accelerate's ParallelismConfig: its sizes, where the file gives them all, multiply to the
    world size."""
    sizes = settings.sizes
    if "dp_shard" not in sizes:
        return []
    total = sizes.get("dp_replicate", 1) * sizes["dp_shard"] * sizes.get("tp", 1) * sizes.get("cp", 1)
    if total != world_size:
        return [f"parallelism_config's sizes multiply to {total}, not the world size {world_size}"]
    return []


WRITER = EngineWriter("accelerate", "accelerate_fsdp.yaml", refusal, render, layout_refusal, read, rules)

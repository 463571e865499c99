"""Megatron-LM / NeMo: the arguments of ``pretrain_gpt.py`` that carry the plan, one per line
(``torchrun ... pretrain_gpt.py <model arguments> $(grep -v '^#' megatron_args.txt)``).

Megatron shards optimizer states with its distributed optimizer (ZeRO-1) and keeps gradients and
parameters whole on each data-parallel rank, so ZeRO-2/3 plans are refused; its sequence
parallelism needs tensor parallelism (megatron-core refuses it otherwise, as the plan never has it).
"""
from __future__ import annotations

from typing import Any

from autopar.emit import EngineSettings, EngineWriter, argument_pairs, comment_lines, common_refusal, uniform_recompute
from autopar.domain.vocabulary import CPStrategy, Recompute, Schedule

CP_COMM = {CPStrategy.RING: "p2p", CPStrategy.ULYSSES: "a2a"}


def layout_refusal(plan: Any) -> str | None:
    """What of the plan's degrees and techniques the engine cannot run (a Plan or a search candidate)."""
    if plan.zero_stage >= 2 and plan.dp > 1:
        return (f"Megatron-LM's distributed optimizer is ZeRO-1 (gradients and parameters whole on each rank), "
                f"not ZeRO-{plan.zero_stage}; pin plan.zero_stage=1")
    if plan.hybrid_shard:
        return "Megatron-LM has no hybrid sharding; pin plan.hybrid_shard=false"
    if plan.pp > 1 and plan.schedule == Schedule.GPIPE:
        return "Megatron-LM runs 1F1B (interleaved or not), not GPipe; pin plan.schedule=1f1b"
    return None


def refusal(plan: Any) -> str | None:
    return layout_refusal(plan) or common_refusal(plan, "Megatron-LM")


def arguments(plan: Any) -> dict[str, Any]:
    """Argument -> value (True: a flag) in Megatron-LM's spelling."""
    values: dict[str, Any] = {
        "tensor-model-parallel-size": plan.tp,
        "pipeline-model-parallel-size": plan.pp,
        "context-parallel-size": plan.cp,
        "expert-model-parallel-size": plan.ep,
        "expert-tensor-parallel-size": plan.tp if plan.expert_tp else 1,
        "micro-batch-size": plan.micro_batch_size,
        "global-batch-size": plan.global_batch_size,
    }
    if plan.pp > 1 and plan.chunks > 1:
        values["num-virtual-stages-per-pipeline-rank"] = plan.chunks
    if plan.cp > 1:
        values["cp-comm-type"] = CP_COMM[plan.cp_strategy]
    if plan.sequence_parallel:
        values["sequence-parallel"] = True
    if plan.zero_stage == 1 and plan.dp > 1:
        values["use-distributed-optimizer"] = True
    mode = uniform_recompute(plan)
    if mode == Recompute.FULL:
        values.update({"recompute-granularity": "full", "recompute-method": "uniform", "recompute-num-layers": 1})
    elif mode == Recompute.SELECTIVE:
        values["recompute-granularity"] = "selective"
    if plan.precision in ("bf16", "fp16"):
        values[plan.precision] = True
    return values


def render(plan: Any) -> str:
    lines = comment_lines(plan, "Megatron-LM")
    for name, value in arguments(plan).items():
        lines.append(f"--{name}" if value is True else f"--{name} {value}")
    return "\n".join(lines) + "\n"


SIZES = {"tensor-model-parallel-size": "tp", "pipeline-model-parallel-size": "pp", "context-parallel-size": "cp",
         "expert-model-parallel-size": "ep", "micro-batch-size": "micro_batch_size",
         "num-virtual-stages-per-pipeline-rank": "chunks"}
# --checkpoint-activations: the 2021 spelling of full recomputation (Megatron-LM's SC21 scripts).
FLAGS = ("sequence-parallel", "use-distributed-optimizer", "bf16", "fp16", "checkpoint-activations",
         "accumulate-allreduce-grads-in-fp32", "grad-reduce-in-bf16")
OTHERS = ("global-batch-size", "expert-tensor-parallel-size", "cp-comm-type", "recompute-granularity",
          "recompute-method", "recompute-num-layers", "num-layers-per-virtual-pipeline-stage", "num-layers")


def read(text: str) -> EngineSettings:
    """The plan.* and train.* settings of Megatron-LM arguments (the file `render` writes, or a
    launch command's arguments); arguments about anything else are listed as ignored."""
    settings = EngineSettings("megatron")
    values = argument_pairs(text, flags=FLAGS)
    for name, value in values.items():
        if name in SIZES:
            settings.pin(f"plan.{SIZES[name]}", int(value))
        elif name not in FLAGS and name not in OTHERS:
            settings.ignored.append(f"--{name}")
    pp = int(values.get("pipeline-model-parallel-size", 1))
    if "num-layers-per-virtual-pipeline-stage" in values:  # the older spelling: layers per virtual stage
        if "num-layers" not in values:
            settings.refuse("--num-layers-per-virtual-pipeline-stage without --num-layers (the chunks per rank "
                            "follow from both)")
        else:
            per_rank = int(values["num-layers"]) // pp
            settings.pin("plan.chunks", per_rank // int(values["num-layers-per-virtual-pipeline-stage"]))
    chunks = int(settings.pins.get("plan.chunks", 1))
    if pp > 1:
        settings.pin("plan.schedule", Schedule.INTERLEAVED_1F1B if chunks > 1 else Schedule.ONE_F_ONE_B)
    settings.pin("plan.sequence_parallel", "sequence-parallel" in values)
    settings.pin("plan.zero_stage", 1 if "use-distributed-optimizer" in values else 0)
    if "expert-tensor-parallel-size" in values:
        settings.pin("plan.expert_tp", int(values["expert-tensor-parallel-size"]) > 1)
    if "cp-comm-type" in values:
        comm = {value: key for key, value in CP_COMM.items()}
        if values["cp-comm-type"] not in comm:
            settings.refuse(f"--cp-comm-type {values['cp-comm-type']} (autopar prices p2p as ring, a2a as ulysses)")
        else:
            settings.pin("plan.cp_strategy", comm[values["cp-comm-type"]])
    tp = int(values.get("tensor-model-parallel-size", 1))
    if "sequence-parallel" in values and tp == 1:
        settings.pin("plan.sequence_parallel", False)
        settings.notes.append("--sequence-parallel with a tensor-parallel size of 1: Megatron-LM turns it off "
                              "(priced without)")
    if chunks > 1 and pp == 1:
        settings.refuse("virtual pipeline stages without pipeline parallelism (Megatron-LM needs "
                        "--pipeline-model-parallel-size > 1 to interleave)")
    for name in ("global-batch-size", "micro-batch-size", "num-layers", "context-parallel-size"):
        if name in values:
            settings.sizes[name] = int(values[name])
    settings.sizes.update(tp=tp, pp=pp, chunks=chunks)
    granularity = values.get("recompute-granularity") or ("full" if "checkpoint-activations" in values else None)
    settings.pin("plan.recompute", granularity or Recompute.NONE)
    if "global-batch-size" in values:
        settings.pin("train.global_batch_size", int(values["global-batch-size"]))
    for precision in ("bf16", "fp16"):
        if precision in values:
            settings.pin("train.precision", precision)
    # What gradients are reduced in (unset: the engine's default, 16-bit under fp16, fp32 under bf16).
    if "grad-reduce-in-bf16" in values:
        settings.pin("train.grad_reduce_dtype", "compute")
    elif "accumulate-allreduce-grads-in-fp32" in values:
        settings.pin("train.grad_reduce_dtype", "fp32")
    return settings


def rules(settings: EngineSettings, world_size: int) -> list[str]:
    """Megatron-LM's own checks of its arguments (megatron/training/arguments.py's validate_args)."""
    sizes = settings.sizes
    tp, pp, cp = sizes["tp"], sizes["pp"], sizes.get("context-parallel-size", 1)
    problems = []
    if world_size % (tp * pp * cp):
        return [f"a world size of {world_size} is not divisible by tensor x pipeline x context parallel sizes "
                f"{tp} x {pp} x {cp}"]
    dp = world_size // (tp * pp * cp)
    micro, total = sizes.get("micro-batch-size", 1), sizes.get("global-batch-size")
    if total is not None and total % (micro * dp):
        problems.append(f"--global-batch-size {total} is not divisible by --micro-batch-size {micro} x "
                        f"data-parallel size {dp}")
    layers = sizes.get("num-layers")
    if layers is not None and layers % (pp * sizes["chunks"]):
        problems.append(f"--num-layers {layers} is not divisible by the pipeline's {pp} stages x "
                        f"{sizes['chunks']} virtual stages")
    return problems


# Megatron-LM's tensor parallelism runs on plain tensors with explicit collectives: no DTensor
# dispatch on the host (cost_models.host), priced so under plan.engine=megatron.
# Under fp16 Megatron-LM all-reduces the 16-bit gradients unless --accumulate-allreduce-grads-in-fp32
# (under bf16 it turns that on itself).
WRITER = EngineWriter("megatron", "megatron_args.txt", refusal, render, layout_refusal, read, rules, tp_runtime="plain",
                      fp16_grad_reduce_dtype="compute")

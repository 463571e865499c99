"""Megatron-LM / NeMo: the arguments of ``pretrain_gpt.py`` that carry the plan, one per line
(``torchrun ... pretrain_gpt.py <model arguments> $(grep -v '^#' megatron_args.txt)``).

Megatron shards optimizer states with its distributed optimizer (ZeRO-1) and keeps gradients and
parameters whole on each data-parallel rank, so ZeRO-2/3 plans are refused; its sequence
parallelism needs tensor parallelism (megatron-core refuses it otherwise, as the plan never has it).
"""
from __future__ import annotations

from typing import Any

from autopar.emit import EngineWriter, comment_lines, common_refusal, uniform_recompute

CP_COMM = {"ring": "p2p", "ulysses": "a2a"}


def refusal(plan: Any) -> str | None:
    if plan.zero_stage >= 2 and plan.dp > 1:
        return (f"Megatron-LM's distributed optimizer is ZeRO-1 (gradients and parameters whole on each rank), "
                f"not ZeRO-{plan.zero_stage}; pin plan.zero_stage=1")
    if plan.hybrid_shard:
        return "Megatron-LM has no hybrid sharding; pin plan.hybrid_shard=false"
    if plan.pp > 1 and plan.schedule == "gpipe":
        return "Megatron-LM runs 1F1B (interleaved or not), not GPipe; pin plan.schedule=1f1b"
    return common_refusal(plan, "Megatron-LM")


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
    if mode == "full":
        values.update({"recompute-granularity": "full", "recompute-method": "uniform", "recompute-num-layers": 1})
    elif mode == "selective":
        values["recompute-granularity"] = "selective"
    values[{"bf16": "bf16", "fp16": "fp16"}.get(plan.precision, "")] = True
    values.pop("", None)
    return values


def render(plan: Any) -> str:
    lines = comment_lines(plan, "Megatron-LM")
    for name, value in arguments(plan).items():
        lines.append(f"--{name}" if value is True else f"--{name} {value}")
    return "\n".join(lines) + "\n"


WRITER = EngineWriter("megatron", "megatron_args.txt", refusal, render)

"""The plan's vocabulary: the enums every stage speaks (mesh axes, pipeline schedule, recomputation,
tensor-parallel styles, ZeRO stage, gradient synchronisation, context-parallel strategy, expert
dispatch) and the spellings a plan file or Hydra override may use.

The enums are `StrEnum` / `IntEnum`, so a member equals its spelling in a plan file or a Hydra
override ("1f1b", 2) and serialises as it. Which values can be chosen (searched or pinned) is the
technique registry's (`autopar.domain.techniques`), which, like the layout (`autopar.domain.layout`),
imports its words from here.
"""
from __future__ import annotations

from enum import IntEnum, StrEnum


class MeshAxis(StrEnum):
    """A DeviceMesh axis (torchtitan's vocabulary: *axis* for the mesh, *dim* for a tensor)."""

    TP = "tp"
    CP = "cp"
    PP = "pp"
    DP = "dp"


class Schedule(StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"


class Recompute(StrEnum):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class TPStyle(StrEnum):
    """What the operator-wise split does with a parameterised module (names follow torch's TP styles)."""

    REPLICATE = "replicate"
    COLWISE = "colwise"
    ROWWISE = "rowwise"
    VOCAB_PARALLEL = "vocab_parallel"  # embedding sharded on rows: RowwiseParallel on nn.Embedding
    HIDDEN_PARALLEL = "hidden_parallel"  # embedding sharded on columns: ColwiseParallel on nn.Embedding
    # A key/value projection of grouped-query attention with fewer heads than TP ranks: each rank
    # computes its group's head (weight split by rows, gathered each forward, its gradient
    # reduce-scattered); autopar.solver.tp_kv_groups
    KV_GROUP = "kv_group"
    # A norm over each attention head's features (Qwen3's q_norm) on the rank's heads: weight
    # whole, its gradient all-reduced; autopar.solver.tp_head_norms. Splits no parameter.
    HEAD_NORM = "head_norm"


class ZeroStage(IntEnum):
    """What ZeRO shards over the gradient (data- x context-parallel) group."""

    NONE = 0  # replicated states (DDP)
    OPTIMIZER = 1
    GRADIENTS = 2
    PARAMETERS = 3  # FSDP


class DPSync(StrEnum):
    """Gradient synchronisation of ZeRO-0/1 (AUTO: the cheapest, chosen by the pricer)."""

    AUTO = "auto"
    RING = "ring"
    TREE = "tree"
    HIERARCHICAL = "hierarchical"
    PS = "ps"
    HALVING_DOUBLING = "halving_doubling"  # recursive halving-doubling (gradient_sync.py)
    # What a plan file records where no algorithm was chosen: FSDP's reduce-scatter (ZeRO-2/3,
    # context parallelism) or nothing to synchronise (one gradient replica). Not pinnable.
    REDUCE_SCATTER = "reduce_scatter"
    NONE = "none"


class CPStrategy(StrEnum):
    ULYSSES = "ulysses"  # all-to-all of heads (Jacobs et al. 2023)
    RING = "ring"  # K/V passed around the ring (Liu et al. 2023)


class ExpertDispatch(StrEnum):
    """How an expert-parallel group moves tokens to their experts' ranks and back (the names of
    Megatron-Core's token dispatchers)."""

    ALL_TO_ALL = "all_to_all"  # each rank sends each other rank the tokens routed to its experts


AXES = tuple(a.value for a in MeshAxis)
SCHEDULES = tuple(s.value for s in Schedule)
CP_STRATEGIES = tuple(s.value for s in CPStrategy)
RECOMPUTE_OPTIONS = tuple(r.value for r in Recompute)
PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adam", "sgd", "sgd_plain")  # adam: two fp32 states, sgd: momentum, sgd_plain: none
TP_RUNTIMES = ("dtensor", "plain", "megatron_core")  # see TrainSpec.tp_runtime
ZERO3_RUNTIMES = ("fsdp2", "deepspeed_2021")  # see TrainSpec.zero3_runtime
SELECTIVE_RUNTIMES = ("autopar", "torchtitan_op")  # see TrainSpec.selective_runtime
GRAD_REDUCE_DTYPES = ("fp32", "compute")  # see TrainSpec.grad_reduce_dtype
# The settings that say how a run executes what a plan decides, for pricing (TrainSpec's; a plan
# records them): their values.
RUNTIME_CHOICES = {"tp_runtime": TP_RUNTIMES, "zero3_runtime": ZERO3_RUNTIMES,
                   "selective_runtime": SELECTIVE_RUNTIMES, "grad_reduce_dtype": GRAD_REDUCE_DTYPES}


def unknown_choices(settings: object, choices: dict[str, tuple[str, ...]]) -> list[str]:
    """One sentence per attribute of ``settings`` named in ``choices`` whose value is not among its."""
    return [f"{name} '{getattr(settings, name)}' is not one of {', '.join(known)}"
            for name, known in choices.items() if getattr(settings, name) not in known]
# Gradient bytes per bucket of a plan's exchange where none was sized (DDP's default bucket_cap_mb).
DP_BUCKET_BYTES = 25 * 2**20

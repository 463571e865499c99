"""Structured configs: the schema Hydra validates every preset and override against.

Config groups (conf/): ``cluster/``, ``train/``, ``solver/`` and ``plan/`` hold presets extending
these dataclasses (the cluster schema, `ClusterConfig`, lives with the cost model).
``model.<name>=<value>`` overrides are free-form: they become keyword arguments of the user's
build_model() / example_batch() and are checked against those signatures instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from cost_models.topology import ClusterConfig


@dataclass
class TrainConfig:
    """How the model is trained: what the planner must fit and what it optimises for."""

    global_batch_size: int = 8
    """Samples per optimizer step across all data-parallel ranks."""
    micro_batch_size: int = 1
    """Samples per micro-batch; `autopar profile` traces a batch of this size."""
    precision: str = "bf16"
    """fp32, or bf16/fp16 mixed precision (the model is traced under autocast to that dtype)."""
    optimizer: str = "adam"
    """adam (two fp32 states per parameter) or sgd (momentum only)."""


@dataclass
class SolverConfig:
    """How the planner searches (everything not pinned under plan.* is searched)."""

    objective: str = "throughput"
    """throughput (fastest plan that fits), memory (least memory within 5% of the fastest), or
    min_gpus (fewest GPUs reaching target_tokens_per_s)."""
    target_tokens_per_s: float = 0.0
    """Throughput to reach with objective=min_gpus."""
    time_limit_s: float = 60.0
    """Wall-clock budget for the whole search; the best plan so far is returned with its gap (the
    search always runs until it has found one plan, however short the budget)."""
    threads: int = 1
    """CP-SAT worker threads (1 keeps runs reproducible and fits small machines)."""
    seed: int = 0
    """CP-SAT random seed; with threads=1 the same inputs give the same plan."""
    top_k: int = 5
    """Runners-up to report with the reason each lost."""
    allow_cross_node_tp: bool = False
    """Let a tensor-parallel group span nodes (slow links; off as in every production setup)."""
    max_micro_batch_size: int = 16
    """Largest micro-batch size considered."""
    schedules: list[str] = field(default_factory=lambda: ["gpipe", "1f1b", "interleaved_1f1b"])
    """Pipeline schedules considered."""
    recompute_options: list[str] = field(default_factory=lambda: ["none", "selective", "full"])
    """Per-layer activation recomputation choices considered."""
    zero_stages: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    """ZeRO stages considered when there is data parallelism."""
    interleave_chunks: list[int] = field(default_factory=lambda: [2, 4])
    """Model chunks per pipeline rank considered for the interleaved schedule."""
    max_tp: int = 0
    """Largest tensor-parallel degree searched (0: no bound beyond the node and the heads)."""
    max_pp: int = 0
    """Largest pipeline-parallel degree searched (0: up to the number of layers)."""
    max_cp: int = 0
    """Largest context-parallel degree searched (0: no bound beyond the sequence)."""


@dataclass
class PlanPins:
    """Fixed choices: a value pins that decision, null (the default) leaves it to the solver."""

    dp: int | None = None
    """Data-parallel degree."""
    tp: int | None = None
    """Tensor-parallel degree."""
    pp: int | None = None
    """Pipeline-parallel degree (number of pipeline ranks)."""
    cp: int | None = None
    """Context-parallel degree (sequence split across ranks)."""
    zero_stage: int | None = None
    """ZeRO stage 0-3."""
    hybrid_shard: bool | None = None
    """Shard within a node, replicate across nodes."""
    micro_batch_size: int | None = None
    """Samples per micro-batch per data-parallel rank."""
    schedule: str | None = None
    """gpipe, 1f1b or interleaved_1f1b."""
    chunks: int | None = None
    """Model chunks per pipeline rank (interleaved schedule)."""
    recompute: str | None = None
    """none, selective or full for every layer."""
    sequence_parallel: bool | None = None
    """Sequence parallelism inside tensor-parallel groups."""
    cp_strategy: str | None = None
    """ulysses or ring."""
    dp_sync: str | None = None
    """ring, tree, hierarchical or ps."""
    dp_shares: list[int] | None = None
    """Samples per micro-batch of each data-parallel rank (uneven shares, pp=1), e.g. [3, 1];
    unset: even, or in proportion to GPU speed on mixed clusters."""
    stages: list[list[str]] | None = None
    """Layer names of each pipeline stage, in order (virtual stages for interleaved schedules);
    fixes the layer-wise split instead of solving it (pp × chunks must equal their number)."""
    blocks: list[str] | None = None
    """The block container to split the model along (its children are the layers), e.g.
    plan.blocks=[transformer.h], for when detection picks the wrong one; one stack today."""
    layer_recompute: dict[str, str] = field(default_factory=dict)
    """Per-layer recomputation (layer name -> none/selective/full; unlisted layers: none), e.g.
    plan.layer_recompute='{blocks.0: full}'; with pp > 1 it needs plan.stages as well."""


@dataclass
class AutoparConfig:
    """Root of the composed configuration."""

    model: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the model file's build_model() and example_batch()."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    solver: SolverConfig = field(default_factory=SolverConfig)
    plan: PlanPins = field(default_factory=PlanPins)


def register_configs() -> None:
    """Put the schemas in Hydra's ConfigStore (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="autopar_schema", node=AutoparConfig)
    store.store(group="cluster", name="cluster_schema", node=ClusterConfig)
    store.store(group="train", name="train_schema", node=TrainConfig)
    store.store(group="solver", name="solver_schema", node=SolverConfig)
    store.store(group="plan", name="plan_schema", node=PlanPins)


def normalise_overrides(overrides: list[str]) -> list[str]:
    """Let ``model.<name>=<value>`` add keys (the model section has no fixed schema), and a
    per-layer map replace the empty one (its keys are the model's layer names)."""
    result = []
    for item in overrides:
        if (item.startswith("model.") or item.startswith("plan.layer_recompute=")) and "=" in item:
            item = "++" + item
        result.append(item)
    return result


def compose_config(overrides: list[str] | None = None) -> Any:
    """Compose conf/config.yaml with command-line style overrides, as the CLI does.

    Raises ConfigError (one line, exit 1) for unknown keys, bad values or unknown presets.
    """
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from autopar.errors import ConfigError

    register_configs()
    try:
        with initialize_config_module(config_module="autopar.conf", version_base=None):
            return compose(config_name="config", overrides=normalise_overrides(list(overrides or [])))
    except (HydraException, OmegaConfBaseException) as err:
        message = " ".join(str(err).split())
        raise ConfigError(f"Invalid configuration: {message}",
                          "check the override's spelling against `autopar <verb> --help` and the "
                          "presets in conf/.") from None

"""What a configuration asks for, as the specs every stage takes: the model's settings, the cluster,
the training settings the cost model reads and a fully pinned layout. Built from Hydra's config
(autopar/config.py) by the CLI, the API, the driver and the benchmarks alike."""
from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import OmegaConf

from autopar.errors import ConfigError
from autopar.domain.layout import ParallelLayout, TrainSpec
from cost_models.topology import ClusterSpec
from autopar.domain.vocabulary import (GRAD_REDUCE_DTYPES, RUNTIME_CHOICES, SELECTIVE_RUNTIMES, TP_RUNTIMES,
                                       ZERO3_RUNTIMES, CPStrategy, DPSync, Recompute, Schedule)

T = TypeVar("T")


def section_values(section: Any) -> dict[str, Any]:
    """A mapping section of the configuration as plain Python values."""
    values = OmegaConf.to_container(section, resolve=True)
    assert isinstance(values, dict), f"{section} is not a mapping"
    return {str(key): value for key, value in values.items()}


def section_as(section: Any, kind: type[T]) -> T:
    """A structured section of the configuration as its dataclass (Hydra hands on a DictConfig)."""
    value = section if isinstance(section, kind) else OmegaConf.to_object(section)
    assert isinstance(value, kind), f"{section} is not a {kind.__name__}"
    return value


def model_kwargs(cfg: Any) -> dict[str, Any]:
    """The ``model.*`` section as plain Python values."""
    return section_values(cfg.model)


def build_cluster(cfg: Any) -> ClusterSpec:
    """The cluster of the cluster.* settings, refused at once beyond the supported size."""
    from autopar.config import check_cluster
    from autopar.plans import MAX_WORLD_SIZE

    check_cluster(cfg.cluster)  # every number in range (a cluster recorded in a plan comes here too)
    # Counted from the settings, before the per-node list of a billion-node cluster is built.
    groups = list(cfg.cluster.get("node_groups") or []) or [cfg.cluster]
    nodes, per_node = sum(max(0, int(g.nodes)) for g in groups), int(cfg.cluster.gpus_per_node)
    if nodes * per_node > MAX_WORLD_SIZE:
        raise ConfigError(f"The cluster has {nodes * per_node:,} GPUs ({nodes:,} nodes); autopar plans clusters of "
                          f"up to {MAX_WORLD_SIZE:,} GPUs (larger ones would not finish in bounded time).",
                          f"use at most {MAX_WORLD_SIZE // max(1, per_node):,} nodes of {per_node} GPUs "
                          "(cluster.nodes).")
    try:
        return ClusterSpec.from_config(cfg.cluster)
    except (ValueError, OSError) as err:
        raise ConfigError(f"Invalid cluster: {err}",
                          "`autopar plan --help` lists the cluster presets and fields.") from None


def _engine_setting(cfg: Any, name: str, generated: str) -> str:
    """A runtime setting of the engine plan.engine names (autopar.emit), else the generated module's."""
    engine = OmegaConf.select(cfg, "plan.engine", default=None)
    if not engine:
        return generated
    from autopar.emit import writer

    return getattr(writer(engine), name)


# How the module autopar generates runs what the train.* runtime settings describe for pricing:
# TrainSpec's defaults; the other values of those settings price runs of other engines.
GENERATED_RUNTIMES: dict[str, str] = {f"train.{name}": getattr(TrainSpec, name) for name in RUNTIME_CHOICES}


def generated_module_settings(cfg: Any) -> Any:
    """``cfg`` with the runtime settings pinned to how the generated module runs, for `autopar
    compile`: its plan is priced as the module it writes runs (plan.engine still narrows the search
    to what that engine runs, but no longer sets how the plan is priced). A setting given another
    value prices another engine's run and is refused: compile would promise a step time the
    module it writes does not run."""
    pinned = copy.deepcopy(cfg)
    for key, generated in GENERATED_RUNTIMES.items():
        value = OmegaConf.select(cfg, key, default=None)
        if value is not None and value != generated:
            raise ConfigError(f"{key}={value} prices a run of another engine, but compile writes autopar's module, "
                              f"which runs {key}={generated}: its plan and report would promise a step time the "
                              "module does not run.",
                              f"leave {key} unset to compile; to price that engine's run, use `autopar plan` or "
                              f"`autopar estimate` with {key}={value}.")
        OmegaConf.update(pinned, key, generated)
    return pinned


def train_spec(cfg: Any, model_path: str | Path | None = None) -> TrainSpec:
    """The training settings the cost model reads; with train.router_checkpoint, the tokens per
    expert measured from it (once per model, checkpoint and settings)."""
    load: tuple = ()
    tp_runtime = (OmegaConf.select(cfg, "train.tp_runtime", default=None)
                  or _engine_setting(cfg, "tp_runtime", GENERATED_RUNTIMES["train.tp_runtime"]))
    if tp_runtime not in TP_RUNTIMES:
        raise ConfigError(f"Unknown train.tp_runtime '{tp_runtime}'.",
                          "use dtensor (the generated module's tensor parallelism), plain (Megatron-style, on "
                          "plain tensors) or megatron_core (plain, with Megatron-Core's communication overlaps): "
                          "the last two for pricing runs of such engines.")
    zero3_runtime = OmegaConf.select(cfg, "train.zero3_runtime", default=GENERATED_RUNTIMES["train.zero3_runtime"])
    if zero3_runtime not in ZERO3_RUNTIMES:
        raise ConfigError(f"Unknown train.zero3_runtime '{zero3_runtime}'.",
                          "use fsdp2 (the generated module's ZeRO-3) or deepspeed_2021 (DeepSpeed's stage 3 of "
                          "2021: for pricing runs of that engine).")
    selective_runtime = (OmegaConf.select(cfg, "train.selective_runtime", default=None)
                         or _engine_setting(cfg, "selective_runtime", GENERATED_RUNTIMES["train.selective_runtime"]))
    if selective_runtime not in SELECTIVE_RUNTIMES:
        raise ConfigError(f"Unknown train.selective_runtime '{selective_runtime}'.",
                          "use autopar (the generated module's selective recomputation) or torchtitan_op "
                          "(torchtitan's op-level policy: for pricing that engine's runs).")
    grad_reduce_dtype = (OmegaConf.select(cfg, "train.grad_reduce_dtype", default=None)
                         or (_engine_setting(cfg, "fp16_grad_reduce_dtype",
                                             GENERATED_RUNTIMES["train.grad_reduce_dtype"])
                             if cfg.train.precision == "fp16" else "fp32"))
    if grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
        raise ConfigError(f"Unknown train.grad_reduce_dtype '{grad_reduce_dtype}'.",
                          "use fp32 (the generated module reduces gradients in fp32) or compute (16-bit gradients "
                          "reduced as computed: for pricing runs of engines that do so).")
    checkpoint = OmegaConf.select(cfg, "train.router_checkpoint", default=None)
    if checkpoint and model_path is not None:
        load = measured_expert_load(str(model_path), str(checkpoint), tuple(sorted(model_kwargs(cfg).items())),
                                    cfg.train.micro_batch_size, cfg.train.router_batches)
    return TrainSpec(global_batch_size=cfg.train.global_batch_size, precision=cfg.train.precision,
                     optimizer=cfg.train.optimizer, moe_imbalance=cfg.train.moe_imbalance, expert_load=load,
                     clip_grad_norm=float(OmegaConf.select(cfg, "optim.max_grad_norm", default=1.0)) > 0,
                     tp_runtime=tp_runtime, zero3_runtime=zero3_runtime, selective_runtime=selective_runtime,
                     grad_reduce_dtype=grad_reduce_dtype)


@functools.lru_cache(maxsize=4)
def measured_expert_load(model_path: str, checkpoint: str, kwargs: tuple, batch_size: int,
                         batches: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(experts module FQN, tokens each expert received) from the router checkpoint
    (autopar/trace/routing.py), as TrainSpec keeps them."""
    from autopar.model_file import load_model_file
    from autopar.trace.routing import measure_expert_load

    load = measure_expert_load(load_model_file(model_path), dict(kwargs), Path(checkpoint), batch_size, batches)
    return tuple((fqn, tuple(counts)) for fqn, counts in sorted(load.items()))


def pinned_layout(cfg: Any, cluster: ClusterSpec) -> ParallelLayout:
    """A fully specified layout from plan.* overrides; unset degrees default to 1, dp fills the rest."""
    pins = cfg.plan
    tp, pp, cp = pins.tp or 1, pins.pp or 1, pins.cp or 1
    if cluster.world_size % (tp * pp * cp):
        raise ConfigError(f"tp×pp×cp = {tp * pp * cp} does not divide the cluster's {cluster.world_size} GPUs.",
                          "change plan.tp/pp/cp or cluster.nodes.")
    dp = pins.dp or cluster.world_size // (tp * pp * cp)
    micro = pins.micro_batch_size or 1
    if cfg.train.global_batch_size % (dp * micro):
        raise ConfigError(f"train.global_batch_size={cfg.train.global_batch_size} is not a multiple of "
                          f"dp×micro_batch_size = {dp}×{micro}.", "change the batch or plan.micro_batch_size.")
    schedule = pins.schedule or (Schedule.INTERLEAVED_1F1B if (pins.chunks or 1) > 1 else Schedule.ONE_F_ONE_B)
    return ParallelLayout(dp=dp, tp=tp, pp=pp, cp=cp, ep=pins.ep or 1, expert_tp=bool(pins.expert_tp),
                          zero_stage=pins.zero_stage or 0,
                          hybrid_shard=bool(pins.hybrid_shard), micro_batch_size=micro,
                          num_micro_batches=cfg.train.global_batch_size // (dp * micro), schedule=schedule,
                          chunks=pins.chunks or 1, sequence_parallel=bool(pins.sequence_parallel),
                          cp_strategy=pins.cp_strategy or CPStrategy.ULYSSES, dp_sync=pins.dp_sync or DPSync.AUTO,
                          recompute=pins.recompute or Recompute.NONE)


def precision_note(cfg: Any) -> str | None:
    """What to tell when the requested precision is not what will run: the generated module
    computes in fp32 on CPU ranks (gloo), whatever train.precision says."""
    gpus = {cfg.cluster.gpu, *(group.gpu for group in cfg.cluster.node_groups)}
    if cfg.train.precision != "fp32" and "cpu" in gpus:
        return (f"train.precision={cfg.train.precision}: CPU ranks compute in fp32, so the generated module trains "
                f"in fp32 there (the plan is priced in {cfg.train.precision}); set train.precision=fp32 to price "
                "what runs.")
    return None


def cluster_config(cfg: Any) -> dict[str, Any]:
    return section_values(cfg.cluster)


def with_cluster_config(plan: Any, cfg: Any) -> Any:
    """Record every cluster.* setting in the plan, so it can be priced again and a replay on
    another cluster is caught."""
    from dataclasses import replace

    return plan.with_updates(provenance=replace(plan.provenance, cluster_config=cluster_config(cfg)))

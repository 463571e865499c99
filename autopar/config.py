"""Structured configs: the schema Hydra validates every preset and override against.

Config groups (autopar/conf/): ``cluster/``, ``train/``, ``optim/``, ``data/``, ``solver/`` and ``plan/`` hold
presets extending these dataclasses (the cluster schema, `ClusterConfig`, lives with the cost model).
``model.<name>=<value>`` overrides are free-form: they become keyword arguments of the user's
build_model() / example_batch() and are checked against those signatures instead.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore

from autopar.errors import ConfigError
from autopar.domain.bounds import Bound, out_of_range
from cost_models.topology import CLUSTER_BOUNDS, NODE_GROUP_BOUNDS, ClusterConfig, NodeGroupConfig
from autopar.domain.vocabulary import RECOMPUTE_OPTIONS, SCHEDULES


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
    moe_imbalance: float = 1.0
    """Mixture-of-experts routing: the most-loaded expert-parallel rank's tokens over the mean
    where the experts are exchanged dropless (1: even), what its group waits for. Experts that
    take their tokens grouped with a capacity run the same work however tokens are routed."""
    tp_runtime: str | None = None
    """How tensor parallelism runs, for pricing: dtensor (the generated module: each split module
    dispatches through DTensor on the host, cost_models.host) or plain (plain tensors and explicit
    collectives, as Megatron-LM and nanotron run it: no such host cost). Unset: the runtime of
    plan.engine (Megatron-LM's is plain, torchtitan's and accelerate's DTensor), else dtensor.
    Compile always generates the dtensor runtime; plain prices runs of those engines."""
    zero3_runtime: str = "fsdp2"
    """How ZeRO-3 runs, for pricing: fsdp2 (the generated module: one all-gather per block,
    prefetched) or deepspeed_2021 (DeepSpeed's stage 3 as published 2021 runs ran it: one
    collective per tensor, none overlapped; cost_models.deepspeed_zero3). Compile always
    generates fsdp2; deepspeed_2021 prices runs of that engine (benchmarks/published)."""
    grad_reduce_dtype: str | None = None
    """What gradients are reduced in under mixed precision, for pricing: fp32 (the generated
    module, torchtitan, Megatron-LM under bf16) or compute (16-bit gradients as computed:
    Megatron-LM and DeepSpeed under fp16). Unset: what plan.engine reduces in under this
    precision, else fp32. Compile always generates fp32 reductions."""
    selective_runtime: str | None = None
    """What selective recomputation keeps, for pricing: autopar (the generated module: products
    with a weight, attention and collectives) or torchtitan_op (torchtitan's op-level policy:
    every second matrix product of a layer rerun). Unset: plan.engine's (torchtitan's is
    torchtitan_op), else autopar. Compile always generates autopar's policy."""
    router_checkpoint: str | None = None
    """A state dict of the model (torch.save; read with weights_only) whose routers' tokens per
    expert are measured over router_batches example batches and price the busiest
    expert-parallel rank instead of moe_imbalance (autopar/trace/routing.py)."""
    router_batches: int = 8
    """Batches of example_batch the router_checkpoint's routers are measured on."""
    eval_every: int = 0
    """The compiled module's validation loss every this many steps and after the last (0: never);
    `autopar run DIR train.eval_every=N` and the module's --eval-every override it."""
    eval_batches: int = 4
    """Global batches of the validation set (or example batches no step trains on) it averages."""


# The range of every numeric field of each schema below (check_numbers reads them; a test keeps
# every numeric field of every schema listed). A value outside is refused, never replaced.
TRAIN_BOUNDS: dict[str, Bound] = {
    # 2^24 sequences a step: 4,000 times the largest published batch (LAMB's 65,536), so a typo
    # (1e20) is refused at once instead of planned, proven and failing deep inside FSDP.
    "global_batch_size": Bound(low=1, high=2**24, integer=True),
    "micro_batch_size": Bound(low=1, high=2**24, integer=True),
    "moe_imbalance": Bound(low=1),  # the busiest rank's tokens over the mean: 1 at least
    "router_batches": Bound(low=1, integer=True),
    "eval_every": Bound(low=0, integer=True),
    "eval_batches": Bound(low=1, integer=True),
}


OPTIM_SCHEDULES = ("constant", "linear", "cosine", "wsd")


@dataclass
class OptimConfig:
    """The generated module's optimizer (AdamW), learning-rate schedule and gradient clipping."""

    name: str = "adamw"
    """The optimizer: adamw (the only one the generated module runs)."""
    lr: float = 3e-4
    """Peak learning rate (the module's --lr overrides it)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW's moment decay rates, each in [0, 1)."""
    eps: float = 1e-8
    """AdamW's denominator term."""
    weight_decay: float = 0.1
    """Decoupled weight decay (p *= 1 - lr * weight_decay each step) of the decayed parameters."""
    decay_all: bool = False
    """Decay every parameter; false exempts embeddings, normalisation layers and every parameter of
    fewer than 2 dims (biases, norm gains)."""
    warmup_steps: int = 0
    """Linear warmup from lr / warmup_steps to lr over these steps (module: --warmup-steps)."""
    schedule: str = "cosine"
    """After warmup: constant, linear (to min_lr), cosine (to min_lr) or wsd (warmup-stable-decay:
    lr, then linear to min_lr over the last wsd_decay_fraction of decay_steps) (module: --schedule)."""
    decay_steps: int | None = None
    """Step at which the schedule reaches min_lr (null: the run's total steps, --steps)."""
    min_lr: float = 0.0
    """Learning rate the schedule decays to (module: --min-lr)."""
    wsd_decay_fraction: float = 0.2
    """wsd: the fraction of decay_steps spent decaying, in (0, 1]."""
    max_grad_norm: float = 1.0
    """Clip gradients to this global L2 norm over every shard (0 turns clipping off; priced as one
    small all-reduce over all ranks per step) (module: --max-grad-norm)."""


def optimizer_settings(optim: Any) -> dict[str, Any]:
    """The checked `optim` node as the generated module's OPTIMIZER dict (plain values).

    Raises ConfigError naming the first field out of range."""
    settings = {f.name: getattr(optim, f.name) for f in dataclasses.fields(OptimConfig)}
    settings["betas"] = tuple(float(b) for b in settings["betas"])
    problem = optim_problem(settings)
    if problem:
        field_name, why = problem
        raise ConfigError(f"Invalid configuration: optim.{field_name}={settings[field_name]!r}: {why}.",
                          f"set optim.{field_name} to such a value (`autopar compile --help` lists the optim fields).")
    return settings


OPTIM_BOUNDS: dict[str, Bound] = {
    "lr": Bound(low=0, low_open=True),
    "betas": Bound(low=0, high=1, high_open=True, each=True),
    "eps": Bound(low=0, low_open=True),
    "weight_decay": Bound(low=0),
    "warmup_steps": Bound(low=0, integer=True),
    "decay_steps": Bound(low=1, integer=True, null="the run's steps"),
    "min_lr": Bound(low=0),
    "wsd_decay_fraction": Bound(low=0, high=1, low_open=True),
    "max_grad_norm": Bound(low=0),  # 0: no clipping
}


def optim_problem(s: dict[str, Any]) -> tuple[str, str] | None:
    """(field, what it must be) for the first optimizer setting out of range, else None."""
    if s["name"] != "adamw":
        return "name", "the generated module runs adamw only"
    found = out_of_range(s, OPTIM_BOUNDS)
    if found:
        return found.name, f"expected {found.bound.describe()}"
    checks = [
        ("betas", len(s["betas"]) == 2, "two values in [0, 1) are expected"),
        ("schedule", s["schedule"] in OPTIM_SCHEDULES, f"one of {', '.join(OPTIM_SCHEDULES)} is expected"),
        ("decay_steps", s["decay_steps"] is None or s["decay_steps"] > s["warmup_steps"],
         "null (the run's steps) or more steps than warmup_steps is expected"),
        ("min_lr", s["min_lr"] <= s["lr"], "a finite value from 0 to lr is expected"),
    ]
    return next(((name, why) for name, ok, why in checks if not ok), None)


@dataclass
class SolverConfig:
    """How the planner searches (everything not pinned under plan.* is searched)."""

    objective: str = "robust"
    """robust (the fastest plan that fits, unless a plan whose prediction interval overlaps it
    depends less on what the cost model extrapolates beyond its calibration set: collectives over
    more nodes than any published run, an uncalibrated GPU, an overlap no published run measured
    such as ring attention's; cost_models.uncertainty), throughput
    (the fastest by prediction alone), memory (least memory within 5% of the fastest), or
    min_gpus (fewest GPUs reaching target_tokens_per_s)."""
    target_tokens_per_s: float = 0.0
    """Throughput to reach with objective=min_gpus."""
    work_limit: float = 60.0
    """Deterministic work budget for the whole search (about seconds on an idle 2-core laptop:
    CP-SAT's deterministic seconds plus 0.1 ms per configuration priced past its floor). It does not
    depend on machine load, so the same inputs give the same plan anywhere; when it runs out the
    best plan so far is returned with its gap (the search always runs until it has one plan)."""
    time_limit_s: float = 600.0
    """Wall-clock safety cap for the search, kept generous: a plan stopped by it depends on the
    machine's load, and the terminal and the report say so."""
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
    schedules: list[str] = field(default_factory=lambda: list(SCHEDULES))
    """Pipeline schedules considered."""
    recompute_options: list[str] = field(default_factory=lambda: list(RECOMPUTE_OPTIONS))
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


SOLVER_BOUNDS: dict[str, Bound] = {
    "target_tokens_per_s": Bound(low=0),
    "work_limit": Bound(low=0, low_open=True),
    "time_limit_s": Bound(low=0, low_open=True),
    "threads": Bound(low=1, integer=True),
    "seed": Bound(low=0, high=2**31 - 1, integer=True),  # CP-SAT's random_seed is a 32-bit integer
    "top_k": Bound(low=0, integer=True),
    "max_micro_batch_size": Bound(low=1, integer=True),
    "zero_stages": Bound(low=0, high=3, integer=True, each=True),
    "interleave_chunks": Bound(low=1, integer=True, each=True),
    "max_tp": Bound(low=0, integer=True),
    "max_pp": Bound(low=0, integer=True),
    "max_cp": Bound(low=0, integer=True),
}


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
    ep: int | None = None
    """Expert-parallel degree, carved from dp (models with experts; it divides dp and the experts)."""
    expert_tp: bool | None = None
    """Split every expert's feed-forward width over the tensor-parallel group (models with experts, tp > 1)."""
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
    """The stacks of blocks to split the model along (each container's children are layers),
    e.g. plan.blocks=[transformer.h] or plan.blocks=[encoder.block,decoder.block], for when
    detection picks the wrong ones."""
    trace_every_block: bool = False
    """Trace every block of the stacks. By default each run of structurally identical blocks is
    traced as its first, second and last block and the others are copied from the second
    (autopar.trace.repeated_blocks: 3.6 s instead of 34 s for a 70B profile); set it for a model
    whose blocks branch on their own index in ways neither their attributes nor those three show."""
    reuse_profile: bool = True
    """Reuse the profile an earlier run traced from the same model file, the modules it imports,
    the same settings and the same autopar (autopar.profile_cache: kept under
    $AUTOPAR_PROFILE_CACHE, else ~/.cache/autopar/profiles); false traces again."""
    engine: str | None = None
    """Search only what this engine runs: torchtitan, megatron, deepspeed or accelerate (their rules
    in autopar/emit/). `autopar plan` and `estimate` price the plan as that engine runs it (its
    train.* runtimes, where unset); `autopar compile` prices it as the module it writes runs, and
    refuses a train.* runtime the module does not run (autopar.specs.generated_module_settings)."""
    layer_recompute: dict[str, str] = field(default_factory=dict)
    """Per-layer recomputation (layer name -> none/selective/full; unlisted layers: none), e.g.
    plan.layer_recompute='{blocks.0: full}'; with pp > 1 it needs plan.stages as well."""


_SOLVED = "the solver chooses"
PLAN_PIN_BOUNDS: dict[str, Bound] = {
    "dp": Bound(low=1, integer=True, null=_SOLVED),
    "tp": Bound(low=1, integer=True, null=_SOLVED),
    "pp": Bound(low=1, integer=True, null=_SOLVED),
    "cp": Bound(low=1, integer=True, null=_SOLVED),
    "ep": Bound(low=1, integer=True, null=_SOLVED),
    "zero_stage": Bound(low=0, high=3, integer=True, null=_SOLVED),
    "micro_batch_size": Bound(low=1, integer=True, null=_SOLVED),
    "chunks": Bound(low=1, integer=True, null=_SOLVED),
    "dp_shares": Bound(low=1, integer=True, each=True, null="even shares"),
}


@dataclass
class DataConfig:
    """The training text of the generated module's built-in data (autopar/sections/data.py,
    whose DataConfig has these fields; this copy keeps Hydra from importing torch)."""

    path: str | None = None
    """A file or folder of training text: .txt (one document), .jsonl, .parquet, .bin (token ids),
    a folder of text files (one document each) or of .jsonl/.parquet shards, or a folder written by
    datasets' save_to_disk. null: no built-in data (example_batch, or the model file's dataset())."""
    val_path: str | None = None
    """Validation text in the same formats; null: val_fraction of path, or no validation."""
    val_fraction: float = 0.0
    """Share of path's sequences, from its end, held out for validation ([0, 0.5))."""
    tokenizer: str = "bytes"
    """bytes (UTF-8 bytes, end-of-document 256, vocabulary 257) or a local tokenizer.json (or its folder);
    nothing is downloaded."""
    seq_len: int | None = None
    """Tokens per sample; null: the sequence length the plan was traced with."""
    text_field: str = "text"
    """The .jsonl field, or .parquet / datasets column, holding the text."""
    eod_token: int | None = None
    """Id after every document; null: 256 for bytes, else the tokenizer's end-of-text special token."""
    num_workers: int = 1
    """DataLoader worker processes per rank (0: load in the training process)."""
    cache_dir: str | None = None
    """Folder the tokenized corpora are cached in (null: the run folder)."""
    bin_dtype: str = "uint16"
    """Token dtype of a .bin file: uint16 or uint32 (a name ending .u32.bin is read as uint32)."""


DATA_BOUNDS: dict[str, Bound] = {
    "val_fraction": Bound(low=0, high=0.5, high_open=True),
    "seq_len": Bound(low=1, integer=True, null="the traced sequence length"),
    "eod_token": Bound(low=0, integer=True, null="the tokenizer's end-of-text token"),
    "num_workers": Bound(low=0, integer=True),
}


def check_data(data: Any) -> None:
    """Refuse data.* settings that cannot work, before anything runs (the files themselves are
    read, and refused, where the module is generated)."""
    check_fields(data, DATA_BOUNDS, "data.", DataConfig)
    problems = []
    if data.val_path is not None and data.val_fraction > 0:
        problems.append((f"data.val_path and data.val_fraction={data.val_fraction} both name the validation data",
                         "give one of them"))
    if data.bin_dtype not in ("uint16", "uint32"):
        problems.append((f"data.bin_dtype={data.bin_dtype} is not a token dtype", "use uint16 or uint32"))
    tokenizer = Path(data.tokenizer).expanduser()
    if data.tokenizer != "bytes" and not (tokenizer.is_file() or (tokenizer / "tokenizer.json").is_file()):
        problems.append((f"data.tokenizer={data.tokenizer} is neither bytes nor a tokenizer.json on this machine "
                         "(nothing is downloaded)",
                         "give the path of a local tokenizer.json (or its folder), or data.tokenizer=bytes"))
    if problems:
        problem, fix = problems[0]
        raise ConfigError(f"Invalid configuration: {problem}.", f"{fix}.")


# Section of the composed configuration -> (its schema, the ranges of its numeric fields).
SCHEMA_BOUNDS: dict[str, tuple[type, dict[str, Bound]]] = {
    "cluster": (ClusterConfig, CLUSTER_BOUNDS), "train": (TrainConfig, TRAIN_BOUNDS),
    "solver": (SolverConfig, SOLVER_BOUNDS), "plan": (PlanPins, PLAN_PIN_BOUNDS),
}


def check_numbers(cfg: Any) -> None:
    """Refuse the first numeric setting outside its declared range (SCHEMA_BOUNDS, the cluster's
    node groups, sweep.*), naming the field, the value, the range and the fix, before any work.

    Raises ConfigError (exit 1)."""
    sections = [(name, schema, table) for name, (schema, table) in SCHEMA_BOUNDS.items()]
    sections.append(("sweep", SweepConfig, SWEEP_BOUNDS))
    for section, schema, table in sections:
        node = getattr(cfg, section, None)
        if node is not None:
            check_fields(node, table, f"{section}.", schema)
    if getattr(cfg, "cluster", None) is not None:
        check_cluster(cfg.cluster)


def check_cluster(cluster: Any) -> None:
    """The cluster.* numbers and each node group's (ConfigError naming the first out of range)."""
    check_fields(cluster, CLUSTER_BOUNDS, "cluster.", ClusterConfig)
    for index, group in enumerate(getattr(cluster, "node_groups", None) or []):
        check_fields(group, NODE_GROUP_BOUNDS, f"cluster.node_groups[{index}].", NodeGroupConfig)


def check_fields(node: Any, table: dict[str, Bound], prefix: str, schema: type | None = None) -> None:
    """Raise ConfigError for the first field of ``node`` outside ``table``'s range; the fix
    suggests the schema's default."""
    found = out_of_range(node, table)
    if found is None:
        return
    path = f"{prefix}{found.name}"
    default = _default_of(schema, found.name) if schema is not None else dataclasses.MISSING
    example = "" if default is dataclasses.MISSING else f" (e.g. the schema's default, {path}={_yaml_value(default)})"
    raise ConfigError(f"Invalid configuration: {found.sentence(prefix)}.",
                      f"give {path} a value in that range{example}, or leave the override out.")


def _default_of(schema: type, name: str) -> Any:
    by_name = {f.name: f for f in dataclasses.fields(schema)}
    if name not in by_name:
        return dataclasses.MISSING
    spec = by_name[name]
    if spec.default is not dataclasses.MISSING:
        return spec.default
    return spec.default_factory() if spec.default_factory is not dataclasses.MISSING else dataclasses.MISSING


def _yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value)


# What a sweep point is worth to a sweeper that optimises (hydra/sweeper=optuna), and which way
# is better: the sweeper's `direction` must agree.
SWEEP_OBJECTIVES = {"cost_per_million_tokens": "minimize", "step_time_s": "minimize",
                    "tokens_per_s": "maximize", "tokens_per_dollar": "maximize"}


@dataclass
class SweepConfig:
    """What each point of a sweep (`autopar plan -m ...`) returns to Hydra's sweeper."""

    objective: str = "cost_per_million_tokens"
    """cost_per_million_tokens or step_time_s (minimise), tokens_per_s or tokens_per_dollar
    (maximise); an optimising sweeper (hydra/sweeper=optuna) searches for its best value."""
    max_step_time_s: float = 0.0
    """Deadline on the predicted step time (0: none); a point over it, or without a plan, scores
    the objective's worst value (infinite cost or time, zero throughput)."""


SWEEP_BOUNDS: dict[str, Bound] = {"max_step_time_s": Bound(low=0)}


@dataclass
class AutoparConfig:
    """Root of the composed configuration."""

    model: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the model file's build_model() and example_batch()."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    solver: SolverConfig = field(default_factory=SolverConfig)
    plan: PlanPins = field(default_factory=PlanPins)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    data: DataConfig = field(default_factory=DataConfig)
    check: str = "auto"
    """compile's numerical check (autopar/runtime/proof.py): on (the plan's module trains 2 steps on
    local gloo ranks, compared with one process), off, or auto (on when every rank of the cluster
    runs on this machine: one node of CPU ranks). The full-scale step on fake tensors always runs.
    Its default is the AUTOPAR_CHECK environment variable where set (conf/config.yaml)."""


def register_configs() -> None:
    """Put the schemas in Hydra's ConfigStore (idempotent). Once a process: turning a schema into
    a config node costs ~20 ms, and every composition (each CLI command composes twice, a sweep
    once a point) asked for all seven again."""
    store = ConfigStore.instance()
    if "autopar_schema.yaml" in store.repo:  # already there (the store lives as long as the process)
        return
    store.store(name="autopar_schema", node=AutoparConfig)
    store.store(group="cluster", name="cluster_schema", node=ClusterConfig)
    store.store(group="train", name="train_schema", node=TrainConfig)
    store.store(group="optim", name="optim_schema", node=OptimConfig)
    store.store(group="solver", name="solver_schema", node=SolverConfig)
    store.store(group="plan", name="plan_schema", node=PlanPins)
    store.store(group="data", name="data_schema", node=DataConfig)


def normalise_overrides(overrides: list[str]) -> list[str]:
    """Let ``model.<name>=<value>`` add keys (the model section has no fixed schema), and a
    per-layer map replace the empty one (its keys are the model's layer names)."""
    result = []
    for item in overrides:
        if (item.startswith("model.") or item.startswith("plan.layer_recompute=")) and "=" in item:
            item = "++" + item
        result.append(item)
    return result


def compose_config(overrides: list[str] | None = None, hydra: bool = False) -> Any:
    """Compose conf/config.yaml with command-line style overrides, as the CLI does.

    hydra=True also composes (and so checks) the ``hydra`` node and its overrides (hydra.run.dir,
    hydra/launcher=..., ...), as Hydra's own run would. Raises ConfigError (one line, exit 1) for
    unknown keys, values of the wrong type, unknown presets, or `+key` adding a field a schema
    does not have; nothing heavier than Hydra is imported, so a typo is reported at once.
    """
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_configs()
    given = list(overrides or [])
    try:
        with initialize_config_module(config_module="autopar.conf", version_base=None):
            cfg = compose(config_name="config", overrides=normalise_overrides(given), return_hydra_config=hydra)
    except (HydraException, OmegaConfBaseException) as err:
        raise config_error(err) from None
    added = fields_outside_schema(cfg)
    if added:
        path, known = added[0]
        raise ConfigError(f"Invalid configuration: {path} is not a field of {path.rsplit('.', 1)[0]} "
                          f"(+ can add keys only where the schema allows any: model.*, plan.layer_recompute.*).",
                          f"drop it, or use one of {', '.join(known)}{_did_you_mean(path, known)}.")
    check_numbers(cfg)
    check_engine(cfg.plan)
    check_data(cfg.data)
    optimizer_settings(cfg.optim)  # its values' ranges, before any work
    return cfg


def check_engine(pins: Any) -> None:
    """plan.engine names an engine `--emit` writes for (checked before any tracing)."""
    from autopar.emit import ENGINES

    engine = getattr(pins, "engine", None)
    if engine is not None and engine not in ENGINES:
        raise ConfigError(f"plan.engine={engine} is not an engine autopar plans for.",
                          f"use one of {', '.join(ENGINES)}, or leave plan.engine unset.")


def fields_outside_schema(cfg: Any) -> list[tuple[str, list[str]]]:
    """Keys that `+key=value` added to a dataclass-typed node (Hydra opens the struct flag to add
    them, so OmegaConf accepts them and they would be silently ignored), with that node's fields."""
    from omegaconf import DictConfig, OmegaConf

    found = []

    def walk(node: Any, path: str) -> None:
        schema = OmegaConf.get_type(node)
        names = [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else None
        for key in node.keys():
            where = f"{path}.{key}" if path else str(key)
            if where == "hydra":  # Hydra's own node, with its own schema
                continue
            if names is not None and key not in names:
                found.append((where, names))
            elif names is not None and isinstance(node[key], DictConfig):
                walk(node[key], where)

    walk(cfg, "")
    return found


def _did_you_mean(path: str, known: list[str]) -> str:
    close = difflib.get_close_matches(path.rsplit(".", 1)[-1], known, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


# OmegaConf's validation messages, in the words of what the field expects.
_EXPECTED = (("converted to Integer", "an integer is expected"), ("converted to Float", "a number is expected"),
             ("is not a valid bool", "true or false is expected"),
             ("is not a ListConfig, list or tuple", "a list is expected, e.g. [a,b]"),
             ("is not a DictConfig, dict", "a mapping is expected, e.g. {a: 1}"))


def config_error(err: Exception) -> ConfigError:
    """One-line ConfigError for a Hydra/OmegaConf composition failure, naming the key and what it
    expects (Hydra's own message is often only 'Error merging override ...')."""
    from autopar.errors import ConfigError

    cause: BaseException = err
    while cause.__cause__ is not None and not getattr(cause, "full_key", None):
        cause = cause.__cause__
    key = getattr(cause, "full_key", None)
    merged = (str(err).removeprefix("Error merging override ").split("=", 1)[0].lstrip("~+")
              if "Error merging override " in str(err) else "")
    if key and merged and not key.startswith(merged):  # a key inside a list item is named from the item
        key = f"{merged}.{key}"
    first = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
    if key:
        for marker, expected in _EXPECTED:
            if marker in first:
                value = f"={first.split(chr(39))[1]}" if first.count("'") >= 2 else ""
                return ConfigError(f"Invalid configuration: {key}{value}: {expected}.",
                                   f"give {key} a value of that type (`autopar plan --cfg job` prints the "
                                   "composed configuration with its types' defaults).")
        if "does not support deletion" in first:
            return ConfigError(f"Invalid configuration: ~{key} would delete a field of the schema.",
                               f"set it instead ({key}=VALUE); only keys the schema leaves open (model.*, "
                               "plan.layer_recompute.*) can be deleted.")
        if "not in '" in first:
            parent = key.rsplit(".", 1)[0] if "." in key else ""
            known = _schema_fields(parent)
            return ConfigError(f"Invalid configuration: {key} is not a field of {parent or 'the configuration'}.",
                               f"check the spelling{_did_you_mean(key, known)}; `autopar plan --help` lists every "
                               "group and field.")
    message = " ".join(str(err).split())
    if "Could not find 'hydra/launcher/" in message or "Could not find 'hydra/sweeper/" in message:
        return ConfigError(f"Invalid configuration: {message.split(' Config search path')[0]}",
                           "Hydra's plugins are extras: pip install 'autopar[joblib]' (hydra/launcher=joblib), "
                           "'autopar[submitit]' (submitit_local, submitit_slurm) or 'autopar[optuna]' "
                           "(hydra/sweeper=optuna).")
    return ConfigError(f"Invalid configuration: {message}",
                       "check the override's spelling against `autopar <verb> --help` and the presets of "
                       "autopar/conf/.")


def _schema_fields(path: str) -> list[str]:
    """Field names of the dataclass at a dotted path of the root schema ([] where there is none)."""
    schema: Any = AutoparConfig
    for part in [p for p in path.split(".") if p]:
        by_name = {f.name: f for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else {}
        if part not in by_name or by_name[part].default_factory is dataclasses.MISSING:
            return []
        schema = by_name[part].default_factory
    return [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else []

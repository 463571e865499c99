"""Training: set up the parallel model on this rank, run steps, log them, checkpoint and save what was trained."""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import resource
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

# In a generated folder this is checkpointing.py beside the training module (the same for every plan).
from autopar.sections import checkpoint as checkpointing
from autopar.sections.batches import (Batches, DataSource, eval_step, forward_arguments_of, local_batch,
                                              open_data, validation_batches)
# In a generated folder this is pretrained.py beside the training module (the same for every plan).
from autopar.sections import pretrained
# In a generated folder this is metrics.py beside the training module (the same for every plan).
from autopar.sections import metrics
from autopar.sections.clipping import step_optimizer
from autopar.sections.markers import FINISHED_MARKER
from autopar.sections.contract import (DropoutOff, build_model, compute_loss, file_sha256, load_model_file,
                                               make_batch, map_batch, model_inputs, slice_batch,
                                               tokens_per_sample)
from autopar.sections.context_parallel import context_parallel_attention, shard_sequence
from autopar.sections.data_parallel import apply_fsdp, dp_mesh_of, set_gradient_sync
from autopar.sections.expert_parallel import (ExpertShards, apply_ep, apply_expert_tp, expert_meshes,
                                                       shard_experts)
from autopar.sections.gradient_sync import (HalvingDoublingSync, HierarchicalSync, ParameterServer,
                                                    dp_groups, node_subgroups)
from autopar.sections.mesh import MeshAxis, ParallelDims, build_mesh, dp_rank, pick_device
from autopar.sections.optimizer import (ShardedAdamW, build_optimizer, build_zero1_optimizer,
                                                no_decay_names)
from autopar.sections.pipeline import (PipelineStageModule, TiedGradientSync, build_pipeline,
                                               local_stage_indices, module_stages, named_parameters_in_stage,
                                               run_pipeline, split_stage, split_with_tracer)
from autopar.sections.recompute import apply_recompute
from autopar.sections.tensor_parallel import (apply_tp, reduce_partial_gradients, replicated_beside_shards,
                                              sharded_logits)
from autopar.sections.token_loss import TokenCounts


GRADIENT_SYNC_ALGORITHMS = ("hierarchical", "halving_doubling", "ps")  # dp_sync run by gradient_sync.py
NCCL_ALGORITHMS = ("ring", "tree")  # dp_sync naming NCCL's all-reduce algorithm (FSDP's reduction)


@dataclass(frozen=True)
class ParallelConfig:
    """The plan's parallel decisions, as the functions above take them.

    Attributes:
        dims: degrees and mesh axis order.
        zero_stage: 0-3 (see data_parallel.py).
        stages: layer FQNs per (virtual) pipeline stage; stage j runs on pipeline rank j mod pp.
        recompute: layer FQN -> "none" | "selective" | "full".
        fsdp_groups: module FQNs grouped for FSDP, bottom-up.
        tied_parameters: parameter FQNs sharing one tensor.
        The others (with defaults) belong to one technique each; see the comments.
    """

    dims: ParallelDims
    zero_stage: int
    stages: list[list[str]]
    recompute: dict[str, str]
    fsdp_groups: list[list[str]]
    tied_parameters: list[list[str]]
    schedule: str = "1f1b"  # pipelines: gpipe | 1f1b | interleaved_1f1b
    loss_parallel: bool = False  # TP: the LM head's logits stay vocabulary-sharded into the loss
    pipeline_split: str = "modules"  # pipelines: drop other stages' layers, or "tracer": cut an exported graph
    cp_strategy: str = "ulysses"  # context parallelism's attention: ulysses | ring
    position_argument: str | None = None  # CP: forward's argument for the tokens' positions
    mask_argument: str | None = None  # CP: forward's padding-mask argument, filled with ones
    dp_sync: str = "ring"  # ring | tree: FSDP's (NCCL's algorithm); others: gradient_sync.py
    ep: int = 1  # expert parallelism: experts sharded over ep consecutive data-parallel ranks
    expert_tp: bool = False  # every expert's feed-forward width split over the tensor-parallel group
    dp_bucket_bytes: int = 25 * 2**20  # gradient_sync.py's bucket size
    gpus_per_node: int = 8  # which ranks share a node (hierarchical all-reduce)
    # TP: fused projections' (dim, parts)
    fused_parameters: dict[str, tuple[int, list[int]]] = field(default_factory=dict)

    @property
    def custom_gradient_sync(self) -> bool:
        """Gradients averaged by gradient_sync.py instead of FSDP."""
        return (self.dp_sync in GRADIENT_SYNC_ALGORITHMS and self.zero_stage <= 1 and self.dims.dp > 1
                and not self.dims.cp_enabled)

    @property
    def rows(self) -> checkpointing.RowOrders:
        """Parameters held with permuted rows (fused projections split as their parts, fused.py)."""
        return checkpointing.RowOrders(self.fused_parameters, self.dims.tp)

    @property
    def expert_parallel(self) -> bool:
        """Whether MoE layers' experts are sharded over expert-parallel groups (expert_parallel.py)."""
        return self.ep > 1

    @property
    def experts_split(self) -> bool:
        """Whether this rank holds slices of the experts (over EP, or their width over TP):
        ExpertShards names them."""
        return self.expert_parallel or self.expert_tp

    @property
    def recompute_enabled(self) -> bool:
        """Whether any layer recomputes its activations in backward."""
        return any(mode != "none" for mode in self.recompute.values())


@dataclass(frozen=True)
class TrainConfig:
    """What to train and how long.

    Attributes:
        model_file: path of the user's model.py.
        model_kwargs: keyword arguments for build_model / example_batch.
        global_batch_size: samples per optimizer step over all data-parallel ranks.
        micro_batch_size, num_micro_batches: per data-parallel rank and step.
        dp_shares: samples per micro-batch of each data-parallel rank when uneven (else empty).
        precision: "bf16" (used on GPUs; CPUs train in fp32) or "fp32".
        optimizer: AdamW settings (lr, betas, eps, weight_decay, decay_all), learning-rate schedule
            (warmup_steps, schedule, decay_steps, min_lr, wsd_decay_fraction) and max_grad_norm.
        steps, seed: optimizer steps to run; seed of the weights (seed) and of batch s (seed + 1 + s).
        log_file: JSON lines, one record per step (rank 0 appends), or None.
        save_final: where rank 0 saves the trained parameters as full tensors, or None.
        dropout_off: train with the model's dropout off (contract.DropoutOff: compile's check).
        checkpoint: checkpoint folder and frequency, async saving, export (see checkpoint.py).
        fail_at_step: fault injection: the last rank kills itself at this step in torchrun's
            first attempt (see `checkpointing.inject_failure`), or None.
        data: the built-in text pipeline's settings (training_data.DataConfig's fields; no
            ``path``: the model's dataset() hook, else example_batch).
        vocab_rows: rows of the model's largest embedding: a tokenizer with more ids is refused.
        eval_every, eval_batches: the validation loss over ``eval_batches`` fixed global batches
            every ``eval_every`` steps and after the last (0: never).
        init_from: weights to start from instead of the seed's (a file or model folder, see
            pretrained.py), unless a checkpoint is resumed; or None.
        metrics: where rank 0 sends the records besides log_file (see metrics.py).
        token_loss: the loss is a mean over the targets it counts (cross-entropy with ignored
            labels), weighed by counts across ranks and micro-batches (token_loss.py).
    """

    model_file: str
    model_kwargs: dict[str, Any]
    global_batch_size: int
    micro_batch_size: int
    num_micro_batches: int
    precision: str
    optimizer: dict[str, Any]
    steps: int
    seed: int = 0
    log_file: str | None = None
    save_final: str | None = None
    dropout_off: bool = False
    checkpoint: checkpointing.CheckpointConfig = field(default_factory=checkpointing.CheckpointConfig)
    fail_at_step: int | None = None
    dp_shares: list[int] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    vocab_rows: int = 0
    eval_every: int = 0
    eval_batches: int = 4
    init_from: str | None = None
    metrics: metrics.MetricsConfig = field(default_factory=metrics.MetricsConfig)
    token_loss: bool = False

    def share(self, rank_in_dp: int) -> tuple[int, int]:
        """(first sample, samples per micro-batch) of a data-parallel rank's part of the batch."""
        if not self.dp_shares:
            return rank_in_dp * self.micro_batch_size * self.num_micro_batches, self.micro_batch_size
        return sum(self.dp_shares[:rank_in_dp]) * self.num_micro_batches, self.dp_shares[rank_in_dp]

    def loss_weight(self, rank_in_dp: int) -> float:
        """Factor on this rank's mean loss so averaging over data-parallel ranks weights each by
        its samples (1 when shares are even, or where counted tokens weigh it: token_loss.py)."""
        if not self.dp_shares or self.token_loss:
            return 1.0
        return self.dp_shares[rank_in_dp] * len(self.dp_shares) / sum(self.dp_shares)


@dataclass
class ParallelModel:
    """This rank's part of the model and what trains it."""

    modules: list[nn.Module]  # the whole model, or this rank's pipeline stages
    optimizer: Any
    mesh: DeviceMesh
    device: torch.device
    is_last_stage: bool
    schedule: Any = None  # the pipeline schedule (None without pipelining)
    tied_sync: Callable[[list[nn.Module]], None] | None = None  # sums tied gradients across stages
    compute_dtype: torch.dtype | None = None  # see `compute_dtype`
    experts: Any = None  # this rank's ExpertShards under expert parallelism, else None
    grad_norm: Any = None  # the last step's global gradient norm (a tensor; None without clipping)
    lr: float | None = None  # the last step's learning rate
    token_counts: TokenCounts | None = None  # a token-level loss's counts (token_loss.py), else None


def unsharded_named_parameters(parallel: ParallelModel) -> list[tuple[str, nn.Parameter]]:
    """Every parameter of this rank under its FQN in the unsharded model (ties under each name)."""
    if parallel.schedule is not None:
        return [named for module in parallel.modules for named in named_parameters_in_stage(module)]
    return [named for module in parallel.modules for named in module.named_parameters(remove_duplicate=False)]


def compute_dtype(precision: str, device: torch.device, as_gpu: bool = False) -> torch.dtype | None:
    """bf16 on GPUs when the plan says so; CPUs compute in fp32 (unless standing in for a GPU:
    a fake-tensor rank measuring a GPU plan's memory)."""
    return torch.bfloat16 if precision == "bf16" and (device.type == "cuda" or as_gpu) else None


def fsdp_wraps(dims: ParallelDims, config: ParallelConfig, param_dtype: torch.dtype | None) -> bool:
    """Whether FSDP wraps the model: to average gradients over data/context-parallel ranks (unless
    gradient_sync.py does), and on a lone rank computing in 16 bit, where FSDP's mixed precision
    keeps activations 16-bit as priced; autocast over fp32 weights keeps the residual stream in
    fp32 (a 1B Llama at micro-batch 4 on an H100: 34.2 GB that way, 31.7 GB with FSDP's, 31.6 predicted)."""
    return (dims.grad_sync_enabled or param_dtype is not None) and not config.custom_gradient_sync


def parallelize(model: nn.Module, root: nn.Module, layers: list[str], mesh: DeviceMesh, config: ParallelConfig,
                tp_plan: dict[str, ParallelStyle], param_dtype: torch.dtype | None) -> Any:
    """Apply the plan to one model, top to bottom in the order its techniques compose (the
    comment above each says why it comes there).

    Args:
        model: the model whose FQNs the plan names.
        root: the module FSDP wraps last.
        layers: the layers this module holds.
        mesh: the full DeviceMesh.
        config: the plan's parallel decisions.
        tp_plan: module FQN -> style, the plan's split of the whole model.
        param_dtype: compute dtype for FSDP's gathered parameters, or None.

    Returns:
        The ExpertShards this module holds, or None.
    """
    dims = config.dims
    shards = None
    # Tensor parallelism first: it replaces parameters by DTensors, which the wrappers below must see.
    if dims.tp_enabled:
        apply_tp(model, mesh[MeshAxis.TP.value], held(tp_plan, layers), config.tied_parameters)
    # Expert parallelism before recomputation (which wraps blocks; the experts' hooks go with
    # them), then the experts' width over the TP group (its sum comes after the combine).
    if config.expert_parallel:
        ep_mesh, edp_mesh = expert_meshes(dp_mesh_of(mesh, dims), config.ep)
        experts = apply_ep(model, ep_mesh)
        shards = ExpertShards.of(experts, ep_mesh)
    if config.expert_tp:
        shards = apply_expert_tp(model, mesh[MeshAxis.TP.value], shards)
    # Activation recomputation after TP (it recomputes the parallelised layers) and before FSDP
    # (FSDP's hooks must run outside it, so parameters are gathered before a layer recomputes).
    if config.recompute_enabled:
        apply_recompute(model, held(config.recompute, layers))
    # FSDP last, bottom-up: blocks, then final norm + head, then the root.
    if fsdp_wraps(dims, config, param_dtype):
        # A lone rank has no reduction to overlap with backward: one group (the root) spares the
        # per-block hooks and copies (a 1.3B GPT at micro-batch 1 on an H100: 47 ms per micro-batch).
        groups = config.fsdp_groups if dims.grad_sync_enabled else []
        if dims.pp_enabled and dims.grad_sync_enabled:
            groups = [[name for name in group if in_layers(name, layers)] for group in groups]  # this stage's
        if config.expert_parallel:
            # Experts first: FSDP over their expert-data-parallel group; the groups below then
            # leave their parameters alone.
            shard_experts(list(experts.values()), edp_mesh, config.zero_stage >= 3, param_dtype)
        apply_fsdp(model, dp_mesh_of(mesh, dims), groups, reshard_after_forward=config.zero_stage >= 3,
                   param_dtype=param_dtype, root=root)
    return shards


def in_layers(name: str, layers: list[str]) -> bool:
    """Whether module ``name`` is one of ``layers`` or inside one."""
    return any(name == layer or name.startswith(layer + ".") for layer in layers)


def held(per_module: dict[str, Any], layers: list[str]) -> dict[str, Any]:
    """The entries of a per-module setting for the modules ``layers`` hold."""
    return {name: value for name, value in per_module.items() if in_layers(name, layers)}


def setup(training: TrainConfig, config: ParallelConfig, tp_plan: Callable[[], dict[str, ParallelStyle]],
          model_module: Any, device: torch.device, fake_mode: Any = None) -> ParallelModel:
    """Build the unsharded model from the seed, cut it, parallelise it, and make its optimizer.

    ``fake_mode`` (a FakeTensorMode; None for training) measures one rank of a plan without its
    memory: the model is built on the meta device, parallelised there (the mesh stays real), and
    this rank's shards and optimizer are made as fake tensors; it computes in the plan's
    precision as on a GPU. Train steps must then run under ``fake_mode`` too.
    """
    dims = config.dims
    dims.check_world_size(dist.get_world_size())
    mesh = build_mesh(dims, device.type)
    with torch.device("meta") if fake_mode is not None else contextlib.nullcontext():
        model = build_model(model_module, training.model_kwargs, training.seed)
    param_dtype = compute_dtype(training.precision, device, as_gpu=fake_mode is not None)
    materialised = fake_mode if fake_mode is not None else contextlib.nullcontext()
    styles = tp_plan() if dims.tp_enabled else {}
    if dims.pp_enabled:
        return setup_pipeline(training, config, styles, model, model_module, mesh, device, param_dtype, fake_mode)
    # Parallelised on the CPU copy: each shard moves to the device as it is made, so no GPU ever
    # holds the whole model; what stays unsharded moves afterwards.
    layers = [layer for stage in config.stages for layer in stage]
    no_decay = no_decay_names(model)  # from the unsharded modules
    experts = parallelize(model, model, layers, mesh, config, styles, param_dtype)
    with materialised:
        place(model, device)
        optimizer = make_optimizer(list(model.named_parameters()), training, config, mesh, no_decay)
    return ParallelModel([model], optimizer, mesh, device, is_last_stage=True, compute_dtype=param_dtype,
                         experts=experts, token_counts=TokenCounts(device) if training.token_loss else None)


def setup_pipeline(training: TrainConfig, config: ParallelConfig, styles: dict[str, ParallelStyle], model: nn.Module,
                   model_module: Any, mesh: DeviceMesh, device: torch.device, param_dtype: torch.dtype | None,
                   fake_mode: Any) -> ParallelModel:
    """`setup` for a pipeline: cut this rank's stages out of ``model``, parallelise each (`parallelize`
    of the stage's inner model copy, FSDP wrapping the stage module last), and schedule them."""
    dims = config.dims
    materialised = fake_mode if fake_mode is not None else contextlib.nullcontext()
    no_decay = no_decay_names(model)  # from the unsharded modules (a traced stage keeps none)
    pp_rank = mesh[MeshAxis.PP.value].get_local_rank()
    pp_mesh = mesh[MeshAxis.PP.value]
    indices = local_stage_indices(len(config.stages), dims.pp, pp_rank)
    example = make_batch(model_module, training.model_kwargs, training.micro_batch_size, training.seed)
    if dims.cp_enabled:  # stages see this rank's share of each sequence
        example = shard_sequence(example, tokens_per_sample(example), dims.cp, mesh[MeshAxis.CP.value].get_local_rank(),
                                 config.position_argument, config.mask_argument)
    modules: list[nn.Module] = []
    experts = None  # this rank's ExpertShards under expert parallelism
    if config.pipeline_split == "tracer":
        if fake_mode is not None:
            raise ValueError("a traced pipeline split cannot be built on fake tensors (it exports the model)")
        if config.expert_parallel:
            # Before the export, which traces the exchanges into the stages' graphs; dp = ep here
            # (codegen), so FSDP, which sees no experts module in a graph, leaves the slices alone.
            ep_mesh, _ = expert_meshes(dp_mesh_of(mesh, dims), config.ep)
            experts = ExpertShards.of(apply_ep(model, ep_mesh), ep_mesh)
        pipe = split_with_tracer(model, config.stages, model_module, example)
        pipeline_stages = []
        for index in indices:
            module = pipe.get_stage_module(index).to(device)
            if fsdp_wraps(dims, config, param_dtype):
                ignored = {p for name, p in named_parameters_in_stage(module) if experts and name in experts.names}
                apply_fsdp(module, dp_mesh_of(mesh, dims), [], reshard_after_forward=config.zero_stage >= 3,
                           param_dtype=param_dtype, ignored=ignored)
            modules.append(module)
            pipeline_stages.append(pipe.build_stage(index, device, pp_mesh.get_group()))
    else:
        for index in indices:
            stage = split_stage(model, config.stages, index, model_module, example, device)
            shards = parallelize(stage.model, stage, config.stages[index], mesh, config, styles, param_dtype)
            experts = shards if experts is None or shards is None else experts | shards
            with materialised:
                place(stage, device)
            stage.attach_input()
            modules.append(stage)
        pipeline_stages = module_stages(modules, indices, len(config.stages), pp_mesh, device)
    del model  # each stage holds its own layers now
    token_counts = TokenCounts(device) if training.token_loss else None
    schedule = build_pipeline(pipeline_stages, config.schedule, training.num_micro_batches,
                              token_counts.weigh_output if token_counts is not None else None)
    named = list({id(p): (n, p) for module in modules for n, p in named_parameters_in_stage(module)}.values())
    with materialised:
        optimizer = make_optimizer(named, training, config, mesh, no_decay)
    return ParallelModel(modules, optimizer, mesh, device, is_last_stage=len(config.stages) - 1 in indices,
                         schedule=schedule,
                         tied_sync=TiedGradientSync(config.tied_parameters, config.stages, mesh, dims.pp),
                         compute_dtype=param_dtype, experts=experts, token_counts=token_counts)


def place(module: nn.Module, device: torch.device) -> None:
    """Move a parallelised module to ``device``; one built on the meta device gets storage
    there instead (fake tensors when a FakeTensorMode is active: see `setup`)."""
    if any(p.is_meta for p in module.parameters()):
        module.to_empty(device=device)
    else:
        module.to(device)


def make_optimizer(named: list[tuple[str, nn.Parameter]], training: TrainConfig, config: ParallelConfig,
                   mesh: DeviceMesh, no_decay: set[str]) -> Any:
    """AdamW over (FQN, parameter) pairs, decaying all but ``no_decay`` (its state sharded over
    data-parallel replicas for ZeRO-1), behind the plan's gradient synchronisation when it is
    not FSDP's."""
    if config.custom_gradient_sync:
        return make_gradient_sync(named, training, config, mesh, no_decay)
    if config.zero_stage == 1:
        return build_zero1_optimizer(named, training.optimizer, mesh[MeshAxis.DP_REPLICATE.value].get_group(),
                                     no_decay)
    return build_optimizer(named, training.optimizer, no_decay)


def make_gradient_sync(named: list[tuple[str, nn.Parameter]], training: TrainConfig, config: ParallelConfig,
                       mesh: DeviceMesh, no_decay: set[str]) -> Any:
    """The plan's own gradient exchange (gradient_sync.py) wrapped around the optimizer."""
    group = mesh[MeshAxis.DP_REPLICATE.value].get_group()
    if config.dp_sync == "ps":
        return ParameterServer(named, lambda owned: build_optimizer(owned, training.optimizer, no_decay), group,
                               config.dp_bucket_bytes)
    if config.zero_stage == 1:
        optimizer = build_zero1_optimizer(named, training.optimizer, group, no_decay)
    else:
        optimizer = build_optimizer(named, training.optimizer, no_decay)
    if config.dp_sync == "halving_doubling":
        return HalvingDoublingSync(named, optimizer, group, config.dp_bucket_bytes)
    intra, inter = node_subgroups(dp_groups(mesh, MeshAxis.DP_REPLICATE.value), config.gpus_per_node)
    intra_group, _ = dist.new_subgroups_by_enumeration(intra)
    inter_group, _ = dist.new_subgroups_by_enumeration(inter)
    return HierarchicalSync(named, optimizer, intra_group, inter_group, config.dims.dp, config.dp_bucket_bytes)


def attention_context(parallel: ParallelModel, config: ParallelConfig, training: TrainConfig,
                      model_module: Any) -> Any:
    """Context-parallel attention over the CP group while training runs (nothing without CP)."""
    if not config.dims.cp_enabled:
        return contextlib.nullcontext()
    sample = make_batch(model_module, training.model_kwargs, 1, training.seed)
    return context_parallel_attention(parallel.mesh[MeshAxis.CP.value].get_group(), config.cp_strategy,
                                      tokens_per_sample(sample))


def train_step(parallel: ParallelModel, batch: Any, training: TrainConfig, config: ParallelConfig,
               model_module: Any, step: int = 0) -> torch.Tensor | None:
    """Forward and backward of every micro-batch, then optimizer step ``step`` (its learning rate,
    gradient clipping: clipping.py).

    Returns the mean micro-batch loss on ranks of the last pipeline stage, else None (with a
    token-level loss, this rank's share of the batch's: see token_loss.py).
    """
    loss_context = sharded_logits if config.loss_parallel else contextlib.nullcontext
    dtype = parallel.compute_dtype
    autocast = torch.autocast(parallel.device.type, dtype=dtype or torch.float32, enabled=dtype is not None)
    if parallel.token_counts is not None:
        parallel.token_counts.start()
    if config.dims.pp_enabled:
        with loss_context(), autocast:
            loss = run_pipeline(parallel.schedule, batch, parallel.is_last_stage,
                                traced=config.pipeline_split == "tracer")
        if parallel.tied_sync is not None:
            parallel.tied_sync(parallel.modules)
    else:
        model = parallel.modules[0]
        n = training.num_micro_batches
        rank_in_dp = dp_rank(parallel.mesh, config.dims)
        _, size = training.share(rank_in_dp)
        weight = training.loss_weight(rank_in_dp)
        total = torch.zeros((), device=parallel.device)
        for i in range(n):
            micro = slice_batch(batch, i * size, (i + 1) * size)
            # ZeRO-0/1 keep full gradients, so they are reduced once, after the last micro-batch;
            # ZeRO-2/3 shard gradients, so each micro-batch's are reduce-scattered as they come.
            if config.zero_stage <= 1:
                set_gradient_sync(model, i == n - 1)
            with loss_context():
                with autocast:
                    args, kwargs = model_inputs(model, micro)
                    output = model(*args, **kwargs)
                    if config.loss_parallel:
                        output = replicated_beside_shards(output, parallel.mesh[MeshAxis.TP.value])
                    loss = compute_loss(model_module, output, micro) * weight
                    if parallel.token_counts is not None:
                        loss = parallel.token_counts.weigh(loss)  # the sum over its counted targets
                    # Autograd keeps what backward needs; a name on the output (the logits, often
                    # the largest activation) would keep all of it through backward.
                    del output
                (loss / n).backward()
            total += (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().float()
        loss = total / n
    if parallel.token_counts is not None:
        loss = parallel.token_counts.finish(parallel.modules, config.dims.dp * config.dims.cp,
                                            training.num_micro_batches, config.dims.tp, loss)
    if config.experts_split:
        parallel.experts.scale_gradients(unsharded_named_parameters(parallel))
    if config.dims.tp_enabled:
        reduce_partial_gradients(parallel.modules)
    step_optimizer(parallel, training, config, step, unsharded_named_parameters(parallel))
    parallel.optimizer.zero_grad()
    return loss


def global_loss(loss: torch.Tensor | None, dims: ParallelDims, device: torch.device) -> float:
    """The loss as the last pipeline stage sees it, averaged over data-parallel ranks (every
    rank of the last stage contributes; tensor-parallel ranks hold the same value)."""
    value = torch.zeros((), dtype=torch.float64, device=device)
    if loss is not None:
        value += loss.double()
    dist.all_reduce(value)
    return float(value) / (dims.dp * dims.tp * dims.cp)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA allocator peak on GPUs, resident set size on CPUs."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def full_parameters(parallel: ParallelModel, config: ParallelConfig) -> dict[str, torch.Tensor] | None:
    """Every parameter as a full fp32 tensor under its FQN in the unsharded model (tied parameters
    under each of their names), gathered on rank 0; None on the other ranks."""
    state: dict[str, torch.Tensor] = {}
    rows = config.rows
    for name, parameter in unsharded_named_parameters(parallel):
        full = parameter.full_tensor() if isinstance(parameter, DTensor) else parameter
        full = rows.public(name, full)
        if config.experts_split:
            full = parallel.experts.full(name, full.detach())
        state[name] = full.detach().float().cpu()
    parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(state, parts, dst=0)
    if not parts:
        return None
    merged = {name: tensor for part in parts for name, tensor in part.items()}
    if parallel.schedule is not None:
        # A traced pipeline stage holds a tied tensor under one of its names only (T5's shared
        # embedding as encoder.embed_tokens); the copies are equal (TiedGradientSync), so each
        # name of the group gets it.
        for group in config.tied_parameters:
            kept = next((merged[name] for name in group if name in merged), None)
            merged.update({name: kept for name in group if kept is not None and name not in merged})
    return merged


def timed_step(parallel: ParallelModel, training: TrainConfig, config: ParallelConfig, model_module: Any,
               step: int, batches: Batches | None = None, logger: metrics.MetricsLogger | None = None
               ) -> dict[str, Any]:
    """One optimizer step, timed; rank 0 prints it, and ``logger`` records it (run.jsonl,
    dashboards). The batch comes from ``batches`` (the run's data), else example_batch."""
    device = parallel.device
    waited = time.perf_counter()
    if batches is None:
        batch = local_batch(training, config, model_module, step, parallel.mesh, device)
    else:
        batch = batches.next(step)
    waited = time.perf_counter() - waited  # on data: what loading ahead did not hide
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    loss = train_step(parallel, batch, training, config, model_module, step)
    loss_value = global_loss(loss, config.dims, device)
    step_time_s = time.perf_counter() - start
    memory = torch.tensor(peak_memory_bytes(device), dtype=torch.float64, device=device)
    dist.all_reduce(memory, op=dist.ReduceOp.MAX)
    tokens = training.global_batch_size * tokens_per_sample(batch) * config.dims.cp  # CP ranks hold 1/cp each
    # A restarted or resumed run repeats steps: the attempt (torchrun's restart count) and the
    # launch (torchrun's run id) tell the repeats apart in run.jsonl.
    record: dict[str, Any] = {
        "step": step, "loss": loss_value, "step_time_s": step_time_s, "tokens_per_s": tokens / step_time_s,
        "peak_memory_bytes": int(memory), "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "run_id": os.environ.get("TORCHELASTIC_RUN_ID", ""), "lr": parallel.lr,
        "grad_norm": None if parallel.grad_norm is None else float(parallel.grad_norm)}
    if batches is not None:
        record["samples"] = batches.position  # of the run's global order, consumed once this step is done
        record["data_wait_s"] = waited
    if dist.get_rank() == 0:
        print(f"step {step}  loss {loss_value:.4f}  {step_time_s * 1e3:.1f} ms  "
              f"{record['tokens_per_s']:,.0f} tokens/s  peak {record['peak_memory_bytes'] / 2**20:.0f} MiB",
              flush=True)
    if logger is not None:
        logger.log(record)
    return record


def validation_loss(parallel: ParallelModel, training: TrainConfig, config: ParallelConfig, model_module: Any,
                    batches: list[Any], step: int, logger: metrics.MetricsLogger | None = None) -> float:
    """The mean loss over the fixed validation batches (each averaged over data-parallel ranks
    as training's is), printed and recorded as ``val_loss`` after ``step`` optimizer steps."""
    losses = [global_loss(eval_step(parallel, batch, training, config, model_module), config.dims, parallel.device)
              for batch in batches]
    value = sum(losses) / len(losses)
    if dist.get_rank() == 0:
        print(f"step {step}  val_loss {value:.4f}", flush=True)
    if logger is not None:
        logger.log({"step": step, "val_loss": value, "val_batches": len(losses),
                    "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                    "run_id": os.environ.get("TORCHELASTIC_RUN_ID", "")})
    return value


def export_trained_weights(parallel: ParallelModel, config: ParallelConfig,
                           checkpoint: checkpointing.CheckpointConfig, step: int | None,
                           build: Callable[[], nn.Module]) -> None:
    """Write the trained weights (`write_export`): read back from the final checkpoint (``step``)
    when there is one (rank 0 alone, from disk: no rank gathers the whole model), else gathered."""
    path = checkpoint.export
    if path is None:
        return
    if checkpoint.directory is not None and checkpoint.enabled and step is not None:
        if dist.get_rank() == 0:
            final = Path(checkpoint.directory) / f"step_{step}"
            write_export(checkpointing.consolidated_weights(final), path, config.tied_parameters, build)
        return
    state = full_parameters(parallel, config)
    if state is not None:  # rank 0's
        write_export(state, path, config.tied_parameters, build)


def write_export(state: dict[str, torch.Tensor], path: str, tied: list[list[str]],
                 build: Callable[[], nn.Module]) -> None:
    """--export: one file for a path with a suffix (checkpointing.py), else a folder holding
    model.safetensors and, for a Hugging Face model, its config (pretrained.py; ``build`` makes
    the model on the meta device for it)."""
    if pretrained.is_folder_export(path):
        pretrained.write_folder(state, path, tied, build())
    else:
        checkpointing.write_weights(state, path)


def meta_model(model_module: Any, model_kwargs: dict[str, Any]) -> nn.Module:
    """The whole model on the meta device (no memory): its names, shapes and config."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        return build_model(model_module, model_kwargs, 0)


def start_from_pretrained(parallel: ParallelModel, training: TrainConfig, config: ParallelConfig, model_module: Any,
                          first_step: int) -> None:
    """--init-from: this rank's part of every parameter and persistent buffer read from the file
    (pretrained.py), on a fresh start only: a resumed checkpoint wins. Nothing without one."""
    if not training.init_from:
        return
    if first_step > 0:
        if dist.get_rank() == 0:
            print(f"--init-from {training.init_from} not loaded: the checkpoint resumed ({first_step} steps done) wins",
                  flush=True)
        return
    model = meta_model(model_module, training.model_kwargs)
    prefix = "model." if parallel.schedule is not None else ""  # a stage holds its model copy under `model`
    held = unsharded_named_parameters(parallel) + pretrained.persistent_buffers(parallel.modules, prefix)
    rows = config.rows
    pretrained.load_pretrained(training.init_from, pretrained.expected_tensors(model), held, config.tied_parameters,
                               pretrained.ignored_unexpected(model),
                               {name: functools.partial(rows.private, name) for name in rows.orders})
    if config.zero_stage == 1:  # ZeRO-1 updates a copy of its slice of the parameters, taken at set-up
        zero1 = getattr(parallel.optimizer, "optimizer", parallel.optimizer)  # inside a gradient exchange
        if isinstance(zero1, ShardedAdamW):
            zero1.reload_parameters()
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"initialised from {training.init_from}", flush=True)


LOOPBACK = "127.0.0.1"


def join_process_group(backend: str) -> None:
    """Join the ranks torchrun started (env://). When they meet on the loopback address (a local
    run) and rank 0 hosts the store (torchrun's own is not shared: see launch.sh; a launcher
    hosting it in torchrun's agent says so in TORCHELASTIC_USE_AGENT_STORE), rank 0's store
    listens on 127.0.0.1 only: torch's env:// start would listen on every interface, open to
    anyone who can reach the machine."""
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if address != LOOPBACK or port is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        dist.init_process_group(backend)
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # The store takes over the listening socket's descriptor (detach: Python must not close it).
    listener = socket.create_server((LOOPBACK, int(port))).detach() if rank == 0 else None
    store = dist.TCPStore(LOOPBACK, int(port), world_size, is_master=rank == 0, master_listen_fd=listener,
                          multi_tenant=True, timeout=dist.constants.default_pg_timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)


def train(training: TrainConfig, config: ParallelConfig, tp_plan: Callable[[], dict[str, ParallelStyle]],
          expected_sha256: str | None = None, after_steps: Callable[..., None] | None = None) -> list[dict[str, float]]:
    """Train for ``training.steps`` steps on this rank; returns the per-step records (rank 0 also
    appends them to ``training.log_file``). Joins the default process group, creating it from the
    torchrun environment if needed. ``after_steps(parallel, training, config, model_module, records)``
    runs after the last step (a validation run measures two more steps there)."""
    device, backend = pick_device()
    if config.dp_sync in NCCL_ALGORITHMS:
        if backend == "nccl":
            # The all-reduce algorithm the planner priced (NCCL reads this when it starts; other
            # collectives keep NCCL's own choice). A user's setting wins.
            os.environ.setdefault("NCCL_ALGO", f"allreduce:{config.dp_sync}")
    metrics.require_packages(training.metrics)  # every rank, before any joins the others
    created = not dist.is_initialized()
    if created:
        join_process_group(backend)
    logger = None
    try:
        if expected_sha256 and file_sha256(training.model_file) != expected_sha256 and dist.get_rank() == 0:
            print(f"warning: {training.model_file} changed since the plan was made; the plan may not fit it")
        checkpointing.check_export_path(training.checkpoint.export)
        pretrained.check_paths(training.init_from, training.checkpoint.export)
        if config.experts_split and (training.checkpoint.enabled or training.checkpoint.export or training.init_from):
            # Each rank's experts are slices under the unsharded names: a checkpoint would keep one.
            raise ValueError("checkpoints and pretrained weights of expert-parallel runs are not supported yet: run "
                             "without --checkpoint-every/--export/--init-from, or compile a plan with plan.ep=1 and "
                             "plan.expert_tp=false")
        model_module = load_model_file(training.model_file)
        parallel = setup(training, config, tp_plan, model_module, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)  # report training's peak, not set-up's
        checkpointer = checkpointing.Checkpointer(training.checkpoint, parallel.modules, parallel.optimizer,
                                                  config.dims, config.tied_parameters, config.rows)
        first_step = checkpointer.resume() if training.checkpoint.enabled else 0
        source = open_data(training, model_module, forward_arguments_of(parallel.modules[0]))
        # Samples of the run's global order consumed before this start (a checkpoint written
        # before positions were saved: the steps' worth).
        start = checkpointer.samples if checkpointer.samples is not None else first_step * training.global_batch_size
        batches = Batches(source, training, config, model_module, parallel.mesh, device, first_step, start)
        validation = (validation_batches(source, training, config, model_module, parallel.mesh, device)
                      if training.eval_every > 0 else [])
        start_from_pretrained(parallel, training, config, model_module, first_step)
        records = []
        logger = metrics.open_logger(training.log_file, training.metrics, dist.get_rank())
        dropout = DropoutOff() if training.dropout_off else contextlib.nullcontext()
        with attention_context(parallel, config, training, model_module), dropout:
            for step in range(first_step, training.steps):
                checkpointing.inject_failure(step, training.fail_at_step)
                records.append(timed_step(parallel, training, config, model_module, step, batches, logger))
                done = step + 1
                if validation and (done % training.eval_every == 0 or done == training.steps):
                    validation_loss(parallel, training, config, model_module, validation, done, logger)
                if training.checkpoint.enabled and done % training.checkpoint.every == 0:
                    checkpointer.save(done, batches.position)
            if after_steps is not None:  # inside the attention context: more steps may run
                after_steps(parallel, training, config, model_module, records)
        if training.checkpoint.enabled:
            checkpointer.finish(training.steps, batches.position)
        if training.save_final:
            state = full_parameters(parallel, config)
            if dist.get_rank() == 0:
                torch.save(state, training.save_final)
        if training.checkpoint.export:
            export_trained_weights(parallel, config, training.checkpoint, checkpointer.last_saved,
                                   lambda: meta_model(model_module, training.model_kwargs))
        # Every rank past its last collective before any tears the group down: gloo aborts a
        # process whose peer exits while a transfer thread is still winding down.
        dist.barrier()
        # Said once everything is written: should a rank still die in the teardown below (gloo
        # on an oversubscribed CPU aborts now and then), the launcher knows the run finished.
        print(f"{FINISHED_MARKER} rank {dist.get_rank()} of {dist.get_world_size()} attempt "
              f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", flush=True)
        return records
    finally:
        if logger is not None:
            logger.close()
        if created:
            dist.destroy_process_group()


def optimizer_settings(settings: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The generated optimizer settings with the command line's overrides."""
    return {**settings, "lr": args.lr, "warmup_steps": args.warmup_steps, "schedule": args.schedule,
            "min_lr": args.min_lr, "max_grad_norm": args.max_grad_norm, "decay_steps": args.decay_steps}


def parse_args(argv: list[str] | None, defaults: dict[str, Any]) -> argparse.Namespace:
    """Command-line overrides of the generated defaults."""
    parser = argparse.ArgumentParser(description="Train with the generated parallel plan (launch with torchrun).")
    parser.add_argument("--steps", type=int, default=defaults["steps"], help="optimizer steps to run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the batches")
    parser.add_argument("--lr", type=float, default=defaults["lr"], help="AdamW learning rate")
    optimizer = defaults.get("optimizer", {})
    parser.add_argument("--warmup-steps", type=int, default=optimizer.get("warmup_steps", 0),
                        help="linear learning-rate warmup steps")
    parser.add_argument("--schedule", choices=("constant", "linear", "cosine", "wsd"),
                        default=optimizer.get("schedule", "constant"), help="learning-rate schedule after warmup")
    parser.add_argument("--decay-steps", type=int, default=optimizer.get("decay_steps"), metavar="N",
                        help="steps the schedule reaches min-lr at (default: --steps; pin it to resume a run "
                             "with more --steps on the schedule it started)")
    parser.add_argument("--min-lr", type=float, default=optimizer.get("min_lr", 0.0),
                        help="learning rate the schedule decays to")
    parser.add_argument("--max-grad-norm", type=float, default=optimizer.get("max_grad_norm", 0.0),
                        help="clip gradients to this global L2 norm (0: no clipping)")
    parser.add_argument("--model-file", default=defaults["model_file"], help="the model.py to train")
    parser.add_argument("--log-file", default=defaults["log_file"], help="append one JSON record per step here")
    parser.add_argument("--save-final", default=None, help="save the trained parameters (full tensors) here")
    parser.add_argument("--dropout-off", action="store_true",
                        help="train with the model's dropout off (what compile's check runs to compare the plan "
                             "with one process, whose dropout masks no sharded run draws)")
    parser.add_argument("--checkpoint-dir", default=defaults.get("checkpoint_dir"),
                        help="checkpoint folder (DIR/step_<n>/); resuming starts from its latest complete one")
    parser.add_argument("--checkpoint-every", type=int, default=defaults.get("checkpoint_every", 0), metavar="N",
                        help="save a checkpoint every N steps and after the last (0: no checkpoints, no resuming)")
    parser.add_argument("--async-checkpoint", action="store_true",
                        help="write checkpoints in the background while training goes on")
    parser.add_argument("--allow-fresh-start", action="store_true",
                        help="when every checkpoint is unusable (files not matching their checksums), train "
                             "from step 0 instead of failing")
    parser.add_argument("--export", default=None, metavar="PATH",
                        help="write the trained weights: PATH.safetensors or PATH.pt, one file; a folder (no suffix): "
                             "model.safetensors and, for a Hugging Face model, its config (from_pretrained loads it); "
                             "without torchrun, consolidate the latest checkpoint of --checkpoint-dir and exit")
    parser.add_argument("--init-from", default=None, metavar="PATH",
                        help="start from these weights instead of the seed's: a .safetensors file, a Hugging Face "
                             "model folder, or a torch state dict file (a resumed checkpoint wins)")
    parser.add_argument("--data", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of the built-in text pipeline (data.path, data.tokenizer, data.val_path, "
                             "data.val_fraction, data.num_workers, ...), over the compiled DATA; repeatable")
    parser.add_argument("--eval-every", type=int, default=defaults.get("eval_every", 0), metavar="N",
                        help="validation loss every N steps and after the last (0: never)")
    parser.add_argument("--eval-batches", type=int, default=defaults.get("eval_batches", 4), metavar="K",
                        help="global batches the validation loss averages over")
    parser.add_argument("--fail-at-step", type=int, default=None, metavar="STEP",
                        help="fault injection: the last rank kills itself (SIGKILL) at STEP in torchrun's first "
                             "attempt, to try restarts (--max-restarts) and resuming")
    metrics.add_arguments(parser)
    return parser.parse_args(argv)

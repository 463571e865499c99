"""One rank of a compiled plan on fake tensors at its full world size: compile's proof at full scale
(autopar/runtime/proof.py) runs one training step of it, and the memory check
(autopar/runtime/fake_memory.py) measures it.

torch's ``fake`` process-group backend stands in for the other ranks (collectives return at once);
the generated module's ``setup(..., fake_mode=...)`` builds the model on the meta device, shards it
with the real mesh (DTensor, FSDP2) and gives this rank's shards fake storage. A pipeline schedule
cannot run on fake data (its stages first agree on shapes by exchanging values), so with pp > 1
each local stage module runs a micro-batch forward and backward, with FSDP set as torch's
PipelineStage sets it, then the schedule's gradient reduction and optimizer step.
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator, Protocol

import torch
import torch.distributed as dist
from torch import nn

from autopar.sections.pipeline import first_called
from autopar.runtime.generated import command_line, import_generated


class StageWatch(Protocol):
    """What watches one stage module's micro-batch (the memory check's tracker): entered around its
    forward and backward, told where the forward begins and ends."""

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: Any) -> Any: ...

    def forward_begins(self) -> None: ...

    def forward_ends(self) -> None: ...


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """This process as rank ``rank`` of ``world_size``, the others faked (torch's ``fake`` backend)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclass
class FakeRank:
    """One rank of a compiled plan set up on fake tensors, ready to train."""

    generated: ModuleType
    parallel: Any
    batch: Any
    training: Any
    config: Any
    model_module: Any
    fake_mode: Any
    pp_rank: int


@contextlib.contextmanager
def fake_rank(out_dir: str | Path, rank: int, propagation: "ShardingPropagation") -> Iterator[FakeRank]:
    """Rank ``rank`` of the compiled folder's plan, built, sharded and given its first batch on
    fake tensors at the plan's full world size (the other ranks faked)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autopar.data_dependent import data_dependent_fake_mode, register_missing_fake_kernels, tracing_in
    from autopar.trace.grouped_mm import allow_fp32_grouped_mm_on_fake_tensors

    allow_fp32_grouped_mm_on_fake_tensors()
    register_missing_fake_kernels()
    out_dir = Path(out_dir)
    plan = json.loads((out_dir / "plan.json").read_text())
    world_size = plan["dp"] * plan["tp"] * plan["pp"] * plan["cp"]
    with fake_world(rank, world_size):
        generated = import_generated(next(out_dir.glob("parallel_*.py")), f"fake_rank_{out_dir.name}")
        training = generated.train_config(generated.PLAN, command_line(generated))
        config = generated.parallel_config(generated.PLAN)
        model_module = generated.load_model_file(training.model_file)
        if plan.get("data_dependent"):  # shapes or branches depend on values: the batch's are real
            fake_mode, _ = data_dependent_fake_mode(allow_non_fake_inputs=True)
        else:
            fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        device = torch.device("cpu")
        parallel = generated.setup(training, config, generated.tp_plan, model_module, device, fake_mode=fake_mode)
        pp_rank = parallel.mesh["pp"].get_local_rank() if config.dims.pp_enabled else 0
        with propagation.active(), tracing_in(fake_mode), \
                generated.attention_context(parallel, config, training, model_module):
            batch = generated.local_batch(training, config, model_module, 0, parallel.mesh, device)
            yield FakeRank(generated, parallel, batch, training, config, model_module, fake_mode, pp_rank)


@dataclass
class StepRun:
    """What one rank's training step on fake tensors ran: in words, and for pp > 1 the micro-batch,
    the rank's local stages and the inputs they received (a measurement that goes on in the same
    fake world, autopar/runtime/fake_memory.py, runs them again)."""

    words: str
    micro: Any = None
    indices: list[int] = field(default_factory=list)
    received: dict[int, torch.Tensor] = field(default_factory=dict)


# What goes on after the step in the same fake world (the memory check), given the rank, what the
# step ran and the sharding propagation in force; it returns what it did, in words.
AfterStep = Callable[[FakeRank, StepRun, "ShardingPropagation"], str]


def train_fake_step(out_dir: str | Path, rank: int = 0, after: AfterStep | None = None) -> str:
    """One training step of rank ``rank`` of the compiled folder's plan on fake tensors, untracked
    (compile's proof at full scale, autopar/runtime/proof.py), then ``after`` (if given) in the
    same fake world; what ran, in words. Raises whatever the generated module raises.

    pp = 1 runs the generated ``train_step``; pp > 1 runs each local stage module's forward and
    backward of a micro-batch, then the schedule's gradient reduction and optimizer step, as
    ``measure_rank`` does (a schedule cannot run on fake data: its stages exchange values)."""
    generated = import_generated(next(Path(out_dir).glob("parallel_*.py")), f"fake_step_{Path(out_dir).name}")
    config = generated.parallel_config(generated.PLAN)
    if config.dims.pp_enabled and config.pipeline_split == "tracer":
        # torch.export of the whole model cuts these stages, and it cannot run on fake tensors
        return (f"rank {rank}: not run on fake tensors (its pipeline stages are cut by torch.export, which "
                "needs real tensors)")
    propagation = ShardingPropagation()
    with fake_rank(out_dir, rank, propagation) as r:
        run = step_on(r, rank)
        return run.words if after is None else after(r, run, propagation)


def step_on(r: FakeRank, rank: int) -> StepRun:
    """One training step of the set-up rank ``r`` (see `train_fake_step`)."""
    if r.parallel.schedule is None:
        r.generated.train_step(r.parallel, r.batch, r.training, r.config, r.model_module)
        return StepRun(f"rank {rank}: train_step")
    micro = r.generated.slice_batch(r.batch, 0, r.training.micro_batch_size)
    indices = r.generated.local_stage_indices(len(r.config.stages), r.config.dims.pp, r.pp_rank)
    received = stage_inputs(r.generated, r.training, r.config, r.model_module, r.parallel.mesh, r.fake_mode,
                            micro, indices)
    stage_micro_batch(r.generated, r.parallel, micro, received, r.config, indices)
    finish_stage_step(r.parallel)
    return StepRun(f"rank {rank} (pipeline rank {r.pp_rank}): stage(s) {indices} forward, backward and optimizer "
                   "step", micro, indices, received)


def stage_inputs(generated: ModuleType, training: Any, config: Any, model_module: Any, mesh: Any, fake_mode: Any,
                  micro: Any, indices: list[int]) -> dict[int, torch.Tensor]:
    """Fake tensors shaped like what each local stage (but the first) receives: the input of its
    first layer in this rank's shard of the whole model (built and parallelised as for pp = 1,
    run forward once without autograd)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    wanted = {config.stages[i][0]: i for i in indices if i > 0}
    if not wanted:
        return {}
    layers = [layer for stage in config.stages for layer in stage]
    plan = generated.tp_plan() if config.dims.tp_enabled else {}
    dtype = generated.compute_dtype(training.precision, torch.device("cpu"), as_gpu=True)
    with unset_fake_temporarily():  # built on meta like setup's model: device meshes need real tensors
        with torch.device("meta"):
            model = generated.build_model(model_module, training.model_kwargs, training.seed)
        generated.parallelize(model, model, layers, mesh, config, plan, dtype)
    seen: dict[int, torch.Tensor] = {}

    def capture(name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            value = args[0] if args else next(iter(kwargs.values()))
            local = value.to_local() if hasattr(value, "to_local") else value
            seen[wanted[name]] = torch.zeros_like(local.detach())
        return hook

    handles = [first_called(model, name).register_forward_pre_hook(capture(name), with_kwargs=True, prepend=True)
               for name in wanted]
    loss_context = generated.loss_parallel if config.loss_parallel else contextlib.nullcontext
    with fake_mode:
        generated.place(model, torch.device("cpu"))
        args, kwargs = generated.model_inputs(model, micro)
        with torch.no_grad(), loss_context(), torch.autocast("cpu", dtype=dtype or torch.float32,
                                                             enabled=dtype is not None):
            model(*args, **kwargs)
    for handle in handles:
        handle.remove()
    return seen


def stage_micro_batch(generated: ModuleType, parallel: Any, micro: Any, received: dict[int, torch.Tensor],
                      config: Any, indices: list[int],
                      watch: Callable[[int, nn.Module], StageWatch] | None = None) -> None:
    """Forward and backward of one micro-batch through each local stage, with FSDP's resharding
    and gradient reduction off as torch's PipelineStage sets them for every micro-batch; with
    ``watch``, each stage module's work under the StageWatch it returns for (index, module)."""
    from torch.distributed.fsdp import FSDPModule

    loss_context = generated.loss_parallel if config.loss_parallel else contextlib.nullcontext
    dtype = parallel.compute_dtype
    kwargs = generated.batch_to_kwargs(micro)
    for index, module in zip(indices, parallel.modules):
        watcher = watch(index, module) if watch is not None else None
        inputs = () if index == 0 else (received[index].detach().requires_grad_(),)
        if isinstance(module, FSDPModule):
            module.set_is_last_backward(False)
            module.set_reshard_after_backward(False)
            module.set_requires_gradient_sync(False)
        with watcher or contextlib.nullcontext(), loss_context(), \
                torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            if watcher is not None:
                watcher.forward_begins()
            output = module(*inputs, **kwargs)
            if watcher is not None:
                watcher.forward_ends()
            if output.requires_grad:  # a stage of frozen parameters only (a fixed table) has no backward
                output.backward(None if output.dim() == 0 else torch.ones_like(output))


def finish_stage_step(parallel: Any) -> None:
    """The schedule's last actions: reduce the accumulated gradients, sync tied copies, step."""
    for stage in pipeline_stages(parallel.schedule):
        stage.perform_reduce_grad(1)
    if parallel.tied_sync is not None:
        parallel.tied_sync(parallel.modules)
    parallel.optimizer.step()
    parallel.optimizer.zero_grad()


def pipeline_stages(schedule: Any) -> list[Any]:
    """The PipelineStage objects a schedule runs (one, or a rank's chunks when interleaved)."""
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages is not None else [schedule._stage]


class ShardingPropagation:
    """Whether DTensor is working out an op's output shape right now.

    DTensor learns an op's global output shape by running it on global-shape fake tensors under
    the active fake mode (``ShardingPropagator._propagate_tensor_meta_non_cached``, and under a
    fake mode it never uses its cache). On a real rank that mode is a private one the trackers
    ignore; here it is ours, so the trackers would count those global-shape tensors (tp times
    a shard, a whole unsharded parameter in the optimizer step) as this rank's memory. torch
    enters ``ShardingPropagator._fake_mode_lock`` around exactly that computation; while
    `active` this stands in for it and counts."""

    def __init__(self) -> None:
        self.depth = 0

    def __enter__(self) -> "ShardingPropagation":
        self.depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        self.depth -= 1

    @contextlib.contextmanager
    def active(self) -> Iterator["ShardingPropagation"]:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        if not hasattr(ShardingPropagator, "_fake_mode_lock"):
            raise RuntimeError("this torch has no ShardingPropagator._fake_mode_lock: DTensor's shape propagation "
                               "cannot be told apart from this rank's tensors")
        # A private attribute of torch's, patched for the step and put back after it.
        previous = getattr(ShardingPropagator, "_fake_mode_lock")
        setattr(ShardingPropagator, "_fake_mode_lock", self)
        try:
            yield self
        finally:
            setattr(ShardingPropagator, "_fake_mode_lock", previous)

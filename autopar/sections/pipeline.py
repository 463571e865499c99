"""Pipeline parallelism: cut the model into stages at the plan's layer boundaries and schedule them.

A stage is a copy of the whole model in which the layers of other stages are dropped:
    - layers of *earlier* stages become `SkippedLayer`s that return zeros of the right shape
      (worked out on the meta device, so they cost neither memory nor compute);
    - the first layer of a *later* stage becomes a `StageExit`, which ends the stage by raising
      `StageBoundary` with its input: the activation to send on;
    - the stage's own first layer gets its input replaced by the activation received.
The model's own forward runs unchanged on every stage, so whatever it computes between layers
(positions, rotary tables, masks, the loss) is computed where it is needed. This relies on
the residual stream entering each layer as its first argument, and on the code between layers
using no parameters of its own, which holds for models whose blocks live in a ModuleList or
ModuleDict (GPT-2, Llama and most decoder stacks); codegen checks the rest by tracing what
every layer and the loss read (autopar/codegen/stage_flow.py: an encoder's output read by
each decoder layer is not carried). Otherwise `split_with_tracer` cuts an
exported graph of the model and its loss instead (torch's ``pipeline()`` with split points);
such stages are graphs, so tensor parallelism and recomputation, which act on modules, are
not available with them. The model's batch goes to every stage as keyword arguments (the
schedule splits it into micro-batches), and the last stage returns the loss.
"""
from __future__ import annotations

import copy
import inspect
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx.experimental._config
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, SplitPoint, pipeline)
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from autopar.sections.contract import compute_loss, model_inputs
from autopar.sections.mesh import axis_names

# torch's config modules gain patch() when installed, which a type checker cannot see.
SHAPE_CONFIG: Any = torch.fx.experimental._config

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


class StageBoundary(Exception):
    """Raised by a `StageExit` to end a stage's forward with the activation it carries."""

    def __init__(self, activation: torch.Tensor):
        super().__init__("stage boundary")
        self.activation = activation


def _first_input(module: nn.Module, args: tuple, kwargs: dict) -> tuple[str | int, Any]:
    """Where a layer's first input is (position 0 or its keyword) and its value."""
    if args:
        return 0, args[0]
    name = next(iter(inspect.signature(module.forward).parameters))
    return name, kwargs[name]


# torch's errors for a value read on meta tensors: .item(); .tolist() and other copies to the
# host (.cpu(): JetMoE's expert counts)
META_VALUE_READS = ("cannot be called on meta tensors", "Cannot copy out of meta tensor")


def _to_meta(value: Any) -> Any:
    return tree_map_only(torch.Tensor, lambda tensor: tensor.detach().to("meta"), value)


def _zeros_like_meta(value: Any, device: torch.device) -> Any:
    # pytree keeps the output's own type (a Hugging Face ModelOutput stays one: code after the
    # layer reads ``outputs[0]`` or ``outputs.pooler_output``).
    return tree_map_only(torch.Tensor, lambda meta: torch.zeros(meta.shape, dtype=meta.dtype, device=device), value)


class MetaShapes(TorchDispatchMode):
    """Shapes on the meta device of ops whose meta kernel refuses inputs their CPU kernel takes.

    torch 2.13's grouped GEMM (``aten._grouped_mm``: Hugging Face's MoE experts) copies the CUDA
    kernel's bf16-only check into its meta kernel, so a fp32 MoE layer has no meta shapes. Its
    output shape does not depend on the dtype: computed in bf16 (free on meta), cast back.
    (Tracing relaxes the same check on the planner's side; the generated module needs nothing but
    torch and the model file, so it carries this narrower, local form.)
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16 \
                and args[0].dtype == args[1].dtype and kwargs.get("out_dtype") is None:
            dtype = args[0].dtype
            low = tuple(a.to(torch.bfloat16) if i < 2 else a for i, a in enumerate(args))
            return func(*low, **kwargs).to(dtype)
        return func(*args, **kwargs)


class _StandIn(nn.Module):
    """Stands in for a layer of another stage. The model's code may still read the layer's
    attributes (ViT reads its patch embedding's weight dtype, ModernBERT each layer's
    ``attention_type`` before calling it): a meta copy of the layer answers them, holding no
    memory and registered nowhere."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self._meta_layer = [copy.deepcopy(layer).to("meta")]  # a list: not a registered submodule

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__") or "_meta_layer" not in self.__dict__:
                raise
            return getattr(self._meta_layer[0], name)


class SkippedLayer(_StandIn):
    """Stands in for a layer of an earlier stage: zeros shaped like that layer's output.

    Only shapes matter: the stage replaces its own first layer's input with the activation it
    received, so these values are never used for anything but shape and dtype.
    """

    def __init__(self, layer: nn.Module, device: torch.device):
        super().__init__(layer)
        self.device = device

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # A layer that selects rows by value (``nonzero``, a boolean mask: a mixture of experts'
        # loop) has no meta shapes unless every element is taken as selected, an upper bound.
        try:
            with torch.no_grad(), MetaShapes(), SHAPE_CONFIG.patch(meta_nonzero_assume_all_nonzero=True):
                shapes = self._meta_layer[0](*_to_meta(args), **_to_meta(kwargs))
        except (RuntimeError, NotImplementedError) as err:  # .tolist() raises the second
            if not any(words in str(err) for words in META_VALUE_READS):
                raise
            # A layer that reads a value as a number (DBRX indexes its experts' weights with a
            # tensor: ``.item()``; JetMoE copies its experts' token counts to the host) has none
            # on meta tensors. A residual block gives back its input's shape; were this one to
            # give another, the stage's code after it would not run or would train something
            # else, which compile's proof catches.
            shapes = _to_meta(_first_input(self._meta_layer[0], args, kwargs)[1])
        return _zeros_like_meta(shapes, self.device)


class StageExit(_StandIn):
    """Stands in for the first layer of the next stage (and every later one): ends this stage
    with the layer's input."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        _, activation = _first_input(self._meta_layer[0], args, kwargs)
        raise StageBoundary(activation)


def batch_to_kwargs(batch: Any) -> dict[str, torch.Tensor]:
    """The batch as flat keyword arguments ``batch_0, batch_1, ...`` (the schedule passes
    keyword arguments to every stage and splits them into micro-batches)."""
    if isinstance(batch, dict):
        return {f"batch_{i}": v for i, v in enumerate(batch.values())}
    if isinstance(batch, (tuple, list)):
        return {f"batch_{i}": v for i, v in enumerate(batch)}
    return {"batch_0": batch}


def kwargs_to_batch(kwargs: dict[str, torch.Tensor], like: Any) -> Any:
    """Inverse of `batch_to_kwargs`, shaped like the example batch ``like``."""
    values = [kwargs[f"batch_{i}"] for i in range(len(kwargs))]
    if isinstance(like, dict):
        return dict(zip(like.keys(), values))
    if isinstance(like, (tuple, list)):
        return type(like)(values)
    return values[0]


class PipelineStageModule(nn.Module):
    """One pipeline stage: the model with other stages' layers dropped (see the module docstring).

    forward(*received, **batch) returns the activation for the next stage, or on the last
    stage the loss of this micro-batch.
    """

    def __init__(self, model: nn.Module, model_module: Any, example_batch: Any, first_layer: str | None,
                 is_last: bool):
        super().__init__()
        self.model = model
        self._model_module = model_module
        self._example_batch = example_batch
        self._first_layer = first_layer
        self._is_last = is_last
        self._received: torch.Tensor | None = None

    def attach_input(self) -> None:
        """Route the received activation into the stage's first layer. Called after TP,
        recomputation and FSDP have wrapped the layers, so it runs before all their hooks."""
        if self._first_layer is None:
            return
        layer = first_called(self.model, self._first_layer)

        def replace_first_input(module: nn.Module, args: tuple, kwargs: dict):
            where, _ = _first_input(module, args, kwargs)
            if where == 0:
                return (self._received,) + tuple(args[1:]), kwargs
            return args, {**kwargs, where: self._received}

        layer.register_forward_pre_hook(replace_first_input, with_kwargs=True, prepend=True)

    def forward(self, *received: torch.Tensor, **batch_kwargs: torch.Tensor) -> torch.Tensor:
        batch = kwargs_to_batch(batch_kwargs, self._example_batch)
        self._received = received[0] if received else None
        if self._received is not None and self._received.requires_grad:
            # Sends take contiguous tensors only; the gradient of what was received has whatever
            # layout the first layer leaves it (ConvNeXt's stages begin with a permute).
            self._received.register_hook(torch.Tensor.contiguous)
        try:
            args, kwargs = model_inputs(self.model, batch)
            output = self.model(*args, **kwargs)
        except StageBoundary as boundary:
            activation = boundary.activation
            # Activations travel as plain contiguous tensors (what sends take; ConvNeXt's layers
            # end in a permute); the next layer's input style re-wraps them.
            return (activation.to_local() if isinstance(activation, DTensor) else activation).contiguous()
        finally:
            self._received = None
        if not self._is_last:
            raise RuntimeError("a pipeline stage ran to the end of the model without reaching the next stage")
        loss = compute_loss(self._model_module, output, batch)
        return loss.to_local() if isinstance(loss, DTensor) else loss


def split_stage(model: nn.Module, stages: list[list[str]], stage_index: int, model_module: Any,
                example_batch: Any, device: torch.device) -> PipelineStageModule:
    """Stage ``stage_index`` of ``model``: its layers kept, the others dropped.

    Args:
        model: the full model (left untouched; the stage is a copy).
        stages: layer FQNs of every stage in order (plan.stages).
        stage_index: which stage to build.
        model_module: the user's model.py (for the loss on the last stage).
        example_batch: a batch, for its structure.
        device: where zeros for skipped layers are made.
    """
    stage = copy.deepcopy(model)
    earlier = [name for s in stages[:stage_index] for name in s]
    later = [name for s in stages[stage_index + 1:] for name in s]
    for name in earlier:
        _replace_called(stage, name, lambda layer: SkippedLayer(layer, device))
    for name in later:
        _replace_called(stage, name, StageExit)
    return PipelineStageModule(stage, model_module, example_batch,
                               first_layer=stages[stage_index][0] if stage_index > 0 else None,
                               is_last=stage_index == len(stages) - 1)


def _replace_called(model: nn.Module, name: str, make: Callable[[nn.Module], nn.Module]) -> None:
    """Replace layer ``name`` by ``make(layer)``; a ModuleList/ModuleDict layer, which the model
    iterates and never calls (a whole encoder stack as one layer), has each child replaced."""
    layer = model.get_submodule(name)
    if _is_container(layer):
        for child, _ in list(layer.named_children()):
            _replace_called(model, f"{name}.{child}", make)
        return
    owner, _, attribute = name.rpartition(".")
    model.get_submodule(owner).register_module(attribute, make(layer))


def _is_container(module: nn.Module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.ModuleDict)) and len(module) > 0


def first_called(model: nn.Module, name: str) -> nn.Module:
    """The module that runs first when layer ``name`` does: the layer, or a container's first child."""
    layer = model.get_submodule(name)
    while _is_container(layer):
        layer = next(iter(layer.children()))
    return layer


class TracedLoss(nn.Module):
    """Model + loss as one module for the tracer: forward(*batch) -> loss of that micro-batch."""

    def __init__(self, model: nn.Module, model_module: Any, example_batch: Any):
        super().__init__()
        self.model = model
        self._model_module = model_module
        self._example_batch = example_batch

    def forward(self, *leaves: torch.Tensor) -> torch.Tensor:
        # Copies made here belong to the first stage, which hands them on; the traced
        # pipeline cannot feed the batch to later stages any other way (labels for the loss).
        leaves = tuple(leaf.clone() for leaf in leaves)
        batch = kwargs_to_batch({f"batch_{i}": leaf for i, leaf in enumerate(leaves)}, self._example_batch)
        args, kwargs = model_inputs(self.model, batch)
        return compute_loss(self._model_module, self.model(*args, **kwargs), batch)


def split_with_tracer(model: nn.Module, stages: list[list[str]], model_module: Any, example_micro_batch: Any):
    """Export model + loss on one micro-batch and cut the graph where each stage's first layer
    begins; returns torch's ``Pipe`` (``pipe.get_stage_module(i)``, ``pipe.build_stage(...)``)."""
    traced = TracedLoss(model, model_module, example_micro_batch)
    leaves = tuple(batch_to_kwargs(example_micro_batch).values())
    split_spec = {f"model.{stage[0]}": SplitPoint.BEGINNING for stage in stages[1:]}
    pipe = pipeline(traced, mb_args=leaves, split_spec=split_spec)
    stage_modules = [pipe.get_stage_module(index) for index in range(pipe.num_stages)]
    for stage in stage_modules:
        assert isinstance(stage, torch.fx.GraphModule)  # a traced split's stages are graphs
        send_contiguous(stage)
    carry_unused_parameters(model, stage_modules)
    return pipe


def carry_unused_parameters(model: nn.Module, stages: list[nn.Module]) -> None:
    """Give the first stage every parameter of ``model`` that no traced stage holds, under its
    own name.

    torch's split keeps a parameter only where a graph reads it, so one the forward and loss never
    read (DeBERTa-v2's masked-LM head bias beside its untied decoder's own) would be in no stage:
    missing from saved, exported and checkpointed weights and from --init-from. Carried unread, it
    gets no gradient, and the optimizer leaves it as one process does."""
    held = {name for stage in stages for name, _ in named_parameters_in_stage(stage)}
    names_of: dict[nn.Parameter, list[str]] = {}  # a tied tensor under each of its names
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(parameter, []).append(name)
    for parameter, names in names_of.items():
        if held.isdisjoint(names):  # a tied tensor held under another of its names is not missing
            *path, leaf = f"model.{names[0]}".split(".")
            owner = stages[0]
            for atom in path:
                if not hasattr(owner, atom):
                    owner.add_module(atom, nn.Module())
                owner = getattr(owner, atom)
            owner.register_parameter(leaf, parameter)


def send_contiguous(stage: torch.fx.GraphModule) -> None:
    """Make every tensor a traced stage sends or receives contiguous.

    Point-to-point sends and receives (gloo's and NCCL's) take contiguous tensors only, but the
    traced stage makes its receive buffers with the strides the exported graph recorded, which
    are a view's (T5 hands on a transposed tensor). The stage's outputs get a ``.contiguous()``
    and its inputs' recorded strides become the contiguous ones; values are unchanged.
    """
    graph = stage.graph
    for node in graph.nodes:
        if node.op == "placeholder" and _strided(node):
            node.meta["val"] = _contiguous_meta(node.meta["val"])
    output = next(node for node in graph.nodes if node.op == "output")

    def contiguous(node: Any) -> Any:
        if not isinstance(node, torch.fx.Node) or not _strided(node):
            return node
        with graph.inserting_before(output):
            made = graph.call_method("contiguous", (node,))
        made.meta["val"] = _contiguous_meta(node.meta["val"])
        return made

    output.args = torch.fx.node.map_aggregate(output.args, contiguous)
    stage.recompile()


def _strided(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and not value.is_contiguous()


def _contiguous_meta(value: torch.Tensor) -> torch.Tensor:
    return torch.empty(value.shape, dtype=value.dtype, device="meta", requires_grad=value.requires_grad)


def local_stage_indices(num_stages: int, pp: int, pp_rank: int) -> list[int]:
    """Stages this pipeline rank runs: j, j + pp, ... (looping placement for interleaving)."""
    return list(range(pp_rank, num_stages, pp))


def module_stages(stage_modules: list[nn.Module], stage_indices: list[int], num_stages: int, pp_mesh: DeviceMesh,
                  device: torch.device) -> list[PipelineStage]:
    """Pipeline stages around this rank's stage modules (already parallelised: TP, recompute, FSDP).

    Args:
        stage_modules: this rank's `PipelineStageModule`s.
        stage_indices: their stage numbers.
        num_stages: stages in the whole pipeline (pp x chunks).
        pp_mesh: the 1-D pipeline submesh (point-to-point sends go over its group).
        device: this rank's device.
    """
    return [PipelineStage(module, index, num_stages, device, group=pp_mesh.get_group())
            for module, index in zip(stage_modules, stage_indices)]


def build_pipeline(stages: list[Any], schedule: str, num_micro_batches: int,
                   loss_fn: Callable[[torch.Tensor, Any], torch.Tensor] | None = None):
    """The pipeline schedule running this rank's stages.

    Args:
        stages: this rank's pipeline stages (one, or chunks of them for interleaving).
        schedule: "gpipe", "1f1b" or "interleaved_1f1b".
        num_micro_batches: micro-batches per step per data-parallel rank.
        loss_fn: what the last stage's output (the micro-batch's loss) becomes before its
            backward; None: the loss itself (a token-level loss weighs it: token_loss.py).
    """
    schedule_class = SCHEDULES[schedule]
    # The last stage already returns the loss; the schedule divides gradients by the number of
    # micro-batches (scale_grads), which makes them those of the mean loss over the batch.
    loss_fn = loss_fn or _loss_is_output
    if schedule_class is ScheduleInterleaved1F1B:
        return schedule_class(stages, n_microbatches=num_micro_batches, loss_fn=loss_fn)
    if len(stages) != 1:
        raise ValueError(f"schedule {schedule!r} runs one stage per rank, got {len(stages)}")
    return schedule_class(stages[0], n_microbatches=num_micro_batches, loss_fn=loss_fn)


def _loss_is_output(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output


def run_pipeline(schedule: Any, batch: Any, is_last_stage: bool, traced: bool = False,
                 evaluate: bool = False, per_micro_batch: bool = False) -> torch.Tensor | None:
    """One forward and backward of every micro-batch (forward only with ``evaluate``); the mean
    micro-batch loss on the last stage (each micro-batch's, 1-D, with ``per_micro_batch``).

    Module stages take the batch as keyword arguments on every stage; traced stages take it as
    positional arguments of the first stage only."""
    kwargs = batch_to_kwargs(batch)
    first = next(iter(kwargs.values()))
    losses: list[torch.Tensor] = []
    # The schedule wants a target to hand its loss function; the loss is already computed.
    target = torch.zeros(first.shape[0], device=first.device)
    run = schedule.eval if evaluate else schedule.step
    if traced:
        run(*kwargs.values(), target=target, losses=losses, return_outputs=False)
    else:
        run(target=target, losses=losses, return_outputs=False, **kwargs)
    if not is_last_stage:
        return None
    each = torch.stack([loss.detach().float() for loss in losses])
    return each if per_micro_batch else each.mean()


class TiedGradientSync:
    """Sums the gradients of a parameter tied across stages (a GPT token embedding on the first
    stage and the LM head on the last), so both copies take the same step as the single tensor
    would."""

    def __init__(self, tied_parameters: list[list[str]], stages: list[list[str]], mesh: DeviceMesh, pp: int):
        self.groups: list[tuple[list[str], dist.ProcessGroup | None]] = []
        ranks = mesh.mesh
        pp_dim = axis_names(mesh).index("pp")
        rows = ranks.movedim(pp_dim, -1).reshape(-1, pp)
        me = dist.get_rank()
        for names in tied_parameters:
            owners = sorted({index % pp for index, layers in enumerate(stages)
                             for name in names if _layer_of(name, layers) is not None})
            group = None
            if len(owners) > 1:
                # new_group is collective: every rank creates every group, keeps its own.
                for row in rows:
                    members = [int(row[o]) for o in owners]
                    created = dist.new_group(members)
                    if me in members:
                        group = created
            self.groups.append((names, group))

    @torch.no_grad()
    def __call__(self, stage_modules: list[nn.Module]) -> None:
        for names, group in self.groups:
            copies = list({id(p): p for module in stage_modules
                           for name, p in named_parameters_in_stage(module) if name in names}.values())
            if not copies or (len(copies) == 1 and group is None):
                continue
            for p in copies:
                if p.grad is None:  # a copy this stage never used (the traced split keeps some)
                    p.grad = torch.zeros_like(p)
                # Autograd may leave a sharded parameter's gradient in another layout (an
                # embedding's comes back replicated); all copies must agree before summing.
                if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                    p.grad = p.grad.redistribute(p.device_mesh, p.placements)
            grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in copies]
            total = torch.stack(grads).sum(0) if len(grads) > 1 else grads[0].clone()
            if group is not None:
                dist.all_reduce(total, group=group)
            for grad in grads:
                grad.copy_(total)


def _layer_of(parameter: str, layers: list[str]) -> str | None:
    return next((layer for layer in layers if parameter.startswith(layer + ".")), None)


def named_parameters_in_stage(stage: nn.Module):
    """A stage's parameters by their FQN in the unsharded model (ties listed under each name)."""
    for name, parameter in stage.named_parameters(remove_duplicate=False):
        yield (name[len("model."):] if name.startswith("model.") else name), parameter


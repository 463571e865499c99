"""Tensor and sequence parallelism: apply a plan of per-module parallel styles."""
from __future__ import annotations

import contextlib
import functools
from abc import abstractmethod
from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import ParallelStyle, loss_parallel, parallelize_module
from torch.utils._pytree import tree_leaves, tree_map_only

from autopar.sections.contract import bias_of, tensor_of


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, ParallelStyle],
             tied_parameters: list[list[str]]) -> None:
    """Shard the modules named in ``plan`` over the tensor-parallel axis.

    Colwise modules shard their weight's output features (attention heads, MLP columns),
    rowwise ones the input features; a column-parallel module followed by its row-parallel
    partner keeps the activation sharded in between, so the pair costs one all-reduce (or, with
    sequence parallelism, an all-gather before and a reduce-scatter after).

    Args:
        model: the model, or one pipeline stage of it (``plan`` must only name its modules).
        tp_mesh: the 1-D tensor-parallel submesh.
        plan: module FQN -> parallel style.
        tied_parameters: groups of parameter FQNs that share one tensor in the model (a GPT
            LM head tied to the token embedding); sharding replaces each module's parameter,
            so the ties are restored afterwards (the styles of tied modules agree by design).
    """
    parallelize_module(model, tp_mesh, plan)
    tie_parameters(model, tied_parameters)


class RegionStyle(ParallelStyle):
    """A style for a region (attention, an MLP) whose forward must run in a context: ``inner``,
    the region's own input style, is applied first, then its forward is wrapped in `context`,
    its arguments first passed through `arguments`."""

    def __init__(self, inner: ParallelStyle | None = None) -> None:
        super().__init__()
        self.inner = inner

    @abstractmethod
    def context(self, device_mesh: DeviceMesh) -> contextlib.AbstractContextManager:
        """The context the region's forward runs in, on ``device_mesh``."""

    def arguments(self, args: tuple, kwargs: dict[str, Any], device_mesh: DeviceMesh) -> tuple[tuple, dict[str, Any]]:
        """The region's arguments as its forward takes them (unchanged here)."""
        return args, kwargs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.inner is not None:
            module = self.inner._apply(module, device_mesh)
        forward = module.forward

        @functools.wraps(forward)
        def forward_in_context(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = self.arguments(args, kwargs, device_mesh)
            with self.context(device_mesh):
                return forward(*args, **kwargs)

        module.forward = forward_in_context
        return module


class GlobalShapes(RegionStyle):
    """A paired region whose code reads global sizes (``b, s, h = x.shape``, then
    ``view(b, s, self.n_head, h // self.n_head)``): its column-parallel outputs stay DTensors, so
    the code sees global shapes while every op computes on this rank's heads.

    The region's forward runs with plain tensors it meets (a causal mask, a rotary table: equal
    on every tensor-parallel rank, which read the same batch) taken as replicated, and on CPU
    with SDPA's math kernel (DTensor shards its matmuls by heads; the fused CPU kernel has no
    sharding rule). ``inner`` is the region's own input style.
    """

    def context(self, device_mesh: DeviceMesh) -> contextlib.AbstractContextManager:
        return global_shapes_context(device_mesh.device_type)

    def arguments(self, args: tuple, kwargs: dict[str, Any], device_mesh: DeviceMesh) -> tuple[tuple, dict[str, Any]]:
        """Floating-point tensors handed in (a rotary table, an additive mask) as replicated
        DTensors, not only inside the forward's implicit replication: backward runs outside it,
        and a product's gradient with a plain factor (``q * cos``) would mix a DTensor with a
        plain tensor there (Persimmon under tp=2)."""
        def replicated(t: torch.Tensor) -> torch.Tensor:
            if isinstance(t, DTensor) or not t.is_floating_point():
                return t
            return DTensor.from_local(t, device_mesh, [Replicate()], run_check=False)

        return tree_map_only(torch.Tensor, replicated, args), tree_map_only(torch.Tensor, replicated, kwargs)


class RankRandomNumbers(RegionStyle):
    """A paired region that draws random numbers on this rank's shards (dropout on its heads):
    each rank must draw its own, while draws on activations every rank holds whole (a residual
    branch's dropout) must stay equal on every rank. The region runs with its generators seeded
    from one draw of the global CPU generator, equal on every rank, and this rank's place on the
    tensor-parallel mesh; the global states come back after it. Activation recomputation restores
    the states the layer's forward began with, so a recomputed region draws the same numbers
    (Megatron-LM keeps a second generator for the same reason). ``inner`` is the region's own
    style, applied first."""

    def context(self, device_mesh: DeviceMesh) -> contextlib.AbstractContextManager:
        return rank_random_numbers(device_mesh.get_local_rank())


@contextlib.contextmanager
def rank_random_numbers(rank: int) -> Iterator[None]:
    """Within: the CPU generator and the current accelerator's seeded for ``rank`` (see
    RankRandomNumbers); after: both as they were, less the one draw that made the seed."""
    seed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item()) + rank
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        if devices:
            torch.cuda.manual_seed(seed)
        yield


class KVGroupColwise(ParallelStyle):
    """A key/value projection of grouped-query attention with fewer heads (``groups``) than
    tensor-parallel ranks: rank r computes head ``r // (tp / groups)``, the one its query heads
    read (Megatron-LM's layout, on local tensors).

    The weight is held split by rows over the TP group like a column-parallel weight (a
    ``Shard(0)`` DTensor: checkpoints and the optimizer see the model's tensor, each rank 1/tp of
    it). Each forward all-gathers it and keeps its group's rows; autograd's backward of that
    gather reduce-scatters the gradient, summing the shares the ranks of a group computed for
    their query heads. The input's gradient is partial, as a column-parallel linear's: a
    replicated DTensor input sums it with the region's other projections' in one all-reduce, and
    a plain input is all-reduced here.
    """

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.groups = groups

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp, outputs = device_mesh.size(), tensor_of(module, "weight").shape[0]
        if tp % self.groups or outputs % self.groups:
            raise ValueError(f"{type(module).__name__} with {outputs} outputs cannot be computed in "
                             f"{self.groups} key/value groups over {tp} ranks")
        group = device_mesh.get_local_rank() // (tp // self.groups)
        rows = slice(group * outputs // self.groups, (group + 1) * outputs // self.groups)
        hold_parameters(module, device_mesh, Shard(0))

        def forward(x: torch.Tensor) -> torch.Tensor:
            bias = bias_of(module)
            return F.linear(partial_input(x, device_mesh), group_rows(tensor_of(module, "weight"), device_mesh, rows),
                            None if bias is None else group_rows(bias, device_mesh, rows))

        module.forward = forward
        return module


def hold_parameters(module: nn.Module, device_mesh: DeviceMesh, placement: Placement) -> None:
    """``module``'s own parameters replaced by DTensors of ``placement`` over ``device_mesh``
    (same names: checkpoints and the optimizer see the model's tensors)."""
    for name, parameter in list(module.named_parameters(recurse=False)):
        module.register_parameter(name, nn.Parameter(distribute_tensor(parameter.data, device_mesh, [placement]),
                                                     requires_grad=parameter.requires_grad))


def group_rows(rows_shard: torch.Tensor, device_mesh: DeviceMesh, rows: slice | torch.Tensor) -> torch.Tensor:
    """``rows`` of a tensor held split by rows over ``device_mesh`` (a ``Shard(0)`` DTensor, or
    this rank's plain share of it), gathered: autograd's backward reduce-scatters their gradient,
    summing what each rank computed with them. A copy: the linear saves it for backward, and a
    view would keep the whole gathered tensor alive until then."""
    if not isinstance(rows_shard, DTensor):
        rows_shard = DTensor.from_local(rows_shard, device_mesh, [Shard(0)], run_check=False)
    whole = rows_shard.redistribute(device_mesh, [Replicate()])
    return whole.to_local(grad_placements=[Partial()])[rows].clone()


def partial_input(x: torch.Tensor, device_mesh: DeviceMesh) -> torch.Tensor:
    """A linear's input as a local tensor whose gradient is partial, as a column-parallel
    linear's: a replicated DTensor input sums it with its region's other projections' in one
    all-reduce, and a plain input is all-reduced here."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
    return x.to_local(grad_placements=[Partial()])


class HeadNorm(ParallelStyle):
    """A norm over each attention head's features (Qwen3's ``q_norm``) on this rank's heads.
    Its parameters become replicated DTensors and its input, the rank's heads, a DTensor sharded
    along a dim it does not normalise, so every op computes on the rank's heads unchanged and the
    weight's gradient comes out a partial sum, which `reduce_partial_gradients` (or FSDP's
    reduce-scatter) sums over the group. A plain input gives a plain output, as the region's
    other ops expect."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        hold_parameters(module, device_mesh, Replicate())
        forward = module.forward

        @functools.wraps(forward)
        def forward_on_heads(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if isinstance(x, DTensor):  # a region keeping DTensor activations: already its heads
                if any(p.is_shard(x.ndim - 1) or p.is_shard(-1) for p in x.placements):
                    raise ValueError(f"{type(module).__name__} normalises the dim its input is sharded along")
                return forward(x, *args, **kwargs)
            # The heads' dim of [batch, seq, heads, head_dim]; any dim but the last computes the
            # same (each row is normalised on its own), only the gradient's sum over them matters.
            heads = DTensor.from_local(x, device_mesh, [Shard(x.ndim - 2)], run_check=False)
            out = forward(heads, *args, **kwargs)
            return out.to_local() if isinstance(out, DTensor) else out

        module.forward = forward_on_heads
        return module


class WithAttributes(ParallelStyle):
    """A paired region with key/value projections computed by group whose attention repeats the
    key/value heads by a count it holds (Hugging Face's ``num_key_value_groups``): that count set
    to the query heads per rank, as the planner's probe found it runs, so this rank's key/value
    head is repeated to its own query heads. ``inner`` is the region's own input style, applied
    first."""

    def __init__(self, attributes: dict[str, int], inner: ParallelStyle | None = None) -> None:
        super().__init__()
        self.attributes = attributes
        self.inner = inner

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.inner is not None:
            module = self.inner._apply(module, device_mesh)
        for name, value in self.attributes.items():
            setattr(module, name, value)
        return module


@contextlib.contextmanager
def sharded_logits() -> Iterator[None]:
    """Loss parallelism: the LM head's logits stay vocabulary-sharded into the loss. Plain tensors
    the model's code combines with them on the way (BART adds its ``final_logits_bias`` buffer)
    are taken as replicated, which cuts each to the rank's part of the vocabulary."""
    with loss_parallel(), implicit_replication():
        yield


@contextlib.contextmanager
def global_shapes_context(device_type: str) -> Iterator[None]:
    """Plain tensors read as replicated DTensors and, on CPU, SDPA's math kernel (see GlobalShapes)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(implicit_replication())
        if device_type == "cpu":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        yield


def tie_parameters(model: nn.Module, tied_parameters: list[list[str]]) -> None:
    """Make every FQN of a tied group that ``model`` holds point at one parameter: the first
    sharded one if any was sharded, else the first. (The first name may belong to a module no
    style covers because the forward never calls it, T5's ``shared``; tying the sharded users to
    its plain tensor would give their styles a weight that is not a DTensor.)"""
    # Registered parameters only: a pipeline stage's skipped layer answers attribute reads from
    # a meta copy of the layer, whose parameters the stage does not hold.
    held = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    for group in tied_parameters:
        present = [name for name in group if name in held]
        if not present:
            continue
        source = next((name for name in present if isinstance(model.get_parameter(name), DTensor)), present[0])
        for name in present:
            if name != source:
                owner, _, attribute = name.rpartition(".")
                setattr(model.get_submodule(owner), attribute, model.get_parameter(source))


@torch.no_grad()
def reduce_partial_gradients(modules: list[nn.Module]) -> None:
    """Sum each partial gradient over its tensor-parallel group, once, before the optimizer step.

    Under sequence parallelism a norm runs on each rank's slice of the sequence, so its
    replicated parameters get partial gradients. Left partial, the optimizer's step reduced each
    three times (measured on GPT tp2+SP: 54 all-reduces for 18 norm parameters); reduced here,
    each costs one all-reduce, as the pricer counts them.
    """
    for module in modules:
        for parameter in module.parameters():
            grad = parameter.grad
            if isinstance(grad, DTensor) and isinstance(parameter, DTensor) \
                    and any(p.is_partial() for p in grad.placements):
                parameter.grad = grad.redistribute(grad.device_mesh, parameter.placements)


def replicated_beside_shards(output: Any, tp_mesh: DeviceMesh) -> Any:
    """The model's output for a loss computed on vocabulary-sharded logits (loss parallelism):
    its plain tensors (an MoE router's auxiliary loss, equal on every tensor-parallel rank) made
    replicated DTensors. Otherwise the loss mixes the two kinds, and the gradient autograd hands
    the plain term is a DTensor its backward cannot multiply (measured: a Mixtral-like model's
    ``cross_entropy(logits) + 0.01 * aux`` failed in backward). ``from_local`` is differentiable
    and communicates nothing; outputs without a DTensor are returned as they are."""
    if not any(isinstance(leaf, DTensor) for leaf in tree_leaves(output)):
        return output
    return tree_map_only(torch.Tensor, lambda t: t if isinstance(t, DTensor) else
                         DTensor.from_local(t, tp_mesh, [Replicate()], run_check=False), output)

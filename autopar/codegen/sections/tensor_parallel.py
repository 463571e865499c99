"""Tensor and sequence parallelism: apply a plan of per-module parallel styles."""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.placement_types import _StridedShard
from torch.overrides import TorchFunctionMode
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from torch.utils._pytree import tree_leaves, tree_map_only


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


class GlobalShapes(ParallelStyle):
    """A paired region whose code reads global sizes (``b, s, h = x.shape``, then
    ``view(b, s, self.n_head, h // self.n_head)``): its column-parallel outputs stay DTensors, so
    the code sees global shapes while every op computes on this rank's heads.

    The region's forward runs with plain tensors it meets (a causal mask, a rotary table: equal
    on every tensor-parallel rank, which read the same batch) taken as replicated, and on CPU
    with SDPA's math kernel (DTensor shards its matmuls by heads; the fused CPU kernel has no
    sharding rule). ``inner`` is the region's own input style, applied first.
    """

    def __init__(self, inner: ParallelStyle | None = None) -> None:
        super().__init__()
        self.inner = inner

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.inner is not None:
            module = self.inner._apply(module, device_mesh)
        forward = module.forward

        @functools.wraps(forward)
        def global_forward(*args: Any, **kwargs: Any) -> Any:
            with global_shapes_context(device_mesh.device_type):
                return forward(*args, **kwargs)

        module.forward = global_forward
        return module


@contextlib.contextmanager
def global_shapes_context(device_type: str) -> Iterator[None]:
    """Plain tensors read as replicated DTensors and, on CPU, SDPA's math kernel (see GlobalShapes)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(implicit_replication())
        stack.enter_context(FusedSplit())
        if device_type == "cpu":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        yield


class FusedColwiseParallel(ParallelStyle):
    """A fused projection (``qkv = Linear(h, 3h)`` cut into ``parts`` equal chunks: QKV, gate-up)
    split column-wise so that each rank holds its heads' rows of every part.

    Weight and bias become ``_StridedShard(0, split_factor=parts)`` DTensors: their global
    tensors (checkpoints, optimizer state) keep the model's layout, while a rank's local rows
    are its share of each part in turn. The output is a ``_StridedShard(-1)`` DTensor that
    `FusedSplit` cuts into ``Shard(-1)`` parts without communication (DTensor's own split would
    all-gather it). Runs inside a `GlobalShapes` region.
    """

    def __init__(self, parts: int) -> None:
        super().__init__()
        self.parts = parts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        placement = [_StridedShard(0, split_factor=self.parts)]
        for name, parameter in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(parameter.detach(), device_mesh, placement)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=parameter.requires_grad))
        parts = self.parts

        def forward(x: torch.Tensor) -> DTensor:
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
            # This rank's matmul gives a partial input gradient; the Replicate input sums it.
            local = x.to_local(grad_placements=[Partial()])
            bias = module.bias.to_local() if module.bias is not None else None
            out = torch.nn.functional.linear(local, module.weight.to_local(), bias)
            return DTensor.from_local(out, device_mesh, [_StridedShard(out.dim() - 1, split_factor=parts)],
                                      run_check=False)

        module.forward = forward
        return module


class FusedSplit(TorchFunctionMode):
    """``split``/``chunk`` of a `FusedColwiseParallel` output into its equal parts along the
    fused dim: each rank's local chunks, as ``Shard`` DTensors of the parts (no communication)."""

    _CUTS = (torch.Tensor.split, torch.split, torch.Tensor.chunk, torch.chunk)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in self._CUTS and args and isinstance(args[0], DTensor):
            x = args[0]
            placement = x.placements[0] if x.placements else None
            dim = kwargs.get("dim", args[2] if len(args) > 2 else 0) % max(x.dim(), 1)
            if isinstance(placement, _StridedShard) and x.device_mesh.ndim == 1 and placement.dim == dim:
                size = kwargs.get("split_size_or_sections", kwargs.get("chunks", args[1] if len(args) > 1 else None))
                chunk = func in (torch.Tensor.chunk, torch.chunk)
                pieces = size if chunk else _equal_pieces(size, x.shape[dim])
                if pieces == placement.split_factor:
                    return tuple(DTensor.from_local(piece, x.device_mesh, [Shard(dim)], run_check=False)
                                 for piece in x.to_local().chunk(pieces, dim))
        return func(*args, **kwargs)


def _equal_pieces(size: Any, whole: int) -> int | None:
    """How many equal pieces ``split(size)`` cuts ``whole`` into (a size or a list of sizes), or None."""
    if isinstance(size, int):
        return whole // size if size > 0 and whole % size == 0 else None
    sizes = list(size) if isinstance(size, (list, tuple)) else []
    return len(sizes) if sizes and len(set(sizes)) == 1 and sizes[0] * len(sizes) == whole else None


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
        source = next((name for name in present if isinstance(model.get_parameter(name), DTensor)),
                      present[0] if present else None)
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
            if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
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

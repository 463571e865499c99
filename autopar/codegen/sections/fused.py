"""Fused projections split as their parts: one linear computing q, k and v (or gate and up).

A column split of ``qkv = Linear(h, 3h)`` hands each rank a contiguous block of the fused
output, q's first two thirds on rank 0 of 2; the model then cuts it by global sizes
(``qkv.split(h, dim=-1)``) and reads k where q was. Here each rank instead holds its share of
every part: the weight's output rows are permuted once when parallelising
(`checkpointing.fused_row_order`),
so a plain ``Shard`` gives rank r ``[q_r; k_r; v_r]``, which FSDP shards further like any weight.
The region's code still cuts by global sizes; `FusedCuts`, active while the region runs, answers
a cut of the fused output at its parts' boundaries with this rank's share of each part. A cut
anywhere else raises: the legality probe runs the region the same way, so such a split is never
planned. Checkpoints, exports and pretrained weights keep the model's own row order: the rows
are put back on the way out and permuted on the way in (checkpointing.py, pretrained.py).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.overrides import TorchFunctionMode

# In a generated folder this is checkpointing.py beside the training module.
from autopar.codegen.sections import checkpoint as checkpointing
from autopar.codegen.sections.tensor_parallel import RegionStyle

FUSED_PARTS = "_fused_parts"  # attribute of a fused output: its parts' global sizes along the last dim


@torch.no_grad()
def permute_output_rows(module: nn.Module, parts: list[int], tp: int, weight_dim: int) -> None:
    """Put ``module``'s weight (output features along ``weight_dim``) and bias in the order each
    rank's contiguous shard is its share of every part."""
    order = torch.tensor(checkpointing.fused_row_order(parts, tp))
    for name, dim in (("weight", weight_dim), ("bias", 0)):
        parameter = getattr(module, name, None)
        if parameter is not None:
            parameter.data = parameter.data.index_select(dim, order.to(parameter.device))


class FusedColwise(ParallelStyle):
    """``style`` (a column-parallel style) on a fused projection of ``parts`` (global sizes of its
    output's parts, in order): rows permuted first, the output tagged for `FusedCuts`."""

    def __init__(self, *, parts: list[int], style: ParallelStyle, weight_dim: int = 0) -> None:
        super().__init__()
        self.parts, self.style, self.weight_dim = list(parts), style, weight_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        permute_output_rows(module, self.parts, device_mesh.size(), self.weight_dim)
        module = self.style._apply(module, device_mesh)
        module.register_forward_hook(lambda _module, _inputs, output: tag_fused_output(output, self.parts))
        return module


def tag_fused_output(output: Any, parts: list[int]) -> Any:
    """``output`` (a fused projection's) marked with its parts, for `FusedCuts`."""
    if isinstance(output, torch.Tensor):
        setattr(output, FUSED_PARTS, parts)
    return output


class CutsFused(RegionStyle):
    """The region holding fused projections: its forward runs under `FusedCuts` (``inner``, the
    region's own style, applied first)."""

    def context(self, device_mesh: DeviceMesh) -> FusedCuts:
        return FusedCuts()


class FusedCutError(RuntimeError):
    """The model's code cut a fused output somewhere other than its parts' boundaries."""


class FusedCuts(TorchFunctionMode):
    """Cuts of a tagged fused output along its last dim (``split``, ``chunk``, ``split_with_sizes``,
    ``narrow``, ``[..., a:b]``), given in global sizes, answered with this rank's share of the
    parts they name (a DTensor output's shares stay DTensors of the part's global size)."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tensor = args[0] if args else None
        parts = getattr(tensor, FUSED_PARTS, None) if isinstance(tensor, torch.Tensor) else None
        if parts is None:
            return func(*args, **kwargs)
        cut = requested_cut(func, tensor, args[1:], kwargs, sum(parts))
        if cut is None:
            return func(*args, **kwargs)
        pieces = [_share(tensor, parts, start, stop) for start, stop in cut.bounds]
        return tuple(pieces) if cut.many else pieces[0]


class _Cut:
    """Global (start, stop) bounds along the last dim a call asks for; ``many``: it returns a tuple."""

    def __init__(self, bounds: list[tuple[int, int]], many: bool) -> None:
        self.bounds, self.many = bounds, many


def _last_dim(dim: int, tensor: torch.Tensor) -> bool:
    return dim in (-1, tensor.dim() - 1)


def requested_cut(func: Callable, tensor: torch.Tensor, rest: tuple, kwargs: dict, total: int) -> _Cut | None:
    """What part of the fused output the call asks for, or None for a call that cuts nothing along
    the last dim (it runs as written)."""
    name = getattr(func, "__name__", "")
    if name in ("split", "split_with_sizes", "chunk"):
        dim = kwargs.get("dim", rest[1] if len(rest) > 1 else 0)
        if not _last_dim(dim, tensor):
            return None
        request = kwargs.get("split_size_or_sections", kwargs.get("split_size", kwargs.get(
            "split_sizes", kwargs.get("chunks", rest[0] if rest else None))))
        if name == "chunk":
            request = -(-total // int(request))
        sizes = [int(request)] * -(-total // int(request)) if isinstance(request, int) else [int(s) for s in request]
        sizes[-1] = total - sum(sizes[:-1])
        starts = [sum(sizes[:index]) for index in range(len(sizes))]
        return _Cut([(start, start + size) for start, size in zip(starts, sizes)], many=True)
    if name == "narrow":
        dim, start, length = (list(rest) + [kwargs.get("dim"), kwargs.get("start"), kwargs.get("length")])[:3]
        return _Cut([(int(start), int(start) + int(length))], many=False) if _last_dim(dim, tensor) else None
    if name == "__getitem__":
        key = rest[0] if isinstance(rest[0], tuple) else (rest[0],)
        if Ellipsis not in key and len(key) < tensor.dim():
            return None  # the last dim is not indexed
        if not isinstance(key[-1], slice) or key[-1] == slice(None):
            raise FusedCutError(f"a fused projection's output indexed as [{key}]: only [..., a:b] reads a part")
        leading = key[:-1]
        if not (leading == (Ellipsis,) or (all(k == slice(None) for k in leading) and len(leading) == tensor.dim() - 1)):
            raise FusedCutError(f"a fused projection's output indexed as [{key}]: only [..., a:b] reads a part")
        start, stop, step = key[-1].indices(total)
        if step != 1:
            raise FusedCutError("a fused projection's output read with a step")
        return _Cut([(start, stop)], many=False)
    return None


def _share(tensor: torch.Tensor, parts: list[int], start: int, stop: int) -> torch.Tensor:
    """This rank's share of the part spanning global [start, stop) of the fused output."""
    bounds = [(sum(parts[:index]), sum(parts[:index + 1])) for index in range(len(parts))]
    if (start, stop) not in bounds:
        raise FusedCutError(f"a fused projection of parts {parts} cut at [{start}, {stop}), which is not one "
                            "of its parts")
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    tp = sum(parts) // local.shape[-1]  # each part's share is 1/tp of it, in the parts' order
    piece = local.narrow(-1, start // tp, (stop - start) // tp)
    if isinstance(tensor, DTensor):
        return DTensor.from_local(piece, tensor.device_mesh, tensor.placements, run_check=False)
    return piece

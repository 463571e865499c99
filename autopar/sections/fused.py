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

import itertools
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle
from torch.overrides import TorchFunctionMode

# In a generated folder this is checkpointing.py beside the training module.
from autopar.sections import checkpoint as checkpointing
from autopar.sections.contract import bias_of, tensor_of
from autopar.sections.tensor_parallel import RegionStyle, group_rows, hold_parameters, partial_input

FUSED_PARTS = "_fused_parts"  # attribute of a fused output: its parts' global sizes along the last dim
FUSED_LOCAL_PARTS = "_fused_local_parts"  # and their sizes on this rank, where not 1/tp of each


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


def tag_fused_output(output: Any, parts: list[int], local_parts: list[int] | None = None) -> Any:
    """``output`` (a fused projection's) marked with its parts, for `FusedCuts`, and with their
    sizes on this rank where they are not 1/tp of each (key/value parts computed by group)."""
    if isinstance(output, torch.Tensor):
        setattr(output, FUSED_PARTS, parts)
        setattr(output, FUSED_LOCAL_PARTS, local_parts)
    return output


class FusedKVGroupColwise(ParallelStyle):
    """A fused projection (Phi-3's ``qkv_proj``) whose key/value parts (``grouped``) have fewer
    heads (``groups``) than tensor-parallel ranks: rank r computes its 1/tp share of each other
    part (the query heads) and, of each grouped part, the head of its group ``r // (tp /
    groups)``, as `KVGroupColwise` does for a key/value projection of its own.

    Held as `FusedColwise` holds a fused weight: rows permuted so that rank r's ``Shard(0)``
    share is 1/tp of every part. Each forward gathers the grouped parts' shares over the group
    in one collective and keeps its group's rows (the backward reduce-scatters their gradient);
    the other parts' rows are this rank's own. The output is tagged with the parts' global and
    local sizes, so the region's cuts by global sizes read this rank's share of each
    (`FusedCuts`)."""

    def __init__(self, *, parts: list[int], groups: int, grouped: list[bool]) -> None:
        super().__init__()
        self.parts, self.groups, self.grouped = list(parts), groups, list(grouped)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        if tp % self.groups or any(size % (self.groups if grouped else tp)
                                   for size, grouped in zip(self.parts, self.grouped)):
            raise ValueError(f"a fused projection of parts {self.parts} cannot be computed in {self.groups} key/value "
                             f"groups over {tp} ranks")
        permute_output_rows(module, self.parts, tp, 0)
        hold_parameters(module, device_mesh, Shard(0))
        group = device_mesh.get_local_rank() // (tp // self.groups)
        local_parts = [size // self.groups if grouped else size // tp
                       for size, grouped in zip(self.parts, self.grouped)]
        starts = [sum(size // tp for size in self.parts[:index]) for index in range(len(self.parts))]
        # The grouped parts' shares are gathered in one collective: rank j's block of the gathered
        # rows holds its share of each grouped part in turn; a part's group rows are the shares
        # of the group's ranks, in rank order.
        shares = {index: size // tp for index, (size, grouped) in enumerate(zip(self.parts, self.grouped)) if grouped}
        block, offsets = sum(shares.values()), dict(zip(shares, itertools.accumulate(shares.values(), initial=0)))
        ranks = range(group * (tp // self.groups), (group + 1) * (tp // self.groups))
        wanted = torch.tensor([rank * block + offsets[index] + row for index, share in shares.items()
                               for rank in ranks for row in range(share)])

        def rows_of(parameter: torch.Tensor) -> torch.Tensor:
            share = parameter.to_local() if isinstance(parameter, DTensor) else parameter  # held sharded
            own = [share.narrow(0, start, size // tp) for start, size in zip(starts, self.parts)]
            kept = group_rows(torch.cat([own[index] for index in shares]), device_mesh, wanted.to(share.device))
            grouped = dict(zip(shares, kept.split([local_parts[index] for index in shares])))
            return torch.cat([grouped.get(index, piece) for index, piece in enumerate(own)])

        def forward(x: torch.Tensor) -> torch.Tensor:
            bias = bias_of(module)
            output = F.linear(partial_input(x, device_mesh), rows_of(tensor_of(module, "weight")),
                              None if bias is None else rows_of(bias))
            return tag_fused_output(output, self.parts, local_parts)

        module.forward = forward
        return module


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
        if parts is None or not isinstance(tensor, torch.Tensor):
            return func(*args, **kwargs)
        cut = requested_cut(func, tensor, args[1:], kwargs, sum(parts))
        if cut is None:
            return func(*args, **kwargs)
        local_parts = getattr(tensor, FUSED_LOCAL_PARTS, None)
        pieces = [_share(tensor, parts, start, stop, local_parts) for start, stop in cut.bounds]
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
        if request is None:
            return None  # no size given: not a cut this knows
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
        if not (leading == (Ellipsis,)
                or (all(k == slice(None) for k in leading) and len(leading) == tensor.dim() - 1)):
            raise FusedCutError(f"a fused projection's output indexed as [{key}]: only [..., a:b] reads a part")
        start, stop, step = key[-1].indices(total)
        if step != 1:
            raise FusedCutError("a fused projection's output read with a step")
        return _Cut([(start, stop)], many=False)
    return None


def _share(tensor: torch.Tensor, parts: list[int], start: int, stop: int,
           local_parts: list[int] | None = None) -> torch.Tensor:
    """This rank's share of the part spanning global [start, stop) of the fused output (1/tp of
    each part, or the part's size in ``local_parts``)."""
    bounds = [(sum(parts[:index]), sum(parts[:index + 1])) for index in range(len(parts))]
    if (start, stop) not in bounds:
        raise FusedCutError(f"a fused projection of parts {parts} cut at [{start}, {stop}), which is not one "
                            "of its parts")
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if local_parts is None:
        tp = sum(parts) // local.shape[-1]  # each part's share is 1/tp of it, in the parts' order
        local_parts = [size // tp for size in parts]
    index = bounds.index((start, stop))
    piece = local.narrow(-1, sum(local_parts[:index]), local_parts[index])
    if isinstance(tensor, DTensor):
        return DTensor.from_local(piece, tensor.device_mesh, tensor.placements, run_check=False)
    return piece

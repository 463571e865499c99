"""Tensor-parallel styles beyond torch's: transposed linear layers (GPT-2's Conv1D), owned outputs."""
from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel


def shard_transposed(weight_placement: Placement, bias_placement: Placement, src_data_rank: int | None,
                     name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
    """Replace ``module``'s weight and bias by DTensors with the given placements (the names stay,
    so checkpoints keep the model's own names and its ``(in, out)`` layout when gathered)."""
    for attribute, placement in (("weight", weight_placement), ("bias", bias_placement)):
        parameter = getattr(module, attribute, None)
        if parameter is None:
            continue
        module.register_parameter(attribute, nn.Parameter(
            distribute_tensor(parameter, device_mesh, [placement], src_data_rank=src_data_rank),
            requires_grad=parameter.requires_grad))


class TransposedColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a linear layer whose weight is ``(in, out)`` and whose forward computes
    ``x @ W + b``: the output features are the weight's dim 1 (and the bias's dim 0). Inputs and
    outputs are laid out by ColwiseParallel's own hooks; the module's forward runs on DTensors of
    global shape, so code in it that reads its global sizes (Conv1D's ``self.nf``) stays right."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh,
                                 partial(shard_transposed, Shard(1), Shard(0), self.src_data_rank),
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class TransposedRowwiseParallel(RowwiseParallel):
    """RowwiseParallel for a linear layer whose weight is ``(in, out)``: the input features are
    the weight's dim 0; the bias stays whole, added once after the partial sums are reduced."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(module, device_mesh,
                                 partial(shard_transposed, Shard(0), Replicate(), self.src_data_rank),
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class OwnedOutput(ParallelStyle):
    """``style``, with the module's output copied: a split module returns ``DTensor.to_local()``,
    a view autograd forbids modifying in place, and the model's code modifies this one (Falcon's
    ``mlp_output += attention_output``). One copy of the output, where the code needs it only."""

    def __init__(self, *, style: ParallelStyle):
        super().__init__()
        self.style = style

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = self.style._apply(module, device_mesh)
        module.register_forward_hook(
            lambda _module, _inputs, output: output.clone()
            if isinstance(output, torch.Tensor) and not isinstance(output, DTensor) else output)
        return module

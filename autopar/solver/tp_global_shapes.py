"""Paired regions whose code views by global sizes, run the way the generated code runs them.

Attention written for the whole model reads the hidden size from its input and holds the head
count (``b, s, h = x.shape``, then ``view(b, s, self.n_head, h // self.n_head)``; OPT's
``view(bsz, -1, self.num_heads, d)``). On one rank's local share of the columns that view fails
or folds the sequence (the *local shapes* rule of autopar.solver.tp_legality).

Design: such a region keeps its column-parallel outputs as DTensors (``ColwiseParallel(
use_local_output=False)``, the row-parallel partner reading ``Shard(-1)``), so its own code
sees global shapes while each op computes on local shards: a view of a ``Shard(-1)`` feature
dim into ``(heads, d)`` shards the heads, transposes and SDPA keep them sharded, and the view
back to ``(b, s, h)`` hands the partner its share, for the same one all-reduce as a local
region. Adjusting head-count attributes (torchtitan's way) cannot serve code that reads ``h``
from its input. Regions the local probe passes keep local tensors: no DTensor dispatch cost.

The probe runs the layer on fake tensors under a fake process group of ``tp`` ranks, each of
the region's linears computing on one rank's share and handing on what its style hands on. A
region is legal when it runs, no DTensor leaves the layer, and it communicates exactly one
all-reduce per row-parallel linear: an op DTensor cannot keep sharded (a view by a count the
split does not divide) would all-gather, correct but unpriced, and is refused.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten

from autopar.sections.contract import bias_of, tensor_of


def dtensor_region_error(build: Any, named: dict[str, nn.Module], region: str, linears: dict[str, str], tp: int,
                         module: nn.Module, inputs: tuple[tuple, dict], call_model: Callable | None) -> str | None:
    """Why ``module`` (a layer with its captured inputs, or the model on its batch through
    ``call_model``) cannot run with the paired ``region``'s ``linears`` (FQN -> colwise/rowwise)
    keeping DTensor activations, or None when it can (see the module docstring)."""
    from torch.distributed.tensor.debug import CommDebugMode

    for name, style in linears.items():
        out_features, in_features = tensor_of(named[name], "weight").shape
        if (out_features if style == "colwise" else in_features) % tp:
            return f"{name}'s {'out' if style == 'colwise' else 'in'} features do not divide by {tp}"
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # a failure here is the finding, not an error to log
    try:
        with _fake_ranks(tp) as mesh:
            if mesh is None:
                return "a process group is already initialised in this process, so the DTensor probe cannot run"
            with build.active(), _sharded_linears(named, linears, mesh), _as_generated(named[region]), \
                    torch.no_grad(), CommDebugMode() as comms:
                output = call_model(module, build.batch) if call_model is not None else module(*inputs[0], **inputs[1])
    except Exception as err:  # noqa: BLE001 - any failure of the model's code on DTensors is the finding
        return f"{type(err).__name__}: {' '.join(str(err).split())[:160]}"
    finally:
        quiet.setLevel(level)
    return _leak(output) or _extra_collectives(comms.get_comm_counts(), sum(s == "rowwise" for s in linears.values()))


def _leak(output: Any) -> str | None:
    from torch.distributed.tensor import DTensor

    if any(isinstance(leaf, DTensor) for leaf in tree_flatten(output)[0]):
        return "a DTensor leaves the layer (the region returns a sharded activation besides its output)"
    return None


def _extra_collectives(counts: dict, row_parallel: int) -> str | None:
    """Anything but one all-reduce per row-parallel linear: a redistribution the pricer does not count."""
    named = {str(getattr(op, "__name__", op)).rpartition(".")[2]: n for op, n in counts.items() if n}
    expected = {"all_reduce": row_parallel} if row_parallel else {}
    if named != expected:
        found = ", ".join(f"{n} {op}" for op, n in sorted(named.items())) or "none"
        return (f"DTensor redistributes inside the region ({found} where one all-reduce per row-parallel linear "
                "is expected): an op it cannot keep sharded")
    return None


@contextlib.contextmanager
def _fake_ranks(tp: int) -> Iterator[Any]:
    """A 1-D mesh of ``tp`` ranks on torch's ``fake`` backend (collectives do nothing), or None
    when this process already has a process group."""
    if dist.is_initialized():
        yield None
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (tp,))
    finally:
        dist.destroy_process_group()


def _as_generated(region: nn.Module) -> contextlib.AbstractContextManager:
    """``region``'s forward run in the context the generated code's ``GlobalShapes`` style gives it."""
    from autopar.sections.tensor_parallel import global_shapes_context
    from autopar.solver.tp_fused import forward_within

    return forward_within(region, lambda: global_shapes_context("cpu"))


@contextlib.contextmanager
def _sharded_linears(named: dict[str, nn.Module], linears: dict[str, str], mesh: Any) -> Iterator[None]:
    """Each linear computing on rank 0's share and handing on what its style does: a column-
    parallel one a ``Shard(-1)`` DTensor, a row-parallel one the all-reduced local sum."""
    patched = []
    try:
        for name, style in linears.items():
            linear = named[name]
            whole, whole_bias = tensor_of(linear, "weight"), bias_of(linear)
            out_features, in_features = whole.shape
            tp = mesh.size()
            shape = (out_features // tp, in_features) if style == "colwise" else (out_features, in_features // tp)
            weight = torch.empty(shape, dtype=whole.dtype)
            bias = None if whole_bias is None else torch.empty(
                shape[0] if style == "colwise" else out_features, dtype=whole_bias.dtype)
            linear.forward = (_column if style == "colwise" else _row)(weight, bias, mesh)
            patched.append(linear)
        yield
    finally:
        for linear in patched:
            del linear.forward


def _column(weight: torch.Tensor, bias: torch.Tensor | None, mesh: Any) -> Callable[[torch.Tensor], Any]:
    from torch.distributed.tensor import DTensor, Shard

    def forward(x: torch.Tensor) -> Any:
        local = x.to_local() if isinstance(x, DTensor) else x
        out = F.linear(local, weight, bias)
        return DTensor.from_local(out, mesh, [Shard(out.dim() - 1)], run_check=False)

    return forward


def _row(weight: torch.Tensor, bias: torch.Tensor | None, mesh: Any) -> Callable[[Any], torch.Tensor]:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    def forward(x: Any) -> torch.Tensor:
        shard = [Shard(x.dim() - 1)]
        x = (x.redistribute(mesh, shard) if isinstance(x, DTensor)
             else DTensor.from_local(x, mesh, shard, run_check=False))
        partial = DTensor.from_local(F.linear(x.to_local(), weight), mesh, [Partial()], run_check=False)
        out = partial.redistribute(mesh, [Replicate()]).to_local()
        return out if bias is None else out + bias

    return forward

"""The probes of autopar.solver.tp_legality that run the model's code: a layer run on fake tensors
with its linears narrowed to one rank's share, the shapes its ops produce, and the head-count
attributes that make a key/value group's region run. Imported only when a question has no kept
answer (autopar.profile_cache), so that planning from a kept profile never loads torch."""
from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autopar.sections.contract import bias_of, tensor_of
from autopar.trace.linear_like import linear_stand_ins
from autopar.solver.tp_fused import cutting_fused

if TYPE_CHECKING:
    from autopar.solver.tp_kv_groups import KVGroups


def narrowed_error(build: Any, named: dict[str, nn.Module], linears: dict[str, str], tp: int,
                    run: tuple[nn.Module, tuple[tuple, dict], Any],
                    rows: dict[str, int], whole: list, seq_len: int | None, fused: dict[str, list[int]],
                    shares: dict[str, list[int]]) -> str | None:
    """Why the layer fails with ``linears`` narrowed and its ``fused`` projections cut as their
    parts (``shares``: their local sizes where not 1/tp), as `TPLegality._probe_regions` runs
    it, or None."""
    with linear_stand_ins(build.model, named, linears) as probed, cutting_fused(probed, fused, shares):
        error, local = run_narrowed(build, probed, linears, tp, *run, group_rows=rows)
    return error or folded_sequence(whole, local, seq_len)


def group_count_attribute(region: nn.Module, groups: KVGroups, tp: int,
                           error: Callable[[], str | None]) -> dict[str, int] | None:
    """The integer attributes of ``region`` holding a head count, set to one rank's count, that
    let the region run on one rank's share (``error()`` None), as {name: value}; None when no set
    does. Each attribute is found by its value: the query heads (set to ``heads / tp``), the
    key/value heads (set to 1: a rank computes one) or the query heads per key/value head (set to
    the query heads per rank, so a repeat by it gives the rank's query heads their keys).
    Hugging Face's Llama needs only the last; StableLM, viewing queries by ``num_heads`` and keys
    by ``num_key_value_heads``, needs all three. Fewest changes are tried first."""
    per_rank = groups.heads // tp
    local = {groups.heads: {per_rank}, groups.kv_heads: {1}, groups.heads // groups.kv_heads: {per_rank}}
    if groups.heads == groups.kv_heads * groups.kv_heads:  # a count that is both kv heads and a group
        local[groups.kv_heads] = {1, per_rank}
    options = [(name, sorted(local[value] - {value})) for name, value in sorted(vars(region).items())
               if type(value) is int and value in local and local[value] - {value}]
    tries = 0
    for size in range(1, min(len(options), _MOST_HEAD_ATTRIBUTES) + 1):
        for chosen in itertools.combinations(options, size):
            for values in itertools.product(*(choices for _, choices in chosen)):
                tries += 1
                if tries > _MOST_HEAD_ATTRIBUTE_TRIES:
                    return None
                setting = {name: value for (name, _), value in zip(chosen, values)}
                kept = {name: getattr(region, name) for name in setting}
                for name, value in setting.items():
                    setattr(region, name, value)
                try:
                    if error() is None:
                        return setting
                finally:
                    for name, value in kept.items():
                        setattr(region, name, value)
    return None


_MOST_HEAD_ATTRIBUTES = 3  # query heads, key/value heads, and their ratio
_MOST_HEAD_ATTRIBUTE_TRIES = 64  # each a fake forward of one layer


class _Shapes(TorchDispatchMode):
    """Records, in order, the output shapes of every op that reads an activation (a tensor
    computed from ``inputs``): weights' transposes and constants are left out, since their
    sizes may equal the sequence length by coincidence (hidden 2048, sequence 2048)."""

    def __init__(self, inputs: Any) -> None:
        super().__init__()
        self.seen: list[tuple[str, tuple[int, ...]]] = []
        self._kept = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)]  # ids stay unique
        self._activations = {id(t) for t in self._kept}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(id(t) in self._activations for t in tree_flatten((args, kwargs))[0]):
            for tensor in tree_flatten(out)[0]:
                if isinstance(tensor, torch.Tensor):
                    self.seen.append((str(func), tuple(tensor.shape)))
                    self._kept.append(tensor)
                    self._activations.add(id(tensor))
        return out


def folded_sequence(full: list[tuple[str, tuple[int, ...]]], local: list[tuple[str, tuple[int, ...]]],
                     seq_len: int | None) -> str | None:
    """The first op whose output lost part of the sequence on one rank's share (a view with -1
    for the sequence and a hard-coded head count: OPT's ``view(bsz, -1, self.num_heads, d)``),
    or None. A correct split shrinks heads or features only, never the sequence."""
    if len(full) != len(local) or not seq_len:
        # A share may run a different number of ops and be right: Llama with as many KV heads
        # as ranks (8 of 8) repeats one local KV head, and torch elides views of size-1 dims.
        # Only a cut sequence, read op by op, is evidence; the proof at compile checks values.
        return None
    for (target, whole), (_, share) in zip(full, local):
        # The last dim is features (a column split shrinks it; its size may equal the sequence
        # length by coincidence), so only the others are read as positions.
        if len(whole) == len(share) and any(w == seq_len and s != w for w, s in zip(whole[:-1], share[:-1])):
            return f"{target} gives {list(share)} where the whole model has {list(whole)}, a cut sequence"
    return None


def run_fake(build: Any, module: nn.Module, inputs: tuple[tuple, dict], call_model: Any | None) -> Any:
    """One forward of ``module`` (a layer on its captured inputs, or the model on its batch through
    ``call_model``) on fake tensors."""
    with build.active(), torch.no_grad():
        return call_model(module, build.batch) if call_model is not None else module(*inputs[0], **inputs[1])


def run_narrowed(build: Any, named: dict[str, nn.Module], linears: dict[str, str], tp: int, module: nn.Module,
                  inputs: tuple[tuple, dict], call_model: Any | None,
                  group_rows: dict[str, int] | None = None) -> tuple[str | None, list]:
    """Run ``module`` (a layer with its captured inputs, or the model on its batch through
    ``call_model``) on fake tensors with ``linears`` narrowed to one rank's share (colwise:
    out_features / tp, rowwise: in_features / tp, kv_group: its ``group_rows``); the error it
    raised (or None) and the shapes its ops produced."""
    saved: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    shapes = _Shapes(build.batch if call_model is not None else inputs)
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # a failure here is the finding, not an error to log
    try:
        with build.active():
            for name, style in linears.items():
                linear = named[name]
                weight, bias = tensor_of(linear, "weight"), bias_of(linear)
                out_features, in_features = weight.shape
                if style == "kv_group":
                    shape = ((group_rows or {})[name], in_features)
                elif (out_features if style == "colwise" else in_features) % tp:
                    return f"{name}'s {'out' if style == 'colwise' else 'in'} features do not divide by {tp}", []
                else:
                    shape = ((out_features // tp, in_features) if style == "colwise"
                             else (out_features, in_features // tp))
                saved[name] = (weight, bias)
                linear.weight = nn.Parameter(torch.empty(shape, dtype=weight.dtype),
                                             requires_grad=weight.requires_grad)
                if bias is not None and style in ("colwise", "kv_group"):
                    linear.bias = nn.Parameter(torch.empty(shape[0], dtype=bias.dtype),
                                               requires_grad=bias.requires_grad)
            with torch.no_grad(), shapes:
                if call_model is not None:
                    call_model(module, build.batch)
                else:
                    module(*inputs[0], **inputs[1])
    except Exception as err:  # noqa: BLE001 - any failure of the model's code on a share is the finding
        return f"{type(err).__name__}: {' '.join(str(err).split())[:160]}", shapes.seen
    finally:
        quiet.setLevel(level)
        for name, (kept_weight, kept_bias) in saved.items():
            setattr(named[name], "weight", kept_weight)  # the module's own Parameters, put back
            setattr(named[name], "bias", kept_bias)
    return None, shapes.seen

"""Fused projections: where the model's code cuts one linear's output into parts.

nanoGPT's ``c_attn(x).split(n_embd, dim=2)``, Phi-3's ``qkv[..., :q_pos]`` slices and its
``gate_up.chunk(2, dim=-1)`` cut a projection's output along the features a column split
shards. Such a projection splits as its parts (autopar.sections.fused): each rank holds
its share of every part, and the region's cuts, still written in global sizes, are answered
with those shares. The parts are read by running the layer once on fake tensors and recording
every torch call on the projection's output: each must be a cut along the last dim, and the
union of their bounds gives the parts. A view into slots of head features followed by cuts
along the slots (Falcon's multi-query ``view(b, s, heads + 2, head_dim)[..., :-2, :]``) gives
the parts the same way, by whole slots. Any other use leaves the projection to the graph rule,
which keeps it whole.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


# Calls that read a tensor's metadata only: no use of its values.
_METADATA = frozenset({"__get__", "size", "dim", "numel", "__len__", "is_contiguous", "element_size",
                       "stride", "storage_offset", "is_floating_point"})


_HEAD_SLOTS = "_fused_head_slots"  # attribute of a fused output viewed as (..., slots, features per slot)


def _section() -> Any:
    """autopar.sections.fused, the generated code's fused-projection runtime whose tags and cuts the
    probes here reuse. Imported when a layer is probed: it imports DTensor (with sympy, most of a
    second), which planning from a kept profile never needs."""
    from autopar.sections import fused

    return fused


class _CutRecorder(TorchFunctionMode):
    """Records the global bounds of every cut of a tagged output; any other use spoils it. A
    view of the output into slots of features (Falcon's ``view(b, s, heads + 2, head_dim)``) is
    followed: its cuts along the slots (``[..., :-2, :]``, ``[..., [-2], :]``) are cuts of the
    output by whole slots."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = _section()
        self.bounds: set[tuple[int, int]] = set()
        self.other_use: str | None = None

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tensor = args[0] if args else None
        if not isinstance(tensor, torch.Tensor):
            return func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        if getattr(tensor, _HEAD_SLOTS, None) is not None:
            slots = _slot_cut(name, tensor, args[1:])
            if slots is not None:
                width = tensor.shape[-1]
                self.bounds.update((start * width, stop * width) for start, stop in slots)
            elif name not in _METADATA and self.other_use is None:
                self.other_use = name
            return func(*args, **kwargs)
        if getattr(tensor, self.fused.FUSED_PARTS, None) is None:
            return func(*args, **kwargs)
        try:
            cut = self.fused.requested_cut(func, tensor, args[1:], kwargs, tensor.shape[-1])
        except self.fused.FusedCutError as err:
            cut, self.other_use = None, str(err)
        result = func(*args, **kwargs)
        if cut is not None:
            self.bounds.update(cut.bounds)
        elif name in ("view", "reshape") and _slots_of(tensor, result):
            setattr(result, _HEAD_SLOTS, True)
        elif name not in _METADATA and self.other_use is None:
            self.other_use = name
        return result


def _slots_of(tensor: torch.Tensor, viewed: Any) -> bool:
    """Whether ``viewed`` is ``tensor`` with its last dim split into (slots, features per slot)."""
    return isinstance(viewed, torch.Tensor) and viewed.dim() == tensor.dim() + 1 \
        and tuple(viewed.shape[:-2]) == tuple(tensor.shape[:-1]) \
        and viewed.shape[-2] * viewed.shape[-1] == tensor.shape[-1]


def _slot_cut(name: str, tensor: torch.Tensor, rest: tuple) -> list[tuple[int, int]] | None:
    """The slot range ``tensor[..., cut, :]`` reads (a slice of step 1, or a list of one index),
    or None for any other call."""
    if name != "__getitem__" or not rest:
        return None
    key = rest[0] if isinstance(rest[0], tuple) else (rest[0],)
    whole = [isinstance(k, slice) and k == slice(None) for k in key]
    leading = key[:-2]
    if len(key) < 2 or not whole[-1] or not ((len(leading) == 1 and leading[0] is Ellipsis)
                                              or (len(leading) == tensor.dim() - 2 and all(whole[:-2]))):
        return None
    slots, selected = tensor.shape[-2], key[-2]
    if isinstance(selected, slice):
        start, stop, step = selected.indices(slots)
        return [(start, stop)] if step == 1 and stop > start else None
    if isinstance(selected, list) and len(selected) == 1 and isinstance(selected[0], int):
        index = selected[0] % slots
        return [(index, index + 1)]
    return None


def recorded_parts(module: nn.Module, run: Callable[[], Any]) -> list[int] | None:
    """The parts ``run`` (a forward of the layer holding ``module``) cuts ``module``'s output
    into, in order; None when it uses the output otherwise, or cuts nothing."""
    recorder = _CutRecorder()
    tag = _section().tag_fused_output
    handle = module.register_forward_hook(lambda _m, _i, out: tag(out, [out.shape[-1]]))
    try:
        with recorder:
            run()
    except Exception:  # noqa: BLE001 - a layer that cannot run here is judged by the other rules
        return None
    finally:
        handle.remove()
    if recorder.other_use is not None or not recorder.bounds:
        return None
    edges = sorted({edge for bound in recorder.bounds for edge in bound})
    if edges[0] != 0:
        edges = [0, *edges]
    parts = [stop - start for start, stop in zip(edges, edges[1:])]
    return parts if len(parts) > 1 else None


@contextlib.contextmanager
def forward_within(module: nn.Module, context: Callable[[], Any]) -> Iterator[None]:
    """``module``'s forward run inside ``context()`` until exit, then as it was (wrappers nest)."""
    own = module.__dict__.get("forward")
    forward = module.forward

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with context():
            return forward(*args, **kwargs)

    module.forward = wrapped
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


@contextlib.contextmanager
def cutting_fused(named: dict[str, nn.Module], fused: dict[str, list[int]],
                  local: dict[str, list[int]] | None = None) -> Iterator[None]:
    """The fused projections ``fused`` (FQN -> parts) tagging their outputs and their regions
    running under `FusedCuts`, as the generated code runs them; ``local``: the parts' sizes on
    one rank where they are not 1/tp of each (key/value parts computed by group)."""
    local = local or {}
    fused_section = _section()
    with contextlib.ExitStack() as stack:
        regions: list[nn.Module] = []
        for name, parts in fused.items():
            handle = named[name].register_forward_hook(
                lambda _m, _i, out, parts=parts, shares=local.get(name): fused_section.tag_fused_output(out, parts,
                                                                                                      shares))
            stack.callback(handle.remove)
            region = named[name.rpartition(".")[0]]
            if all(region is not seen for seen in regions):
                regions.append(region)
                stack.enter_context(forward_within(region, fused_section.FusedCuts))
        yield

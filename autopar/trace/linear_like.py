"""Modules that compute an affine map of their input, recognised by what their forward computes.

Tensor parallelism splits a linear layer by sharding its weight; torch's styles accept only
``nn.Linear``, but models write the same map other ways: Hugging Face GPT-2's ``Conv1D`` keeps
its weight transposed, ``(in, out)``, and computes ``x @ W + b``; Falcon's ``FalconLinear`` is an
``nn.Linear`` whose own forward computes ``x @ W.T + b``. A class name says nothing about either
(a subclass may scale, mask or add to the map), so the module's forward is run once on small
real tensors, away from the model's fake ones, and compared with both affine maps.

A module qualifies when it holds a 2-D ``weight``, at most a 1-D ``bias`` of its output
features, nothing else (no buffers, no children with state), and its forward on one tensor
equals the map for random values. ``nn.Linear`` itself needs no probe.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch import nn
from torch.func import functional_call

from autopar.sections.contract import bias_of, tensor_of

# Weights above this many elements are not probed (the probe allocates the weight for real):
# 64M floats, 256 MiB. Such a module is left to the class rule (it runs replicated).
PROBE_LIMIT = 1 << 26


@dataclass(frozen=True)
class AffineLayout:
    """How an affine module stores its weight.

    Attributes:
        transposed: the weight is ``(in, out)`` and the forward computes ``x @ W + b`` (GPT-2's
            Conv1D); otherwise ``(out, in)`` and ``x @ W.T + b``, as ``nn.Linear``.
        in_features, out_features: the map's sizes.
    """

    transposed: bool
    in_features: int
    out_features: int

    @property
    def out_dim(self) -> int:
        """The weight dim holding the output features (a column split shards it)."""
        return 1 if self.transposed else 0


def affine_layout(module: nn.Module) -> AffineLayout | None:
    """The module's affine layout when its forward computes ``x @ W.T + b`` or ``x @ W + b`` on
    its weight and bias (see the module docstring), else None."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or isinstance(module, nn.Embedding):
        return None
    if type(module).forward is nn.Linear.forward and isinstance(module, nn.Linear):
        return AffineLayout(False, weight.shape[1], weight.shape[0])
    if not _holds_only_weight_and_bias(module) or weight.numel() > PROBE_LIMIT:
        return None
    key = _probe_key(module)
    if key not in _PROBED:
        _PROBED[key] = _probe(module)
    return _PROBED[key]


# Probe results by what decides them (a model repeats one class and shape per block: GPT-2 XL's
# 192 Conv1D modules are probed 4 times).
_PROBED: dict[tuple, "AffineLayout | None"] = {}


def _probe_key(module: nn.Module) -> tuple:
    """The class, the parameters' shapes, the plain attributes (Conv1D's ``nf``) and the mode."""
    plain = tuple(sorted((name, value) for name, value in vars(module).items()
                         if isinstance(value, (int, float, str, bool, type(None))) and not name.startswith("_")))
    shapes = tuple((name, tuple(p.shape)) for name, p in module.named_parameters())
    return type(module), shapes, plain, module.training


def _probe(module: nn.Module) -> "AffineLayout | None":
    weight = tensor_of(module, "weight")
    bias = bias_of(module)
    rows, cols = weight.shape
    candidates = [AffineLayout(False, cols, rows), AffineLayout(True, rows, cols)]
    for layout in candidates:
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != layout.out_features):
            continue
        if _computes(module, layout, bias is not None):
            return layout
    return None


def _holds_only_weight_and_bias(module: nn.Module) -> bool:
    names = {name for name, _ in module.named_parameters()}
    buffers = [name for name, _ in module.named_buffers()]
    return not buffers and names <= {"weight", "bias"} and "weight" in names


def _computes(module: nn.Module, layout: AffineLayout, has_bias: bool) -> bool:
    """Whether the forward equals the layout's affine map on random values (two leading dims,
    so a forward that flattens and restores them is checked too)."""
    with _no_fake_mode():
        generator = torch.Generator().manual_seed(0)
        rows, cols = tensor_of(module, "weight").shape
        weight = torch.randn(rows, cols, generator=generator)
        bias = torch.randn(layout.out_features, generator=generator) if has_bias else None
        x = torch.randn(2, 3, layout.in_features, generator=generator)
        tensors = {"weight": weight, **({"bias": bias} if bias is not None else {})}
        try:
            with torch.no_grad():
                got = functional_call(module, tensors, (x,))
        except Exception:  # noqa: BLE001 - a forward that cannot run on one plain tensor is no affine map
            return False
        expected = x @ (weight if layout.transposed else weight.T)
        if bias is not None:
            expected = expected + bias
        return type(got) is torch.Tensor and got.shape == expected.shape \
            and torch.allclose(got, expected, rtol=1e-4, atol=1e-4)


def _no_fake_mode():
    """Leave any fake-tensor mode active around the probe (the model may be built under one)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


@contextmanager
def linear_stand_ins(model: nn.Module, named: dict[str, nn.Module],
                     names: Iterable[str]) -> Iterator[dict[str, nn.Module]]:
    """``named`` with each transposed affine module of ``names`` swapped, in ``model`` too, for an
    ``nn.Linear`` computing the same map on the same (transposed) weight, so code that narrows
    linears to one rank's share (the local-shapes probe) narrows it the same way. The split
    module's forward runs on DTensors of global shape (its style converts the inputs), so only
    its output's local shape matters to the code around it; that is what the stand-in gives."""
    swapped: dict[str, nn.Module] = {}
    for name in names:
        module = named.get(name)
        layout = affine_layout(module) if module is not None else None
        if module is None or layout is None or not layout.transposed:
            continue
        stand_in = nn.Linear(1, 1, bias=False)
        stand_in.in_features, stand_in.out_features = layout.in_features, layout.out_features
        weight = tensor_of(module, "weight")
        stand_in.weight = nn.Parameter(weight.detach().t(), requires_grad=weight.requires_grad)
        stand_in.register_parameter("bias", getattr(module, "bias", None))  # the module's own, shared
        swapped[name] = module
        _set_submodule(model, name, stand_in)
    try:
        yield {**named, **{name: model.get_submodule(name) for name in swapped}}
    finally:
        for name, module in swapped.items():
            _set_submodule(model, name, module)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    owner, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, attribute, module)

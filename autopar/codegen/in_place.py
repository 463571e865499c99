"""Which modules' outputs the model's code modifies in place (Falcon's ``mlp_output += attention_output``).

A module split by a torch parallel style returns ``DTensor.to_local()``, a view made inside an
autograd function, which autograd forbids modifying in place. Such a module's output is copied
once in the generated module (sections/linear_like.py's ``OwnedOutput``) instead of the module
being kept whole; this finds them by running the model's forward once on fake tensors.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _InPlaceWatch(TorchDispatchMode):
    """Follows module outputs through views and records in-place ops on any of them."""

    def __init__(self) -> None:
        super().__init__()
        self.owners: dict[int, list[str]] = {}  # tensor id -> modules whose output it is (or views)
        self.kept: list[torch.Tensor] = []  # so ids stay unique while watched
        self.modified: set[str] = set()

    def watch(self, name: str, tensor: torch.Tensor) -> None:
        self.owners.setdefault(id(tensor), []).append(name)
        self.kept.append(tensor)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        owners = self.owners.get(id(first), []) if first is not None else []
        if owners and func._schema.arguments and func._schema.arguments[0].alias_info is not None \
                and func._schema.arguments[0].alias_info.is_write:
            self.modified.update(owners)
        out = func(*args, **(kwargs or {}))
        if owners and getattr(func, "is_view", False):
            for tensor in tree_flatten(out)[0]:
                if isinstance(tensor, torch.Tensor):
                    self.owners.setdefault(id(tensor), []).extend(owners)
                    self.kept.append(tensor)
        return out


def outputs_modified_in_place(model: nn.Module, run: Callable[[], Any]) -> set[str]:
    """Names of ``model``'s modules whose output (a tensor, or a view of it) some op modifies in
    place while ``run()`` runs the forward (under the caller's fake mode and no_grad)."""
    watch = _InPlaceWatch()
    handles = []
    for name, module in model.named_modules():
        if name:
            def record(_module: nn.Module, _args: tuple, output: Any, name: str = name) -> None:
                if isinstance(output, torch.Tensor):
                    watch.watch(name, output)
            handles.append(module.register_forward_hook(record))
    try:
        with watch:
            run()
    finally:
        for handle in handles:
            handle.remove()
    return watch.modified

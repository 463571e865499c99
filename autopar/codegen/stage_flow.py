"""Which layers' outputs each layer (and the loss) reads: the data flow a pipeline cut must carry.

The module split of a pipeline (sections/pipeline.py) hands one activation from a stage to the
next: the first input of the next stage's first layer. That carries a stack of blocks, but not
an encoder-decoder (every decoder layer reads the encoder's output as a second input) or two
towers (CLIP's loss reads the image tower's projection from the first stage). Such a cut would
train on zeros in place of the value, so it goes to the traced split, which carries every value
a stage reads, or is refused.

Found by one forward and loss on fake tensors under a dispatch mode that records, for every
tensor, the layers whose outputs it was computed from: a layer's output is marked with that
layer, and every op's outputs inherit the marks of its inputs (code between layers included).
Shapes read without an op (``x.shape[1]`` for positions) carry no mark: skipped layers give
zeros of the right shape for those.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

from autopar.model_file import FakeBuild, ModelFile, build_fake_for, call_model, compute_loss, load_model_file
from autopar.trace.grouped_mm import allow_fp32_grouped_mm_on_fake_tensors

LOSS = "the loss"
BATCH = "the batch"  # a source: the traced split copies the batch on its first stage


@dataclass
class LayerReads:
    """What each layer's inputs were computed from, in layers.

    Attributes:
        first: layer -> layers its first input (the residual stream) was computed from.
        other: layer, or `LOSS` -> layers its other inputs (or the loss) were computed from.
        Either may also name `BATCH`: a value computed from the batch itself.
    """

    first: dict[str, set[str]] = field(default_factory=dict)
    other: dict[str, set[str]] = field(default_factory=dict)


class _Provenance(TorchDispatchMode):
    """Marks every tensor an op makes with the layers its inputs came from."""

    def __init__(self) -> None:
        super().__init__()
        self.sources = WeakTensorKeyDictionary()

    def of(self, value: Any) -> set[str]:
        found: set[str] = set()
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                found |= self.sources.get(leaf, set())
        return found

    def mark(self, value: Any, sources: set[str]) -> None:
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                self.sources[leaf] = set(sources)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        found = self.of((args, kwargs))
        if found:
            for leaf in tree_leaves(output):
                if isinstance(leaf, torch.Tensor):
                    self.sources[leaf] = self.sources.get(leaf, set()) | found
        return output


def _called_modules(module: nn.Module) -> list[nn.Module]:
    """The modules that run when ``module`` does: itself, or a ModuleList/ModuleDict's children
    (which forward iterates, never calling the container)."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return [called for child in module.children() for called in _called_modules(child)]
    return [module]


def layer_reads(model_path: str | Path, model_kwargs: dict[str, Any], layers: list[str],
                batch_size: int = 1, real_values: str | None = None) -> LayerReads:
    """Trace one forward and loss of ``model_path`` on fake tensors (real ones where the plan says
    fake tensors cannot run it: ``real_values``); what each of ``layers`` and the loss read (see
    the module docstring)."""
    allow_fp32_grouped_mm_on_fake_tensors()  # fp32 MoE experts, as when the model was traced
    model_file = load_model_file(model_path)
    return build_fake_for(model_file, model_kwargs, batch_size,
                          lambda build: _layer_reads_built(model_file, build, layers), real_values=real_values)


def _layer_reads_built(model_file: ModelFile, build: FakeBuild, layers: list[str]) -> LayerReads:
    provenance = _Provenance()
    reads = LayerReads()
    handles = []
    for layer in layers:
        def before(module: nn.Module, args: tuple, kwargs: dict, layer: str = layer) -> None:
            first = args[0] if args else next(iter(kwargs.values()), None)
            rest = (args[1:], kwargs) if args else dict(list(kwargs.items())[1:])
            reads.first.setdefault(layer, set()).update(provenance.of(first) - {layer})
            reads.other.setdefault(layer, set()).update(provenance.of(rest) - {layer})

        def after(module: nn.Module, args: tuple, output: Any, layer: str = layer) -> None:
            provenance.mark(output, {layer})
        for module in _called_modules(build.model.get_submodule(layer)):
            handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(module.register_forward_hook(after))
    try:
        with build.active(), torch.no_grad(), provenance:
            provenance.mark(build.batch, {BATCH})
            output = call_model(build.model, build.batch)
            reads.other[LOSS] = provenance.of(compute_loss(model_file, output, build.batch))
    finally:
        for handle in handles:
            handle.remove()
    return reads


def uncarried_read(stages: Sequence[Sequence[str]], reads: LayerReads) -> str | None:
    """The first value a module-split pipeline of ``stages`` would not carry, in words (None if
    every read is carried): a layer or the loss reading a layer of another stage, except the
    first layer of a stage reading the previous stage through its first input."""
    stage_of = {layer: index for index, stage in enumerate(stages) for layer in stage}
    last = len(stages) - 1
    for consumer, sources in reads.other.items():
        at = stage_of.get(consumer, last)
        for source in sorted(sources, key=lambda name: (stage_of.get(name, -1), name)):  # same words every run
            if source in stage_of and stage_of[source] != at:
                what = "the loss" if consumer == LOSS else f"layer {consumer} (stage {at})"
                return f"{what} reads the output of {source} (stage {stage_of[source]}) other than as its first input"
    for consumer, sources in reads.first.items():
        at = stage_of[consumer]
        carried = at - 1 if stages[at][0] == consumer else at
        for source in sorted(sources):
            if source in stage_of and stage_of[source] not in (at, carried):
                return (f"layer {consumer} (stage {at}) reads the output of {source} (stage {stage_of[source]}), "
                        "which is not on its stage or the one before it")
    return None


def skipped_read(stages: Sequence[Sequence[str]], reads: LayerReads) -> str | None:
    """The first value a traced pipeline of ``stages`` would have to pass over a stage, in words
    (None if every layer and the loss read only their own stage and the one before; the batch
    counts as the first stage's, which copies it). torch's traced stages send only to the next
    stage: measured on 2 gloo ranks at pp=2 with interleaved v=2 (four stages), T5 failed with
    "Backward of skip connections not supported yet", and the encoder-decoder's first stage was
    refused a send to stage 3."""
    stage_of = {BATCH: 0, **{layer: index for index, stage in enumerate(stages) for layer in stage}}
    last = len(stages) - 1
    for consumer, sources in [*reads.first.items(), *reads.other.items()]:
        at = stage_of.get(consumer, last)
        for source in sorted(sources, key=lambda name: (stage_of.get(name, last), name)):
            if source in stage_of and stage_of[source] < at - 1:
                what = "the loss" if consumer == LOSS else f"layer {consumer} (stage {at})"
                read = "the batch, which stage 0 copies," if source == BATCH else \
                    f"the output of {source} (stage {stage_of[source]})"
                return f"{what} reads {read} past the stages between"
    return None

"""What the traced model fixes for every plan, read from its profile once.

The pricer's per-layer prices and its collective counts both ask the same questions of the
model, whatever the layout: which FSDP unit a layer belongs to (codegen wraps each block, and
the rest at the root), which layer reads a weight another holds (a head tied to the embedding),
which norms run on the sequence slice under sequence parallelism, how large the fused attention
is (what context parallelism moves, ring attention's score blocks, the head count Ulysses
divides) and the largest layer's parameters, tensor and backward working set; and, given a
layout, where its stages start, how each layer is recomputed and whether the loss weighs tokens by
counts. `ModelStructure` answers them from the profile and the compute model alone, so it is built
and tested without a cluster.

    structure = ModelStructure(profile, compute)
    structure.fsdp_units(["blocks.0", "blocks.1", "ln_f"])   # ([["blocks.0"], ["blocks.1"], ["ln_f"]], [])
    structure.tied_layers()                                   # {"lm_head": "wte"}
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopar.domain.layout import ParallelLayout, fsdp_groups
from cost_models.compute import ComputeModel
from cost_models.tp_layout import ModuleTree, sp_layer_layout

if TYPE_CHECKING:
    from autopar.model_profile import LayerProfile, ModelProfile, OpProfile


def attention_io_bytes(op: "OpProfile") -> tuple[float, float]:
    """(query bytes, key + value bytes) entering a fused attention op, at the element size of its
    output (the compute dtype). Grouped-query attention has fewer K/V heads than query heads, which
    is what makes ring attention's K/V traffic smaller than Ulysses' all-to-alls. Falls back to
    thirds of the bytes read when shapes are missing."""
    shapes = op.input_shapes[:3]
    if len(shapes) < 3 or not op.output_shapes or not op.output_shapes[0]:
        return op.bytes_read / 3, 2 * op.bytes_read / 3
    element = op.output_bytes / max(1, math.prod(op.output_shapes[0]))
    return element * math.prod(shapes[0]), element * (math.prod(shapes[1]) + math.prod(shapes[2]))


@dataclass(frozen=True)
class WorkingSet:
    """A layer's backward transients at the profiled micro-batch: its activations, and its two
    largest gradient temporaries of each kind, those that grow with the micro-batch and the
    parameter gradients, which do not (a 530B layer's two 1.7B-element weight gradients are
    6 GiB at any micro-batch; scaled with it, they refused plans that fit)."""

    activation_bytes: float
    batch_temporaries: tuple[float, ...]
    parameter_gradients: tuple[float, ...]

    def at(self, scale: float, tp: int = 1, cp: int = 1) -> float:
        per_token = scale / tp / cp
        temporaries = sorted([*(b * per_token for b in self.batch_temporaries),
                              *(g / tp for g in self.parameter_gradients)], reverse=True)
        return max(self.activation_bytes * per_token, sum(temporaries[:2]))


class ModelStructure:
    """The model's layers and attention as every layout sees them (see the module docstring)."""

    def __init__(self, profile: "ModelProfile", compute: ComputeModel):
        self.profile = profile
        self.compute = compute
        self.layers = profile.layers
        self.layer_index = {layer.name: i for i, layer in enumerate(self.layers)}
        forward_attention = [op for op in profile.ops if op.op_class == "attention" and op.phase == "forward"]
        self.attention_bytes = self._attention_input_bytes(forward_attention)
        self.score_elements = self._attention_scores(forward_attention)
        self.heads = self._attention_heads(forward_attention)
        self.largest_params = max((layer.param_count for layer in self.layers), default=0)
        self.largest_tensor = max((math.prod(shape) for shape in profile.param_shapes.values()), default=0)
        self.working_sets = self._distinct_working_sets()

    # -- FSDP units and tied weights -------------------------------------------------------------

    def fsdp_units(self, layers: list[str]) -> tuple[list[list[str]], list[str]]:
        """(units, root) FSDP wraps on one pipeline stage holding ``layers``, as codegen's
        `apply_fsdp` wraps them: the whole model's `fsdp_groups` cut to the stage, and the root
        the rest (the embeddings). Layers without parameters of their own (a head tied to the
        embedding) join no unit; a unit or root left without parameters issues nothing."""
        held = [name for name in layers if self.layers[self.layer_index[name]].param_count > 0]
        groups = fsdp_groups([layer.name for layer in self.layers],
                             {layer.name for layer in self.layers if layer.is_block})
        units = [unit for group in groups if (unit := [name for name in group if name in held])]
        grouped = {name for unit in units for name in unit}
        return units, [name for name in held if name not in grouped]

    def fsdp_unit_of(self, name: str) -> tuple[tuple[str, ...], bool]:
        """(the FSDP unit holding layer ``name``, whether it is the root) on an unsplit model:
        what the per-layer prices share a message with. A layer without parameters is a unit
        of its own (it moves nothing)."""
        return self._unit_index.get(name, ((name,), False))

    @functools.cached_property
    def _unit_index(self) -> dict[str, tuple[tuple[str, ...], bool]]:
        units, root = self.fsdp_units([layer.name for layer in self.layers])
        index = {member: (tuple(unit), False) for unit in units for member in unit}
        index.update({member: (tuple(root), True) for member in root})
        return index

    def tied_layers(self) -> dict[str, str]:
        """Layer -> the layer owning a weight it reads without holding it (a head tied to the
        token embedding), from the traced forward ops: what the profile lists under no layer's
        parameters."""
        return self._tied_layers

    @functools.cached_property
    def _tied_layers(self) -> dict[str, str]:
        owner = {param: layer.name for layer in self.layers for param in layer.param_names}
        by_name = {op.name: op for op in self.profile.ops}
        tied: dict[str, str] = {}
        for op in self.profile.ops:
            if op.phase != "forward":
                continue
            for param in self.profile.params_read(op, by_name):
                if param in owner and owner[param] != op.layer and op.layer in self.layer_index:
                    tied[op.layer] = owner[param]
        return tied

    # -- stages, recomputation and the loss under a layout ----------------------------------------

    def stage_starts(self, layout: ParallelLayout) -> list[int]:
        """Index of the first layer of each (virtual) stage: the layout's pinned stages, or
        `even_stage_starts`."""
        stages = layout.pp * layout.chunks
        if layout.stages:
            return [self.layer_index[stage[0]] for stage in layout.stages]
        return even_stage_starts([layer.repeat_of or layer.name for layer in self.layers], stages)

    def layer_options(self, layout: ParallelLayout, options: tuple[str, ...]) -> list[int]:
        """Each layer's recompute option under the layout, as its index in ``options``.

        Raises:
            ValueError: the layout recomputes a layer in a way ``options`` does not offer.
        """
        recompute = layout.recompute
        names = [recompute.get(layer.name, "none") if isinstance(recompute, dict) else recompute
                 for layer in self.layers]
        return [options.index(name) for name in names]

    def weighs_tokens(self, layout: ParallelLayout) -> bool:
        """Whether the step weighs a token-level loss by counts: the loss is a mean over the
        targets it counts (the profile's ``token_loss``) and the layout splits the batch (data or
        context parallel ranks, or micro-batches), so parts count different numbers of them."""
        splits = layout.dp * layout.cp > 1 or layout.num_micro_batches > 1
        return splits and getattr(self.profile, "token_loss", None) is not None

    # -- sequence parallelism -------------------------------------------------------------------

    def slice_norm_params(self, layer: str) -> list[str]:
        """Parameters of the norms that run on the sequence slice in ``layer`` under SP (the
        roles of `cost_models.tp_layout`: a norm's role does not depend on the TP styles)."""
        names = [each.name for each in self.layers]
        on_slice = sp_layer_layout(self._module_tree, layer, self.profile.block_containers, names, {}).on_slice
        return [param for param in self.layers[self.layer_index[layer]].param_names
                if param.rpartition(".")[0] in on_slice]

    @functools.cached_property
    def _module_tree(self) -> ModuleTree:
        return ModuleTree.of_profile(self.profile)

    # -- sizes ------------------------------------------------------------------------------------

    def working_set(self, layer: "LayerProfile") -> "WorkingSet":
        """What a layer's backward holds beyond the stored activations, at the profiled
        micro-batch: its full activations (recomputed, or gradients as large) or, where more, its
        two largest gradient temporaries alive together (an op's incoming and outgoing gradient:
        a loss's logit gradients, twice what its log-softmax saved; on an H100 a 1B Llama at
        micro-batch 8 held 2 GB more than the layer's activations there). A temporary shaped as
        one of the parameters the layer holds or reads (a tied head: the embedding's) is that
        parameter's gradient, as large at any micro-batch; shaped as it, dimension by dimension: a
        loss's tokens x vocabulary gradient is not a vocabulary x hidden weight's transposed when
        the sequence is as long as the model is wide (Llama 1B at 2048 tokens)."""
        ops = self.compute.ops_by_layer.get(self.compute.kind(layer.name), [])
        # Only a layer holding nothing can be a head reading a tied weight (finding ties reads
        # every forward op: a third of a second for a 70B model, for nothing on untied ones).
        tied = None if layer.param_names else self.tied_layers().get(layer.name)
        owners = [layer, *([self.layers[self.layer_index[tied]]] if tied else [])]
        shapes = {tuple(self.profile.param_shapes.get(name, ()))
                  for owner in owners for name in owner.param_names}
        batch: list[float] = []
        parameter: list[float] = []
        for op in ops:
            if op.phase != "backward":
                continue
            is_parameter = len(op.output_shapes) == 1 and tuple(op.output_shapes[0]) in shapes
            (parameter if is_parameter else batch).append(float(op.output_bytes))
        return WorkingSet(float(layer.activation_bytes), tuple(sorted(batch, reverse=True)[:2]),
                          tuple(sorted(parameter, reverse=True)[:2]))

    def _distinct_working_sets(self) -> frozenset["WorkingSet"]:
        """Each layer kind's working set, read once per kind (80 identical blocks share theirs)."""
        by_kind: dict[tuple[str, int], WorkingSet] = {}
        for layer in self.layers:
            key = (self.compute.kind(layer.name), layer.activation_bytes)
            if key not in by_kind:
                by_kind[key] = self.working_set(layer)
        return frozenset(by_kind.values())

    def largest_working_set(self, scale: float, tp: int = 1, cp: int = 1) -> float:
        """The largest layer's working set at ``scale`` times the profiled micro-batch, on a rank
        holding 1/tp of each layer and 1/cp of the sequence (parameter gradients: 1/tp)."""
        return max((ws.at(scale, tp, cp) for ws in self.working_sets), default=0.0)

    @staticmethod
    def _attention_input_bytes(attention: list["OpProfile"]) -> dict[str, tuple[float, float]]:
        """Per layer, (query, key + value) bytes entering fused attention: what context
        parallelism moves. Only those inputs: a mask the model materialised (Hugging Face builds
        an S x S one when traced) is not part of the exchange."""
        result: dict[str, tuple[float, float]] = {}
        for op in attention:
            q, kv = attention_io_bytes(op)
            before = result.get(op.layer, (0.0, 0.0))
            result[op.layer] = (before[0] + q, before[1] + kv)
        return result

    @staticmethod
    def _attention_scores(attention: list["OpProfile"]) -> float:
        """Elements of the largest fused attention's score matrix (batch x heads x queries x
        keys) at the profiled micro-batch: what ring attention's blocks materialise."""
        largest = 0.0
        for op in attention:
            if len(op.input_shapes) >= 2 and len(op.input_shapes[0]) == 4 and len(op.input_shapes[1]) == 4:
                batch, heads, queries, _ = op.input_shapes[0]
                largest = max(largest, float(batch * heads * queries * op.input_shapes[1][2]))
        return largest

    @staticmethod
    def _attention_heads(attention: list["OpProfile"]) -> int | None:
        """Attention heads (dim 1 of the first fused attention's query), for Ulysses' divisibility."""
        return next((int(op.input_shapes[0][1]) for op in attention
                     if op.input_shapes and len(op.input_shapes[0]) == 4), None)


def even_stage_starts(kinds: list[str], stages: int) -> list[int]:
    """First layer of each stage when none is pinned: the repeated blocks (the layers of the most
    common kind) split evenly, what comes before the first block joining the first stage and what
    comes after the last joining the last, as Megatron-LM and torchtitan split a model by hand
    (embedding on the first stage, head on the last). Splitting every layer by count instead gave
    a 1T GPT on 64 stages a stage of its own for the embeddings and three blocks to some others.
    Falls back to an even split by count when the blocks are fewer than the stages or interrupted."""
    count = len(kinds)
    block_kind = max(dict.fromkeys(kinds), key=kinds.count)
    blocks = [i for i, kind in enumerate(kinds) if kind == block_kind]
    if len(blocks) < stages or blocks != list(range(blocks[0], blocks[-1] + 1)):
        return [round(j * count / stages) for j in range(stages)]
    return [0] + [blocks[0] + round(j * len(blocks) / stages) for j in range(1, stages)]

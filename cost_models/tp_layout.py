"""The tensor-parallel layout shared by the pricer and the code generator: from the modules'
styles, where each module of a block runs under sequence parallelism and which collectives its
boundaries issue.

With sequence parallelism (Korthikanti et al. 2022) the residual stream between modules is
split along the sequence over the TP group. What a module of a block does with it depends on
its role, decided here once (`sp_role`); codegen writes the matching torch style
(`autopar.codegen.tp_plan`) and the pricer divides by t exactly the work that runs on a slice
and prices exactly the collectives the styles issue:

  role            torch style                 runs on           boundary collectives
  SEQUENCE_SHARD  SequenceParallel (norms)    the rank's slice  none (weights' gradients: tiny)
  SPLIT_REGION    PrepareModuleInput + split  heads / columns   all-gather in, reduce-scatter out
                  matmuls (attention, MLP)                      (backward: the reverse): the
                                                                all-reduce pair without SP
  GATHERED        PrepareModuleInputOutput    the whole         all-gather in, slice out; in
                  (a replicated module)       sequence          backward the gradient gathered
  LOCAL           none (no parameters: the    the rank's slice  none
                  block's own adds, dropout)
  UNSUPPORTED     a linear on the stream      -                 (codegen refuses SP)

A module no split covers is GATHERED: every TP rank computes it on the whole sequence, so its
work is not divided by t (before this layout, the pricer divided every replicated op by t under
SP and priced no gathers: a tp=2 plan with every module replicated was predicted 4.18 ms of
compute with SP against 6.47 ms without, and 0 ms of TP communication).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from cost_models.collectives import Collective

if TYPE_CHECKING:
    from autopar.model_profile import ModelProfile

SPLIT_STYLES = ("colwise", "rowwise")
# Styles that hand a paired region's attention its heads as a column-parallel linear does: a
# key/value projection with fewer heads than ranks computes its group's head (kv_group).
COLUMN_STYLES = ("colwise", "kv_group")


class SPRole(StrEnum):
    SEQUENCE_SHARD = "sequence_shard"
    SPLIT_REGION = "split_region"
    GATHERED = "gathered"
    LOCAL = "local"
    UNSUPPORTED = "unsupported"


# Collectives a module's sequence-parallel boundary issues per micro-batch, (phase, collective),
# each moving the residual stream's bytes (the whole sequence's b·s·h).
SP_BOUNDARY: dict[SPRole, tuple[tuple[str, Collective], ...]] = {
    SPRole.SPLIT_REGION: (("forward", Collective.ALL_GATHER), ("forward", Collective.REDUCE_SCATTER),
                          ("backward", Collective.REDUCE_SCATTER), ("backward", Collective.ALL_GATHER)),
    SPRole.GATHERED: (("forward", Collective.ALL_GATHER), ("backward", Collective.ALL_GATHER)),
}


def sp_role(kind: str, has_parameters: bool, is_region: bool) -> SPRole:
    """The role of a block's direct child under sequence parallelism (the table above)."""
    if not has_parameters:
        return SPRole.LOCAL
    if kind == "norm":
        return SPRole.SEQUENCE_SHARD
    if is_region:
        return SPRole.SPLIT_REGION
    if kind == "linear":
        return SPRole.UNSUPPORTED
    return SPRole.GATHERED


def pairs(chosen: set[str]) -> bool:
    """Whether a region's linears of these styles pair: a row-parallel one beside a column-side
    one (column-parallel, or a key/value projection computing its group's head)."""
    return "rowwise" in chosen and bool(chosen & set(COLUMN_STYLES))


def paired_regions(styles: dict[str, str], children: dict[str, list[str]], kind: Callable[[str], str]) -> set[str]:
    """Modules whose linear children are all split, with both column- and row-wise among them
    (Megatron's pairing: inside, the activation stays sharded); a key/value projection computing
    its group's head (kv_group) counts as column-wise (Phi-3's fused qkv_proj is the region's
    only column-side linear)."""
    regions = set()
    for name, kids in children.items():
        linears = [c for c in kids if kind(c) == "linear"]
        chosen = {styles.get(c, "replicate") for c in linears}
        if linears and pairs(chosen) and chosen <= {*SPLIT_STYLES, *COLUMN_STYLES}:
            regions.add(name)
    return regions


@dataclass(frozen=True)
class ModuleTree:
    """The module structure the roles are read from: children, kinds and parameters.

    Codegen builds it from the real model (`ModelFacts`), the pricer from the profile
    (`ModuleTree.of_profile`); the roles then come from the same functions."""

    children: dict[str, list[str]]
    kinds: dict[str, str]
    with_parameters: frozenset[str]

    def kind(self, name: str) -> str:
        return self.kinds.get(name, "other")

    def roles(self, block: str, styles: dict[str, str]) -> dict[str, SPRole]:
        """Role of each direct child of `block` under sequence parallelism."""
        regions = paired_regions(styles, self.children, self.kind)
        return {child: sp_role(self.kind(child), child in self.with_parameters, child in regions)
                for child in self.children.get(block, [])}

    @classmethod
    def of_profile(cls, profile: "ModelProfile") -> "ModuleTree":
        """The profile's tree, built once per profile (the planner asks for it from several
        places, and reading 30,000 ops of a 405B model takes a third of a second each time)."""
        key = id(profile)
        if key not in _TREES:
            _TREES[key] = cls._read(profile)
            weakref.finalize(profile, _TREES.pop, key, None)
        return _TREES[key]

    @classmethod
    def _read(cls, profile: "ModelProfile") -> "ModuleTree":
        """From the traced ops' modules and the parameter names. A module is a norm when it owns
        only 1-D parameters (scale and shift vectors), linear when a GEMM of its own reads a
        weight (its own 2-D one, or a tied one it does not own: GPT's head), an embedding when
        an embedding lookup runs in it (what codegen reads from the module classes, here
        without them)."""
        names: set[str] = set()
        for param in profile.param_shapes:
            parts = param.split(".")[:-1]
            names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        for op in profile.ops:
            if op.module:
                parts = op.module.split(".")
                names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        children: dict[str, list[str]] = {}
        for name in sorted(names, key=lambda n: (n.count("."), n)):
            parent = name.rpartition(".")[0]
            children.setdefault(parent, []).append(name)
        owned: dict[str, list[list[int]]] = {}
        for param, shape in profile.param_shapes.items():
            owned.setdefault(param.rpartition(".")[0], []).append(list(shape))
        op_classes: dict[str, set[str]] = {}
        by_name = {op.name: op for op in profile.ops}

        def reads_parameter(op: Any) -> bool:
            for source in op.inputs:
                view = by_name.get(source)
                while view is not None and view.op_class == "view" and len(view.inputs) == 1:
                    source, view = view.inputs[0], by_name.get(view.inputs[0])
                if profile.placeholders.get(source, "").startswith("param:"):
                    return True
            return False

        readers = set()  # modules whose GEMM reads a weight, their own or a tied one
        for op in profile.ops:
            if op.phase == "forward" and op.module:
                op_classes.setdefault(op.module, set()).add("embedding" if "embedding" in op.target else op.op_class)
                if op.op_class == "gemm" and reads_parameter(op):
                    readers.add(op.module)
        kinds = {}
        for name in names:
            shapes, classes = owned.get(name, []), op_classes.get(name, set())
            if shapes and all(len(s) == 1 for s in shapes):
                kinds[name] = "norm"
            elif "embedding" in classes:
                kinds[name] = "embedding"
            elif name in readers and (not shapes or any(len(s) == 2 for s in shapes)):
                kinds[name] = "linear"
            else:
                kinds[name] = "other"
        owners = {".".join(param.split(".")[:i]) for param in profile.param_shapes
                  for i in range(1, param.count(".") + 1)}  # every module holding a parameter below it
        with_parameters = frozenset(n for n in names if n in readers or n in owners)
        return cls(children=children, kinds=kinds, with_parameters=with_parameters)


_TREES: dict[int, ModuleTree] = {}  # id(profile) -> its tree, dropped with the profile


@dataclass(frozen=True)
class SPLayerLayout:
    """One layer under sequence parallelism, as the generated styles run it.

    Attributes:
        on_slice: modules whose ops run on the rank's slice of the sequence (work ÷ t); ops
            directly in the layer's module or in no module count as on the slice in a block.
        whole: modules whose ops run on the whole sequence, replicated (work not divided).
        boundary: (phase, collective) per micro-batch beyond the split's own, each moving the
            residual stream (`SP_BOUNDARY` of the GATHERED children; the blocks' entry).
        boundary_bytes: which stream those move: the layer's input ("input") or, at the blocks'
            entry, the first block's input ("output" of the layers before it).
        norms: how many norms run as SequenceParallel modules (on DTensors, dispatched on the
            host like a split module: cost_models.host).
    """

    on_slice: frozenset[str] = frozenset()
    whole: frozenset[str] = frozenset()
    block_ops_on_slice: bool = False
    boundary: tuple[tuple[str, Collective], ...] = ()
    boundary_bytes: str = "input"  # the layer's input stream, or the first block's (the blocks' entry)
    norms: int = 0

    def runs_on_slice(self, module: str | None) -> bool:
        """Whether a replicated op of `module` runs on the sequence slice."""
        if module is not None:
            for prefix in self.whole:
                if module == prefix or module.startswith(prefix + "."):
                    return False
            for prefix in self.on_slice:
                if module == prefix or module.startswith(prefix + "."):
                    return True
        return self.block_ops_on_slice


def sp_layer_layout(tree: ModuleTree, layer: str, containers: Sequence[str], layer_names: list[str],
                    styles: dict[str, str]) -> SPLayerLayout:
    """Where a layer's replicated work runs under sequence parallelism and what its boundaries
    add (codegen's `_sequence_parallel_styles` applies the same roles). ``containers``: the
    model's stacks of blocks (sequence parallelism is searched for one stack only)."""
    after = after_blocks(layer_names, containers)
    before = before_blocks(layer_names, containers)
    if before and layer == before[-1]:
        # The first block slices the replicated stream (PrepareModuleInput Replicate -> Shard(1));
        # in backward the slices' gradients are gathered, once per micro-batch, at this layer's output.
        return SPLayerLayout(boundary=(("backward", Collective.ALL_GATHER),), boundary_bytes="output")
    if stack_of(layer, containers) is not None:
        roles = tree.roles(layer, styles)
        boundary = tuple(step for child, role in roles.items() if role == SPRole.GATHERED
                         for step in SP_BOUNDARY[role])
        return SPLayerLayout(
            on_slice=frozenset(c for c, r in roles.items() if r in (SPRole.SEQUENCE_SHARD, SPRole.LOCAL)),
            whole=frozenset(c for c, r in roles.items() if r == SPRole.GATHERED),
            block_ops_on_slice=True, boundary=boundary,
            norms=sum(role == SPRole.SEQUENCE_SHARD for role in roles.values()))
    if layer in after and tree.kind(layer) == "norm":
        return SPLayerLayout(on_slice=frozenset({layer}), norms=1)  # the final norm: SequenceParallel
    heads = [name for name in after if tree.kind(name) == "linear"]
    if layer in after and styles.get(layer, "replicate") not in SPLIT_STYLES \
            and (layer in tree.with_parameters or (heads and layer == heads[-1])):
        # A replicated head (or other unit after the blocks) gathers the sequence to run whole.
        return SPLayerLayout(whole=frozenset({layer}), boundary=(("forward", Collective.ALL_GATHER),))
    return SPLayerLayout()  # embeddings before the blocks run on the whole sequence


def stack_of(layer: str, containers: Sequence[str]) -> str | None:
    """The stack ``layer`` is a block of (a direct child of that container), or None."""
    parent = layer.rpartition(".")[0]
    return parent if parent in containers else None


def before_blocks(layer_names: list[str], containers: Sequence[str]) -> list[str]:
    """Layers before the first block of any stack, in layer order (embeddings)."""
    blocks = [i for i, name in enumerate(layer_names) if stack_of(name, containers) is not None]
    return layer_names[:min(blocks)] if blocks else []


def after_blocks(layer_names: list[str], containers: Sequence[str]) -> list[str]:
    """Layers after the last block of any stack, in layer order (final norm, head)."""
    blocks = [i for i, name in enumerate(layer_names) if stack_of(name, containers) is not None]
    return layer_names[max(blocks) + 1:] if blocks else []


@dataclass(frozen=True)
class SPParts:
    """What sequence parallelism changes in a layer's price (read by `PlanPricer`).

    Attributes:
        forward_s, backward_s: roofline seconds of replicated ops that run on the slice (the
            pricer divides these by t under SP, and only these).
        comm: (collective, bytes at the profiled micro-batch) the boundaries add, forward first.
        forward_comm: how many leading entries of `comm` are forward.
        norms: the norms it runs as SequenceParallel modules (`SPLayerLayout.norms`).
    """

    forward_s: float = 0.0
    backward_s: float = 0.0
    comm: tuple[tuple[str, float], ...] = ()
    forward_comm: int = 0
    norms: int = 0


def sp_parts(profile: "ModelProfile", tree: ModuleTree, layer_name: str, styles: dict[str, str],
             replicated_forward: Iterable[Any], replicated_backward: Iterable[Any],
             seconds: Callable[[Any], float]) -> SPParts:
    """Price a layer's sequence-parallel layout: which of its replicated ops (`seconds` each)
    run on the slice, and the boundary collectives, each moving the layer's input stream."""
    names = [layer.name for layer in profile.layers]
    layout = sp_layer_layout(tree, layer_name, profile.block_containers, names, styles)
    if layout.boundary_bytes == "output":  # the stream entering the first block
        stream = float(profile.layer(names[len(before_blocks(names, profile.block_containers))]).input_bytes)
    else:
        stream = float(profile.layer(layer_name).input_bytes)
    ordered = [c for phase, c in layout.boundary if phase == "forward"] + \
              [c for phase, c in layout.boundary if phase == "backward"]
    return SPParts(forward_s=sum(seconds(op) for op in replicated_forward if layout.runs_on_slice(op.module)),
                   backward_s=sum(seconds(op) for op in replicated_backward if layout.runs_on_slice(op.module)),
                   comm=tuple((c.value, stream) for c in ordered),
                   forward_comm=sum(1 for phase, _ in layout.boundary if phase == "forward"), norms=layout.norms)

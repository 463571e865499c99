"""A kept profile's ops with the copied blocks' written by reference (autopar.profile_cache).

A block that repeats another (`LayerProfile.repeat_of`: traced once and copied by
autopar.trace.repeated_blocks, or traced alike) has the same ops as the block it repeats but
for their names, modules, layer and inputs. Each such op is kept as `[layer index, name,
inputs]`, its inputs among the same block's ops by their position in it; the rest comes back
from the op at the same position of the block it repeats. An op that is not such a repeat (a
first block reading the embedding differently) is kept whole. Written out whole, a 70B Llama's
18,747 ops took 7 MB and a second to read back, more than a tenth of planning it again.
"""
from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any

from autopar.model_profile import LayerProfile, OpProfile, renamed

Folded = list[Any]  # [layer index, name, inputs: an int for an op of the same block, else the name]


def fold(ops: list[OpProfile], layers: list[LayerProfile]) -> list[OpProfile | Folded]:
    """`ops` with every op that repeats its block's source op at the same position folded."""
    # Only a block kept whole can be repeated from (a repeat of a repeat is kept whole).
    source_of = {layer.name: layer.repeat_of for layer in layers if layer.repeat_of}
    source_of = {name: source for name, source in source_of.items() if source not in source_of}
    index_of = {layer.name: index for index, layer in enumerate(layers)}
    by_layer = _ops_by_layer(ops)
    positions = {name: {op.name: at for at, op in enumerate(by_layer[name])} for name in source_of}
    seen: dict[str, int] = defaultdict(int)
    kept: list[OpProfile | Folded] = []
    for op in ops:
        at = seen[op.layer]
        seen[op.layer] += 1
        source = source_of.get(op.layer)
        template = by_layer[source][at] if source is not None and at < len(by_layer[source]) else None
        if source is not None and template is not None \
                and op == _repeat(template, source, op.layer, op.name, op.inputs):
            local = positions[op.layer]
            kept.append([index_of[op.layer], op.name, [local.get(name, name) for name in op.inputs]])
        else:
            kept.append(op)
    return kept


def unfold(kept: list[OpProfile | Folded], layers: list[LayerProfile]) -> list[OpProfile]:
    """The ops `fold` was given."""
    entries = [(layers[entry[0]].name, entry) if isinstance(entry, list) else (entry.layer, entry) for entry in kept]
    names: dict[str, list[str]] = defaultdict(list)
    for layer, entry in entries:
        names[layer].append(entry[1] if isinstance(entry, list) else entry.name)
    by_layer = _ops_by_layer([entry for entry in kept if not isinstance(entry, list)])
    source_of = {layer.name: layer.repeat_of for layer in layers if layer.repeat_of}
    seen: dict[str, int] = defaultdict(int)
    ops = []
    for layer, entry in entries:
        at = seen[layer]
        seen[layer] += 1
        if isinstance(entry, list):
            local = names[layer]
            source = source_of[layer]
            entry = _repeat(by_layer[source][at], source, layer, entry[1],
                            [local[name] if isinstance(name, int) else name for name in entry[2]])
        ops.append(entry)
    return ops


def _ops_by_layer(ops: list[OpProfile]) -> dict[str, list[OpProfile]]:
    by_layer: dict[str, list[OpProfile]] = defaultdict(list)
    for op in ops:
        by_layer[op.layer].append(op)
    return by_layer


@functools.lru_cache(maxsize=4096)
def _module_in(module: str | None, source: str, layer: str) -> str | None:
    """A module of `source` as `layer`'s (a block has tens of modules, repeated by every op)."""
    return renamed(module, source, layer)


def _repeat(template: OpProfile, source: str, layer: str, name: str, inputs: list[str]) -> OpProfile:
    """The op of `layer` at `template`'s position in `source` (as repeated_blocks copies it):
    `dataclasses.replace` without its __init__ call (OpProfile has no __post_init__), which was
    most of reading a 70B profile back."""
    op = object.__new__(OpProfile)
    op.__dict__.update(template.__dict__, name=name, inputs=inputs, module=_module_in(template.module, source, layer),
                       layer=layer)
    return op

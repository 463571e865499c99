"""Group a captured step's nodes into layers, and find the blocks that repeat.

A *layer* is the unit pipeline stages are cut along. The model's *stacks* are its containers of
repeated blocks (`find_block_containers` states the rule): `blocks` in our GPT, `model.layers`
in Hugging Face Llama, `transformer.h` in nanoGPT, and both `encoder.block` and `decoder.block`
in T5 (both towers in CLIP). Every block of every stack is a layer. Every other module beside
the paths from the root to the stacks (embeddings, final norms, LM head) is a layer too, and a
parameter-less one (rotary embedding tables) is folded into its neighbour.
Ops that run in an ancestor's own forward (the residual add in a root module, the loss) belong
to the layer that ran last, so the loss sits with the LM head on the last stage.
Layers whose forward and backward ops, shapes and parameters are identical are repeats: later
stages cost the first and reuse it.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autopar.model_profile import inside
from autopar.trace.capture import BACKWARD, CapturedStep
from autopar.trace.ops import op_name

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
# A second stack is split into its blocks when it holds at least this share of the model's
# parameters. In the zoo's tiny models the smaller stack holds 33% (Whisper's encoder) to 41%
# (CLIP's towers, T5's encoder 38%); the decoder-only models have no second stack at all. A
# smaller stack stays one layer (plan.blocks names it when it should be split too).
STACK_SHARE = 0.10


@dataclass(frozen=True)
class LayerGrouping:
    """Result of grouping.

    Attributes:
        containers: FQNs of the stacks (containers of blocks) in the order their blocks run;
            empty if the model has none.
        layer_names: layers in forward execution order.
        block_names: the subset of layer_names that are the stacks' children.
        node_layer: fx node name -> layer name, for every call_function / get_attr node.
        param_layer: parameter FQN -> layer whose ops first use it (tied weights: the first).
        repeat_of: layer name -> the earlier identical layer it repeats (absent if unique).
    """

    containers: list[str]
    layer_names: list[str]
    block_names: list[str]
    node_layer: dict[str, str]
    param_layer: dict[str, str]
    repeat_of: dict[str, str]


def find_block_containers(model: nn.Module) -> list[str]:
    """The model's stacks of blocks, in module order.

    A *stack* is a ModuleList / ModuleDict / Sequential of 2 or more children all of one class
    (a ModuleList of decoder layers); one of mixed children (nanoGPT's ``transformer =
    ModuleDict(wte, wpe, h, ln_f)``) is only a namespace, and its stacks are looked for inside
    it. The stacks are taken largest first (parameters, then children): the largest always,
    every other one that holds at least `STACK_SHARE` of the model's parameters and is neither
    inside nor around a stack already taken (a ModuleList of experts inside a block stays in its
    block). So a decoder-only model has one stack, as before; an encoder-decoder (T5, Whisper)
    or a two-tower model (CLIP) has two. Only without any stack does the largest container of
    any kind serve (an MLP's Sequential), alone."""
    total = sum(p.numel() for p in model.parameters())
    stacks: list[tuple[int, int, str]] = []
    mixed: tuple[int, int, str] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, _CONTAINERS):
            continue
        children = list(module.children())
        if len(children) < 2:
            continue
        key = (sum(p.numel() for p in module.parameters()), len(children), name)
        if len({type(child) for child in children}) == 1:
            stacks.append(key)
        elif mixed is None or key[:2] > mixed[:2]:
            mixed = key
    if not stacks:
        return [mixed[2]] if mixed is not None else []
    order = {name: index for index, (_, _, name) in enumerate(stacks)}
    taken: list[str] = []
    for params, _, name in sorted(stacks, key=lambda key: (-key[0], -key[1], order[key[2]])):
        if taken and params < STACK_SHARE * total:
            break
        if not any(_nested(name, other) or _nested(other, name) for other in taken):
            taken.append(name)
    return sorted(taken, key=order.__getitem__)


def check_block_containers(model: nn.Module, names: list[str]) -> str | None:
    """Why ``names`` cannot be the model's stacks (for a one-paragraph error), or None."""
    containers = [n for n, m in model.named_modules() if isinstance(m, _CONTAINERS) and len(list(m.children())) >= 2]
    listed = ", ".join(containers[:12]) or "(none)"
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            module = None
        if module is None or name not in containers:
            what = "is not a module of the model" if module is None else \
                "is not a ModuleList/ModuleDict/Sequential of 2+ blocks"
            return f"{name} {what}; the model's containers are: {listed}"
    for index, name in enumerate(names):
        for other in names[:index]:
            if name == other:
                return f"{name} is named twice"
            if _nested(name, other) or _nested(other, name):
                inner, outer = (name, other) if _nested(name, other) else (other, name)
                return f"{inner} is inside {outer} (a stack's blocks cannot also be split into another stack's)"
    return None


def _nested(inner: str, outer: str) -> bool:
    """Whether module ``inner`` lies inside module ``outer`` (the root holds everything)."""
    return outer == "" and inner != "" or inner.startswith(outer + ".")


def layer_units(model: nn.Module, containers: list[str]) -> tuple[list[str], list[str]]:
    """(block FQNs, other unit FQNs): every stack's children, and the modules beside the paths
    from the root to the stacks (a module on one stack's path is never a unit of its own)."""
    if not containers:
        return [], [name for name, _ in model.named_children()]
    blocks = [_join(container, name) for container in containers
              for name, _ in model.get_submodule(container).named_children()]
    on_path = {".".join(container.split(".")[:depth]) for container in containers
               for depth in range(1, container.count(".") + 2)}
    others: list[str] = []
    for container in containers:
        path = container.split(".") if container else []
        for depth in range(len(path)):
            ancestor = ".".join(path[:depth])
            for name, _ in model.get_submodule(ancestor).named_children():
                unit = _join(ancestor, name)
                if unit not in on_path and unit not in others:
                    others.append(unit)
    return blocks, others


def group_layers(model: nn.Module, captured: CapturedStep, containers: list[str] | None = None) -> LayerGrouping:
    """Assign every op of the captured step to a layer and detect repeated layers.

    ``containers`` names the stacks (``plan.blocks``); by default they are detected."""
    containers = list(containers) if containers else find_block_containers(model)
    blocks, others = layer_units(model, containers)
    if not blocks and not others:
        return _single_layer(captured)
    units = sorted(blocks + others, key=len, reverse=True)  # longest prefix wins
    graph = captured.graph_module.graph

    node_layer: dict[str, str] = {}
    layer_of_seq_nr: dict[int, str] = {}
    pending: list[str] = []
    current: str | None = None
    for node in graph.nodes:
        if node.op not in ("call_function", "get_attr"):
            continue
        seq_nr = node.meta.get("seq_nr")
        if captured.node_phase[node.name] == BACKWARD:
            layer = layer_of_seq_nr.get(seq_nr, current)
            if layer is None:  # no forward op seen yet: it joins the first layer found, as forward ops do
                pending.append(node.name)
                continue
            node_layer[node.name] = layer
            current = layer
            continue
        unit = _unit_of(captured.node_module.get(node.name), units)
        if unit is None:
            if current is None:
                pending.append(node.name)
                continue
            unit = current
        if pending:
            node_layer.update(dict.fromkeys(pending, unit))
            pending.clear()
        node_layer[node.name] = unit
        current = unit
        if seq_nr is not None:
            layer_of_seq_nr.setdefault(seq_nr, unit)

    param_layer = _param_layers(captured, node_layer)
    with_params = {unit for unit in blocks + others if any(True for _ in model.get_submodule(unit).parameters())}
    node_layer, param_layer = _fold_parameterless(node_layer, param_layer, with_params, graph)
    order = list(dict.fromkeys(node_layer[n.name] for n in graph.nodes
                               if n.name in node_layer and captured.node_phase[n.name] != BACKWARD))
    repeat_of = _find_repeats(order, node_layer, param_layer, captured)
    block_set = set(blocks)
    first_run = {container: min((index for index, name in enumerate(order)
                                 if name in block_set and _nested(name, container)), default=len(order))
                 for container in containers}
    return LayerGrouping(containers=sorted(containers, key=first_run.__getitem__), layer_names=order,
                         block_names=[name for name in order if name in block_set],
                         node_layer=node_layer, param_layer=param_layer, repeat_of=repeat_of)


def _single_layer(captured: CapturedStep, name: str = "model") -> LayerGrouping:
    """A model without submodules is one layer."""
    nodes = [n.name for n in captured.graph_module.graph.nodes if n.op in ("call_function", "get_attr")]
    return LayerGrouping(containers=[], layer_names=[name], block_names=[],
                         node_layer=dict.fromkeys(nodes, name),
                         param_layer=dict.fromkeys(captured.param_names, name), repeat_of={})


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _unit_of(module: str | None, units: list[str]) -> str | None:
    if module is None:
        return None
    for unit in units:
        if inside(module, unit):
            return unit
    return None


def _param_layers(captured: CapturedStep, node_layer: dict[str, str]) -> dict[str, str]:
    """Each parameter belongs to the layer of the first forward op that reads it."""
    placeholders = [n for n in captured.graph_module.graph.nodes if n.op == "placeholder"]
    position = {node.name: index for index, node in enumerate(captured.graph_module.graph.nodes)}
    result: dict[str, str] = {}
    for name, node in zip(captured.param_names, placeholders):
        users = [u for u in node.users if u.name in node_layer and captured.node_phase[u.name] != BACKWARD]
        if users:
            result[name] = node_layer[min(users, key=lambda u: position[u.name]).name]
    return result


def _fold_parameterless(node_layer: dict[str, str], param_layer: dict[str, str], with_params: set[str],
                        graph: torch.fx.Graph) -> tuple[dict[str, str], dict[str, str]]:
    """Merge layers whose modules hold no parameters into the previous layer (or the next).

    A module with only tied parameters (a GPT-2 LM head) keeps its own layer."""
    order = list(dict.fromkeys(node_layer[n.name] for n in graph.nodes if n.name in node_layer))
    target: dict[str, str] = {}
    for index, layer in enumerate(order):
        if layer in with_params:
            continue
        kept = [o for o in order[:index] if o in with_params]
        following = [o for o in order[index + 1:] if o in with_params]
        if kept or following:
            target[layer] = kept[-1] if kept else following[0]
    if not target:
        return node_layer, param_layer
    return ({node: target.get(layer, layer) for node, layer in node_layer.items()},
            {param: target.get(layer, layer) for param, layer in param_layer.items()})


def _find_repeats(order: list[str], node_layer: dict[str, str], param_layer: dict[str, str],
                  captured: CapturedStep) -> dict[str, str]:
    """Layers with identical op sequences (forward and backward), shapes and parameters."""
    ops: dict[str, list[tuple[str, str, str]]] = {name: [] for name in order}
    for node in captured.graph_module.graph.nodes:
        layer = node_layer.get(node.name)
        if layer is not None:
            ops[layer].append((captured.node_phase[node.name], op_name(node.target),
                               _shape_signature(node.meta.get("val"))))
    params: dict[str, list[str]] = {name: [] for name in order}
    placeholders = [n for n in captured.graph_module.graph.nodes if n.op == "placeholder"]
    for name, node in zip(captured.param_names, placeholders):
        if name in param_layer:
            params[param_layer[name]].append(_shape_signature(node.meta.get("val")))
    first_with: dict[Any, str] = {}
    repeat_of: dict[str, str] = {}
    for name in order:
        signature = (tuple(ops[name]), tuple(Counter(params[name]).items()))
        if signature in first_with:
            repeat_of[name] = first_with[signature]
        else:
            first_with[signature] = name
    return repeat_of


def _shape_signature(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)}:{value.dtype}"
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_shape_signature(v) for v in value) + ")"
    return type(value).__name__

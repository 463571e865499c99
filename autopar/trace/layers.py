"""Group a captured step's nodes into layers, and find the blocks that repeat.

A *layer* is the unit pipeline stages are cut along. The model's *block container* is the
ModuleList / ModuleDict / Sequential of same-class children holding the most parameters
(`blocks` in our GPT, `model.layers` in Hugging Face Llama, `transformer.h` in nanoGPT); each
of its children is a layer. Every other
module beside the path from the root to that container (embeddings, final norm, LM head) is a
layer too, and a parameter-less one (rotary embedding tables) is folded into its neighbour.
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

from autopar.trace.capture import BACKWARD, CapturedStep
from autopar.trace.ops import op_name

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


@dataclass(frozen=True)
class LayerGrouping:
    """Result of grouping.

    Attributes:
        container: FQN of the block container, or None if the model has none.
        layer_names: layers in forward execution order.
        block_names: the subset of layer_names that are the container's children.
        node_layer: fx node name -> layer name, for every call_function / get_attr node.
        param_layer: parameter FQN -> layer whose ops first use it (tied weights: the first).
        repeat_of: layer name -> the earlier identical layer it repeats (absent if unique).
    """

    container: str | None
    layer_names: list[str]
    block_names: list[str]
    node_layer: dict[str, str]
    param_layer: dict[str, str]
    repeat_of: dict[str, str]


def find_block_container(model: nn.Module) -> str | None:
    """The container of repeated blocks holding the most parameters (ties: more children).

    A container whose children are all of one class (a ModuleList of decoder layers) is a
    stack of blocks; one of mixed children (nanoGPT's ``transformer = ModuleDict(wte, wpe, h,
    ln_f)``) is only a namespace, so its stack is looked for inside it. Only without any stack
    does the largest container of any kind serve."""
    best: tuple[bool, int, int] = (False, 0, 0)
    best_name = None
    for name, module in model.named_modules():
        if not isinstance(module, _CONTAINERS):
            continue
        children = list(module.children())
        if len(children) < 2:
            continue
        uniform = len({type(child) for child in children}) == 1
        params = sum(p.numel() for p in module.parameters())
        if (uniform, params, len(children)) > best:
            best, best_name = (uniform, params, len(children)), name
    return best_name


def check_block_container(model: nn.Module, name: str) -> str | None:
    """Why ``name`` cannot be the block container (for a one-paragraph error), or None."""
    containers = [n for n, m in model.named_modules() if isinstance(m, _CONTAINERS) and len(list(m.children())) >= 2]
    try:
        module = model.get_submodule(name)
    except AttributeError:
        module = None
    if module is None or name not in containers:
        what = "is not a module of the model" if module is None else "is not a ModuleList/ModuleDict/Sequential of 2+ blocks"
        return f"{name} {what}; the model's containers are: {', '.join(containers[:12]) or '(none)'}"
    return None


def layer_units(model: nn.Module, container: str | None) -> tuple[list[str], list[str]]:
    """(block FQNs, other unit FQNs): the container's children, and the modules beside the
    path from the root to the container."""
    if container is None:
        return [], [name for name, _ in model.named_children()]
    blocks = [_join(container, name) for name, _ in model.get_submodule(container).named_children()]
    others: list[str] = []
    path = container.split(".")
    for depth in range(len(path)):
        ancestor = ".".join(path[:depth])
        on_path = _join(ancestor, path[depth])
        for name, _ in model.get_submodule(ancestor).named_children():
            if _join(ancestor, name) != on_path:
                others.append(_join(ancestor, name))
    return blocks, others


def group_layers(model: nn.Module, captured: CapturedStep, container: str | None = None) -> LayerGrouping:
    """Assign every op of the captured step to a layer and detect repeated layers.

    ``container`` names the block container (``plan.blocks``); by default it is detected."""
    container = container or find_block_container(model)
    blocks, others = layer_units(model, container)
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
    return LayerGrouping(container=container, layer_names=order,
                         block_names=[name for name in order if name in set(blocks)],
                         node_layer=node_layer, param_layer=param_layer, repeat_of=repeat_of)


def _single_layer(captured: CapturedStep, name: str = "model") -> LayerGrouping:
    """A model without submodules is one layer."""
    nodes = [n.name for n in captured.graph_module.graph.nodes if n.op in ("call_function", "get_attr")]
    return LayerGrouping(container=None, layer_names=[name], block_names=[],
                         node_layer=dict.fromkeys(nodes, name),
                         param_layer=dict.fromkeys(captured.param_names, name), repeat_of={})


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _unit_of(module: str | None, units: list[str]) -> str | None:
    if module is None:
        return None
    for unit in units:
        if module == unit or module.startswith(unit + "."):
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

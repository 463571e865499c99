"""ModelProfile: what one training step of the model costs, per op and per layer.

Run commands:

    autopar profile examples/gpt.py model.layers=12 --out profile.json

Every number is read off the captured joint graph (autopar.trace): FLOPs from PyTorch's formulas
(autopar.trace.ops), bytes from the fake tensors' shapes and dtypes, and activation memory as the
storages that forward ops create and backward ops read (the tensors autograd saves). Byte and
FLOP counts are for the profiled micro-batch (`micro_batch_size` samples); the cost model scales
them to other micro-batch sizes and parallel splits.
"""
from __future__ import annotations

import dataclasses
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Iterator

import torch
from torch.utils._pytree import tree_flatten

from autopar.model_profile import (CoverageEntry, LayerProfile, ModelProfile, OpClass, OpClassCost,
                                          OpProfile)
from autopar.errors import TraceError
from autopar.data_dependent import concrete
from autopar.model_file import FakeBuild, ModelFile, build_fake_for
from autopar.trace import BACKWARD, FORWARD, CapturedStep, LayerGrouping, capture_training_step, group_layers
from autopar.trace.batch import batch_statistics
from autopar.trace.loss_tokens import token_mean_loss
from autopar.trace.experts import experts_inputs
from autopar.trace.fused_dropout import fuse_dropouts
from autopar.trace.layers import find_block_containers
from autopar.trace.ops import attention_is_causal, classify, flop_count, op_name
from autopar.trace.repeated_blocks import (NotExpandable, TraceSelection, expand, expand_mixers, full_input_names,
                                           narrowed, select_traced_blocks)
from autopar.trace.sequence import SequenceMixer, causal_mask_attention, position_blocker, sequence_mixers

# Mixed precision is traced the way FSDP2 (MixedPrecisionPolicy) and Megatron run it: parameters
# and activations in 16 bit, fp32 master weights and optimizer states kept by the optimizer
# (priced by the cost model from parameter counts).
PRECISION_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def profile_model(model_file: ModelFile, model_kwargs: dict[str, Any], micro_batch_size: int = 1,
                  precision: str = "fp32", blocks: list[str] | None = None,
                  trace_every_block: bool = False) -> ModelProfile:
    """Build the model on fake tensors, capture one training step and profile it.

    ``blocks`` (``plan.blocks``) names the stacks of blocks instead of detecting them. Runs of
    identical blocks are traced once (autopar.trace.repeated_blocks) unless ``trace_every_block``."""
    if precision not in PRECISION_DTYPES:
        from autopar.errors import ConfigError

        raise ConfigError(f"Unknown precision '{precision}'.", f"use one of {', '.join(PRECISION_DTYPES)}.")
    start = time.perf_counter()
    return build_fake_for(model_file, model_kwargs, micro_batch_size,
                          lambda build: _profile_built(model_file, build, model_kwargs, micro_batch_size, precision,
                                                       blocks, trace_every_block, start),
                          dtype=PRECISION_DTYPES[precision])


def _profile_built(model_file: ModelFile, build: FakeBuild, model_kwargs: dict[str, Any], micro_batch_size: int,
                   precision: str, blocks: list[str] | None, trace_every_block: bool, start: float) -> ModelProfile:
    containers = _pinned_containers(build.model, blocks)
    stacks = containers or find_block_containers(build.model)
    batch_leaves, _ = tree_flatten(build.batch)
    tokens = _tokens_per_sample(batch_leaves)
    traced = None if trace_every_block else _trace_repeated_blocks_once(model_file, build, stacks, tokens)
    traced = traced or _trace_whole(model_file, build, stacks, tokens)
    ops = traced.facts.ops
    layers = aggregate_layers(traced.facts, traced.grouping, build.model)
    params = list(build.model.named_parameters())
    buffers = list(build.model.named_buffers())
    profile = ModelProfile(
        model_name=model_file.name, model_path=str(model_file.path), model_sha256=model_file.sha256,
        model_kwargs=dict(model_kwargs), micro_batch_size=micro_batch_size,
        tokens_per_sample=tokens, precision=precision,
        param_count=sum(p.numel() for _, p in params),
        param_bytes=sum(_nbytes(p) for _, p in params),
        buffer_bytes=sum(_nbytes(b) for _, b in buffers),
        input_bytes=sum(_nbytes(t) for t in batch_leaves),
        flops_forward=sum(layer.flops_forward for layer in layers),
        flops_backward=sum(layer.flops_backward for layer in layers),
        activation_bytes=sum(op.saved_for_backward_bytes for op in ops),
        num_nodes=traced.num_nodes,
        seconds=round(time.perf_counter() - start, 3),
        block_containers=traced.grouping.containers, torch_version=torch.__version__,
        param_shapes={name: list(p.shape) for name, p in params},
        placeholders=traced.placeholders,
        layers=layers, coverage=coverage_report(ops), ops=ops,
        sequence_mixers=[m.describe() for m in traced.mixers],
        experts_inputs=experts_inputs(build.model), batch_mixer=traced.batch_mixer, token_loss=traced.token_loss,
        copied_blocks=traced.copied_blocks, data_dependent=build.data_dependent, real_values=build.real_values)
    if build.value_hints is None:
        return profile
    profile = concrete(profile)  # sizes that depend on values become numbers (guessed ones noted next)
    return dataclasses.replace(profile, estimated=build.value_hints.described())


@dataclass
class _Traced:
    """What profiling reads off a captured step (of the whole model, or expanded from the
    narrowed one)."""

    grouping: LayerGrouping
    facts: "GraphFacts"
    placeholders: dict[str, str]
    num_nodes: int
    mixers: list[SequenceMixer]
    batch_mixer: str | None
    token_loss: str | None
    copied_blocks: list[str] = field(default_factory=list)


def _trace_whole(model_file: ModelFile, build: Any, stacks: list[str], tokens: int | None) -> _Traced:
    captured = capture_training_step(model_file, build)
    grouping = group_layers(build.model, captured, stacks)
    causal = causal_mask_attention(captured, build.batch)
    return _Traced(grouping=grouping, facts=profile_ops(captured, grouping, causal),
                   placeholders=_placeholder_roles(captured), num_nodes=len(captured.graph_module.graph.nodes),
                   mixers=_mixers(captured, tokens, build.model, build.batch), batch_mixer=batch_statistics(captured),
                   token_loss=token_mean_loss(captured))


def _trace_repeated_blocks_once(model_file: ModelFile, build: Any, stacks: list[str],
                                tokens: int | None) -> _Traced | None:
    """The step traced with each run of identical blocks narrowed to three and the rest copied
    (autopar.trace.repeated_blocks); None where the model has no such run or its trace does not
    allow copying (the caller traces the whole model)."""
    selection = select_traced_blocks(build.model, stacks) if stacks else None
    if selection is None:
        return None
    try:
        with narrowed(build.model, selection):
            captured = capture_training_step(model_file, build)
            grouping = group_layers(build.model, captured, stacks)
            mixers = _mixers(captured, tokens, build.model, build.batch, selection)
        facts = profile_ops(captured, grouping, causal_mask_attention(captured, build.batch))
        traced_roles = _placeholder_roles(captured)
        batch_inputs = sum(role.startswith("input:") for role in traced_roles.values())
        full_roles = _input_roles([name for name, _ in build.model.named_parameters()],
                                  [name for name, _ in build.model.named_buffers()], batch_inputs)
        expansion = expand(selection, facts.ops, grouping, facts, captured.graph_module.graph, traced_roles, full_roles)
    except NotExpandable:
        return None
    except TraceError as err:
        if err.data_dependent:
            raise  # traced again with the batch's values (autopar.data_dependent), narrowed again
        return None
    full_grouping = LayerGrouping(containers=grouping.containers, layer_names=expansion.layer_names,
                                  block_names=expansion.block_names, node_layer={},
                                  param_layer=expansion.param_layer, repeat_of=expansion.repeat_of)
    full_facts = GraphFacts(ops=expansion.ops, saved_by_layer=expansion.saved_by_layer,
                            boundary_in=expansion.boundary_in, boundary_out=expansion.boundary_out)
    return _Traced(grouping=full_grouping, facts=full_facts,
                   placeholders=dict(zip(full_input_names(full_roles), full_roles)),
                   num_nodes=len(captured.graph_module.graph.nodes) + expansion.added_nodes,
                   mixers=mixers, batch_mixer=batch_statistics(captured), token_loss=token_mean_loss(captured),
                   copied_blocks=sorted(selection.left_out, key=expansion.layer_names.index))


def _mixers(captured: CapturedStep, tokens: int | None, model: torch.nn.Module, batch: Any,
            selection: TraceSelection | None = None) -> list[SequenceMixer]:
    """The sequence mixers (each copied block's too, under ``selection``), then what keeps the
    model from being given positions."""
    mixers = sequence_mixers(captured, tokens, model, batch)
    if selection is not None:
        mixers = expand_mixers(mixers, selection)
    blocker = position_blocker(captured, tokens, model)
    return mixers + ([blocker] if blocker else [])


@dataclass
class GraphFacts:
    """What profile_ops reads off the graph.

    Attributes:
        ops: one entry per call_function node, in graph order.
        saved_by_layer: bytes autograd keeps for each layer's backward. A saved tensor counts
            toward every layer whose backward reads it (the stage holding that layer holds it),
            so a block's own input is part of its activation memory, as in Megatron's formula.
        boundary_in / boundary_out: per layer, the forward tensors entering / leaving it
            (producer node -> bytes), i.e. what a pipeline stage boundary there would send.
    """

    ops: list[OpProfile]
    saved_by_layer: dict[str, int]
    boundary_in: dict[str, dict[str, int]]
    boundary_out: dict[str, dict[str, int]]


def profile_ops(captured: CapturedStep, grouping: LayerGrouping,
                causal_masked: AbstractSet[str] = frozenset()) -> GraphFacts:
    """Per-op FLOPs, bytes moved, new allocations and bytes saved for backward (``causal_masked``:
    the attention nodes whose mask is the causal one, `causal_mask_attention`)."""
    graph = captured.graph_module.graph
    producer: dict[int, str] = {}  # storage id -> node that allocated it
    storage_bytes: dict[int, int] = {}
    placeholder_storages: set[int] = set()
    for node in graph.nodes:
        for tensor in _tensors(node.meta.get("val")):
            key = _storage_key(tensor)
            if key not in producer:
                producer[key] = node.name
                storage_bytes[key] = tensor.untyped_storage().nbytes()
            if node.op == "placeholder":
                placeholder_storages.add(key)

    # Storages allocated in forward that backward reads are what autograd saves.
    saved_by_op: dict[str, int] = defaultdict(int)
    saved_by_layer: dict[str, int] = defaultdict(int)
    seen: set[int] = set()
    seen_in_layer: set[tuple[int, str]] = set()
    for node in graph.nodes:
        if captured.node_phase.get(node.name) != BACKWARD or node.op != "call_function":
            continue
        layer = grouping.node_layer[node.name]
        for arg in node.all_input_nodes:
            for tensor in _tensors(arg.meta.get("val")):
                key = _storage_key(tensor)
                owner = producer.get(key)
                if key in placeholder_storages or owner is None or captured.node_phase.get(owner) != FORWARD:
                    continue
                if key not in seen:
                    seen.add(key)
                    saved_by_op[owner] += storage_bytes[key]
                if (key, layer) not in seen_in_layer:
                    seen_in_layer.add((key, layer))
                    saved_by_layer[layer] += storage_bytes[key]

    ops: list[OpProfile] = []
    allocated: set[int] = set(placeholder_storages)
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        op_class = classify(node.target)
        outputs = list(_tensors(node.meta.get("val")))
        is_view = op_class == OpClass.VIEW
        new_storages = [t for t in outputs if _storage_key(t) not in allocated]
        allocated.update(_storage_key(t) for t in outputs)
        inputs = node.all_input_nodes
        flops = flop_count(node.target, *_arg_values(node), node.meta.get("val"))
        ops.append(OpProfile(
            name=node.name, target=op_name(node.target), op_class=op_class.value,
            phase=captured.node_phase[node.name], module=captured.node_module.get(node.name),
            layer=grouping.node_layer[node.name], flops=flops or 0,
            bytes_read=0 if is_view else sum(_nbytes(t) for arg in inputs for t in _tensors(arg.meta.get("val"))),
            bytes_written=0 if is_view else sum(_nbytes(t) for t in outputs),
            output_bytes=sum(t.untyped_storage().nbytes() for t in new_storages),
            saved_for_backward_bytes=saved_by_op.get(node.name, 0),
            inputs=[arg.name for arg in inputs],
            input_shapes=[list(t.shape) for arg in inputs for t in _tensors(arg.meta.get("val"))],
            output_shapes=[list(t.shape) for t in outputs],
            causal=op_class == OpClass.ATTENTION and (node.name in causal_masked
                                                      or attention_is_causal(node.target, *_arg_values(node)))))

    boundary_in: dict[str, dict[str, int]] = defaultdict(dict)
    boundary_out: dict[str, dict[str, int]] = defaultdict(dict)
    for node in graph.nodes:
        if node.op != "call_function" or captured.node_phase[node.name] != FORWARD:
            continue
        layer = grouping.node_layer[node.name]
        for arg in node.all_input_nodes:
            source = grouping.node_layer.get(arg.name)
            if arg.op != "call_function" or source is None or source == layer:
                continue
            size = sum(_nbytes(t) for t in _tensors(arg.meta.get("val")))
            boundary_in[layer][arg.name] = size
            boundary_out[source][arg.name] = size
    ops = fuse_dropouts(ops, saved_by_layer)
    return GraphFacts(ops=ops, saved_by_layer=dict(saved_by_layer), boundary_in=dict(boundary_in),
                      boundary_out=dict(boundary_out))


def aggregate_layers(facts: GraphFacts, grouping: LayerGrouping, model: torch.nn.Module) -> list[LayerProfile]:
    """Sum ops into layers."""
    params = dict(model.named_parameters())
    per_layer: dict[str, list[OpProfile]] = defaultdict(list)
    for op in facts.ops:
        per_layer[op.layer].append(op)
    layers = []
    for index, name in enumerate(grouping.layer_names):
        layer_ops = per_layer[name]
        names = [p for p, layer in grouping.param_layer.items() if layer == name]
        layers.append(LayerProfile(
            name=name, index=index, is_block=name in grouping.block_names,
            repeat_of=grouping.repeat_of.get(name),
            param_count=sum(params[p].numel() for p in names),
            param_bytes=sum(_nbytes(params[p]) for p in names),
            flops_forward=sum(op.flops for op in layer_ops if op.phase == FORWARD),
            flops_backward=sum(op.flops for op in layer_ops if op.phase == BACKWARD),
            bytes_forward=sum(op.bytes_read + op.bytes_written for op in layer_ops if op.phase == FORWARD),
            bytes_backward=sum(op.bytes_read + op.bytes_written for op in layer_ops if op.phase == BACKWARD),
            activation_bytes=facts.saved_by_layer.get(name, 0),
            input_bytes=sum(facts.boundary_in.get(name, {}).values()),
            output_bytes=sum(facts.boundary_out.get(name, {}).values()),
            num_ops=len(layer_ops),
            forward_by_class=_by_class(op for op in layer_ops if op.phase == FORWARD),
            backward_by_class=_by_class(op for op in layer_ops if op.phase == BACKWARD),
            param_names=names))
    return layers


def coverage_report(ops: list[OpProfile]) -> list[CoverageEntry]:
    """Ops without a FLOP formula, how often they occur, and how the cost model prices them."""
    how = {OpClass.VIEW: "free (aliasing view)", OpClass.OTHER: "UNKNOWN: no formula, no class"}
    counts = Counter((op.target, op.op_class) for op in ops
                     if op.flops == 0 and op.op_class not in (OpClass.GEMM, OpClass.ATTENTION))
    return [CoverageEntry(op=target, op_class=op_class, count=count,
                          costed_by=how.get(OpClass(op_class), "bytes moved (memory-bound roofline)"))
            for (target, op_class), count in sorted(counts.items(), key=lambda item: (-item[1], item[0]))]


def _placeholder_roles(captured: CapturedStep) -> dict[str, str]:
    """Graph input name -> 'param:<fqn>', 'buffer:<fqn>' or 'input:<index>' (batch tensors)."""
    names = [n.name for n in captured.graph_module.graph.nodes if n.op == "placeholder"]
    inputs = len(names) - len(captured.param_names) - len(captured.buffer_names)
    return dict(zip(names, _input_roles(captured.param_names, captured.buffer_names, inputs)))


def _input_roles(param_names: list[str], buffer_names: list[str], batch_inputs: int) -> list[str]:
    """The graph inputs' roles in their order: parameters, buffers, then the batch's tensors."""
    return ([f"param:{p}" for p in param_names] + [f"buffer:{b}" for b in buffer_names]
            + [f"input:{i}" for i in range(batch_inputs)])


def _by_class(ops: Iterator[OpProfile]) -> dict[str, OpClassCost]:
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for op in ops:
        entry = totals[op.op_class]
        entry[0] += op.flops
        entry[1] += op.bytes_read + op.bytes_written
        entry[2] += 1
    return {name: OpClassCost(*values) for name, values in sorted(totals.items())}


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _arg_values(node: torch.fx.Node) -> tuple[tuple, dict]:
    """The node's args and kwargs with fx nodes replaced by their fake values."""
    def value(arg: Any) -> Any:
        return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg
    args = torch.fx.node.map_aggregate(node.args, value)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, value)
    return tuple(args), dict(kwargs)


def _pinned_containers(model: torch.nn.Module, blocks: list[str] | None) -> list[str] | None:
    """The stacks plan.blocks names, checked before tracing."""
    from autopar.errors import ConfigError
    from autopar.trace.layers import check_block_containers

    if not blocks:
        return None
    problem = check_block_containers(model, list(blocks))
    if problem:
        raise ConfigError(f"plan.blocks: {problem}.", "name the containers of the model's blocks, e.g. "
                          "plan.blocks=[encoder.block,decoder.block], or drop plan.blocks to let autopar find "
                          "them.")
    return list(blocks)


def _tokens_per_sample(leaves: list[torch.Tensor]) -> int | None:
    """Sequence length of the first integer (token id) input with a sequence dimension."""
    for tensor in leaves:
        if not tensor.dtype.is_floating_point and tensor.dim() >= 2:
            return int(tensor.shape[1])
    return None

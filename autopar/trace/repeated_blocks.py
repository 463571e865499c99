"""Trace a stack's identical blocks once, not a hundred times.

Tracing dominates planning at frontier scale: Llama-3-405B's 126 decoder layers are 29,000 ops
that make_fx dispatches one by one on fake tensors, for 126 copies of the same layer. So before
tracing, each stack's blocks are compared by structure (`block_signature`: every submodule's class,
its parameters' and buffers' names, shapes, dtypes and trainability, and its plain attributes,
with an attribute holding the block's own position left out, as Hugging Face's ``layer_idx``).
In every run of four or more consecutive identical blocks only the first, the second and the last
are traced (`TraceSelection`); the stack's container is narrowed to them while tracing
(`narrowed`), keeping their names.

What the trace shows is then checked before anything is copied: the three traced blocks must be
repeats of each other op by op (forward and backward, shapes and parameters, the test
``autopar.trace.layers`` already applies), each block's ops must sit in one stretch of the graph
per phase, and nothing but its neighbours may read the second block's values. Then the second
block's ops, with its forward stretch and its backward stretch, are copied once per left-out
block, named and wired as a full trace names and wires them (`expand`): a copy reads its
predecessor's outputs and its successor's gradients. Where any check fails, the whole model is
traced (`autopar.profile.profile_model` falls back).

What this cannot see: a middle block that computes differently from the three traced ones
without any attribute showing it. A condition on the index attribute in the block's own classes
keeps that attribute in the comparison (`index_attributes`), so those blocks differ and are all
traced; a branch hidden elsewhere (a helper function handed the index) is what
``plan.trace_every_block=true`` is for. tests/unit/test_repeated_blocks.py compares the expanded
profile with a full trace, field by field.
"""
from __future__ import annotations

import ast
import contextlib
import inspect
import textwrap
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, replace
from typing import Any, Iterator

import torch
from torch import nn

from autopar.model_profile import inside, renamed
from autopar.trace.layers import _join

# Runs shorter than this are traced whole: eliding one block saves little and the three traced
# blocks (first, second, last) are needed to check the run.
MIN_RUN = 4
_PLAIN = (int, float, str, bool, type(None))


class NotExpandable(Exception):
    """The traced blocks do not allow copying (the full model is traced instead)."""


@dataclass(frozen=True)
class BlockRun:
    """Consecutive identical blocks of one stack.

    Attributes:
        container: FQN of the stack.
        blocks: FQNs of every block of the run, in order.
    """

    container: str
    blocks: tuple[str, ...]

    @property
    def first(self) -> str:
        return self.blocks[0]

    @property
    def second(self) -> str:
        """The block whose ops the left-out ones copy (its predecessor is a block of the run)."""
        return self.blocks[1]

    @property
    def last(self) -> str:
        return self.blocks[-1]

    @property
    def left_out(self) -> tuple[str, ...]:
        return self.blocks[2:-1]


@dataclass(frozen=True)
class TraceSelection:
    """The runs whose middle blocks are not traced, per stack."""

    runs: tuple[BlockRun, ...]

    @property
    def left_out(self) -> set[str]:
        return {block for run in self.runs for block in run.left_out}


def block_signature(block: nn.Module, ignored: frozenset = frozenset()) -> tuple:
    """What makes two blocks of a stack trace alike: each submodule's class and plain
    attributes (but the ``ignored`` (submodule, attribute) pairs), and its own parameters' and
    buffers' names, shapes, dtypes and trainability."""
    parts = []
    for name, module in block.named_modules():
        attributes = tuple(sorted((key, value) for key, value in vars(module).items()
                                  if not key.startswith("_") and _plain(value) and (name, key) not in ignored))
        tensors = tuple((key, tuple(t.shape), t.dtype, t.requires_grad)
                        for key, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
                        if t is not None)
        parts.append((name, type(module).__qualname__, attributes, tensors))
    return tuple(parts)


def index_attributes(blocks: list[nn.Module]) -> frozenset:
    """(submodule, attribute) pairs holding each block's own position in its stack, 0- or
    1-based, in every block (Hugging Face's ``layer_idx``), which the block's code never branches
    on: they differ by design and are left out of the comparison. One the class's source tests
    (``if self.layer_idx == 3``) makes the blocks differ."""
    def ints(block: nn.Module) -> dict[tuple[str, str], int]:
        return {(name, key): value for name, module in block.named_modules() for key, value in vars(module).items()
                if type(value) is int and not key.startswith("_")}
    found = [ints(block) for block in blocks]
    indices = [pair for pair in found[0]
               if any(all(values.get(pair) == position + base for position, values in enumerate(found))
                      for base in (0, 1))]
    return frozenset(pair for pair in indices
                     if not _branches_on(type(blocks[0].get_submodule(pair[0])), pair[1]))


def _branches_on(cls: type, attribute: str) -> bool:
    """Whether the class's code (its own and its bases' below torch's) reads ``self.<attribute>``
    in a condition, or its source cannot be read (assumed to). An index into a key/value cache
    (``cache.layers[self.layer_idx]``) is not a condition: training runs without one."""
    for klass in cls.__mro__:
        if klass in (nn.Module, object) or klass.__module__.startswith("torch."):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            return True
        for node in ast.walk(tree):
            tested = (node.test if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)) else
                      node if isinstance(node, (ast.Compare, ast.BoolOp)) else None)
            if tested is not None and any(isinstance(inner, ast.Attribute) and inner.attr == attribute
                                          and isinstance(inner.value, ast.Name) and inner.value.id == "self"
                                          for inner in ast.walk(tested)):
                return True
    return False


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(item) for item in value)
    return isinstance(value, _PLAIN)


def select_traced_blocks(model: nn.Module, containers: list[str]) -> TraceSelection | None:
    """Runs of `MIN_RUN` or more identical consecutive blocks in the stacks (None: none)."""
    runs = []
    for container in containers:
        children = list(model.get_submodule(container).named_children())
        ignored = index_attributes([child for _, child in children])
        signatures = [block_signature(child, ignored) for _, child in children]
        start = 0
        for index in range(1, len(children) + 1):
            if index < len(children) and signatures[index] == signatures[start]:
                continue
            if index - start >= MIN_RUN:
                runs.append(BlockRun(container, tuple(_join(container, name) for name, _ in children[start:index])))
            start = index
    return TraceSelection(tuple(runs)) if runs else None


@contextlib.contextmanager
def narrowed(model: nn.Module, selection: TraceSelection) -> Iterator[None]:
    """The stacks hold only their traced blocks, under their own names, while the context is
    open (iteration and slicing of a ModuleList, ModuleDict or Sequential see them alone)."""
    left_out = selection.left_out
    saved: list[tuple[nn.Module, dict[str, nn.Module | None]]] = []
    try:
        for container in dict.fromkeys(run.container for run in selection.runs):
            module = model.get_submodule(container)
            saved.append((module, module._modules))
            module._modules = OrderedDict((key, child) for key, child in module._modules.items()
                                          if _join(container, key) not in left_out)
        yield
    finally:
        for module, modules in saved:
            module._modules = modules


def expand_mixers(mixers: list, selection: TraceSelection) -> list:
    """The sequence mixers a full trace lists (one per module and reason, in graph order): the
    second block's, again for each left-out block after it."""
    own = {run: [m for m in mixers if inside(m.module, run.second)] for run in selection.runs}
    expanded = []
    for mixer in mixers:
        expanded.append(mixer)
        for run, seconds in own.items():
            if seconds and mixer is seconds[-1]:
                expanded.extend(replace(m, module=renamed(m.module, run.second, block))
                                for block in run.left_out for m in seconds)
    return expanded


@dataclass(frozen=True)
class _Stretch:
    """Where a block's ops sit in the traced op list: [start, stop) per phase."""

    forward: range
    backward: range

    @property
    def positions(self) -> tuple[int, ...]:
        return (*self.forward, *self.backward)


@dataclass
class Expansion:
    """The full model's ops and grouping, from the narrowed trace.

    Attributes:
        ops: every op of the full step, in the order a full trace lists them, named as it names
            them.
        layer_names, block_names, param_layer, repeat_of: the full model's layer grouping.
        saved_by_layer, boundary_in, boundary_out: the full model's graph facts.
        added_nodes: graph nodes the full trace has beyond the narrowed one.
    """

    ops: list
    layer_names: list[str]
    block_names: list[str]
    param_layer: dict[str, str]
    repeat_of: dict[str, str]
    saved_by_layer: dict[str, int]
    boundary_in: dict[str, dict[str, int]]
    boundary_out: dict[str, dict[str, int]]
    added_nodes: int


Key = tuple[Any, str]  # (None, traced op) or ((run index, copy number), traced op of the second block)
FULL_INPUT = "full input"  # a Key's tag for an input already named as in the full graph


@dataclass
class _RunCopies:
    """How one run's left-out blocks copy its second block."""

    number: int
    run: BlockRun
    second: _Stretch
    inside: set[str]                 # the second block's ops
    from_first: dict[str, str]       # first block's forward op -> the second's at the same place
    from_last: dict[str, str]        # last block's backward op -> the second's at the same place
    forbidden: set[str]              # ops a copy cannot read (the first's backward, the last's forward)

    @property
    def count(self) -> int:
        return len(self.run.left_out)

    def copy_input(self, j: int, name: str) -> Key:
        """What copy ``j`` (1-based) reads where the second block reads ``name``: its own op, its
        predecessor's output (the second block for j = 1), its successor's gradient (the last
        block for the last copy), or the same value outside the run."""
        if name in self.inside:
            return (self.number, j), name
        if name in self.from_first:
            return (None if j == 1 else (self.number, j - 1)), self.from_first[name]
        if name in self.from_last:
            return (None, name) if j == self.count else ((self.number, j + 1), self.from_last[name])
        if name in self.forbidden:
            raise NotExpandable(f"{self.run.second} reads {name} of a block that is not its neighbour in that phase")
        return None, name


def expand(selection: TraceSelection, ops: list, grouping: Any, facts: Any, graph: torch.fx.Graph,
           traced_roles: dict[str, str], full_roles: list[str]) -> Expansion:
    """The profile facts of the full model from the narrowed trace (module docstring); raises
    NotExpandable where a check fails.

    Args:
        ops: the narrowed trace's OpProfiles, in graph order.
        grouping, facts: its LayerGrouping and GraphFacts.
        graph: its fx graph (node targets, to name the copies as fx names them).
        traced_roles: its input names -> roles ('param:<fqn>', 'buffer:<fqn>', 'input:<i>').
        full_roles: the full model's input roles, in input order.
    """
    stretches = _stretches(ops, grouping.layer_names)
    constants = {node.name for node in graph.nodes if node.op == "get_attr"}
    runs = [_run_copies(number, run, ops, grouping, stretches, constants)
            for number, run in enumerate(selection.runs)]
    full_name_of_role = dict(zip(full_roles, full_input_names(full_roles)))
    inputs = _full_input_names(traced_roles, full_name_of_role)

    def own_input(key: Key, second: str, block: str) -> Key:
        """A copy reads its own block's parameters and buffers where the second block reads its."""
        role = traced_roles.get(key[1])
        if key[0] is not None or role is None or role.startswith("input:"):
            return key
        kind, _, fqn = role.partition(":")
        own = renamed(fqn, second, block)
        if own == fqn:
            return key
        if f"{kind}:{own}" not in full_name_of_role:
            raise NotExpandable(f"{block} has no {own} (shared with another block?)")
        return FULL_INPUT, full_name_of_role[f"{kind}:{own}"]

    # Where the copies go: forward after the second block's forward, in order; backward before
    # the second block's backward, in reverse.
    after: dict[int, list[Key]] = defaultdict(list)
    before: dict[int, list[Key]] = defaultdict(list)
    copied: dict[Key, tuple[Any, str, str, list[Key]]] = {}
    for copies in runs:
        second = copies.run.second
        for j, block in enumerate(copies.run.left_out, start=1):
            def copy(position: int) -> Key:
                op = ops[position]
                key = ((copies.number, j), op.name)
                copied[key] = (op, block, second, [own_input(copies.copy_input(j, name), second, block)
                                                   for name in op.inputs])
                return key
            after[copies.second.forward.stop].extend(copy(position) for position in copies.second.forward)
            before[copies.second.backward.start][:0] = [copy(position) for position in copies.second.backward]
    rewired = _rewired_inputs(runs, ops, stretches)

    order: list[Key] = []
    for position, op in enumerate(ops):
        order.extend(before.get(position, ()))
        order.append((None, op.name))
        order.extend(after.get(position + 1, ()))
    names = _fx_names(order, graph, sorted(set(inputs.values()), key=_input_order))

    def name_of(key: Key) -> str:
        if key[0] == FULL_INPUT:
            return key[1]
        return names[key] if key in names else inputs.get(key[1], key[1])

    by_name = {op.name: op for op in ops}
    full_ops = []
    for key in order:
        if key[0] is None:
            op = by_name[key[1]]
            keys = [rewired.get((op.name, name), (None, name)) for name in op.inputs]
            full_ops.append(replace(op, name=names[key], inputs=[name_of(k) for k in keys]))
        else:
            op, block, second, keys = copied[key]
            full_ops.append(replace(op, name=names[key], inputs=[name_of(k) for k in keys],
                                    module=renamed(op.module, second, block), layer=renamed(op.layer, second, block)))
    return _full_grouping(runs, grouping, facts, full_ops, name_of,
                          added_nodes=len(order) - len(ops) + len(full_roles) - len(traced_roles))


def _run_copies(number: int, run: BlockRun, ops: list, grouping: Any, stretches: dict[str, _Stretch],
                constants: set[str]) -> _RunCopies:
    """Check that a run's traced blocks allow copying its second block, and how copies read."""
    kind = grouping.repeat_of.get(run.first, run.first)
    if any(grouping.repeat_of.get(name, name) != kind for name in (run.second, run.last)):
        raise NotExpandable(f"{run.first}, {run.second} and {run.last} do not trace alike")
    order = grouping.layer_names
    at = order.index(run.second)
    if order[at - 1] != run.first or order[at + 1] != run.last:
        raise NotExpandable(f"{run.second} does not run between {run.first} and {run.last}")
    missing = [name for name in (run.first, run.second, run.last) if name not in stretches]
    if missing:
        raise NotExpandable(f"{missing[0]} has no forward or no backward of its own")
    first, second, last = (stretches[name] for name in (run.first, run.second, run.last))
    inside = {ops[position].name for position in second.positions}
    if any(name in constants for position in second.positions for name in ops[position].inputs):
        raise NotExpandable(f"{run.second} reads a constant a full trace would make once per block")
    return _RunCopies(number=number, run=run, second=second, inside=inside,
                      from_first=_aligned(ops, first.forward, second.forward),
                      from_last=_aligned(ops, last.backward, second.backward),
                      forbidden={ops[position].name for position in (*first.backward, *last.forward)})


def _rewired_inputs(runs: list[_RunCopies], ops: list, stretches: dict[str, _Stretch]) -> dict[tuple[str, str], Key]:
    """(traced op, input) -> what it reads in the full model: the last block reads the last copy's
    outputs, the second block's backward the first copy's gradients. Any other reader of the
    second block's values (a loss over every block's output) would read every copy: refused."""
    rewired: dict[tuple[str, str], Key] = {}
    for copies in runs:
        run = copies.run
        last, first = stretches[run.last], stretches[run.first]
        may_read = set(copies.second.positions) | set(last.positions) | set(first.backward)
        second_forward = {ops[position].name for position in copies.second.forward}
        for position, op in enumerate(ops):
            read = [name for name in op.inputs if name in copies.inside]
            if read and position not in may_read:
                raise NotExpandable(f"{op.name} ({op.layer}) reads {run.second}'s values")
            if position in last.positions:
                for name in read:
                    if name not in second_forward:
                        raise NotExpandable(f"{op.name} reads {run.second}'s backward")
                    rewired[(op.name, name)] = ((copies.number, copies.count), name)
        for position in copies.second.backward:
            for name in ops[position].inputs:
                if name in copies.from_last:
                    rewired[(ops[position].name, name)] = ((copies.number, 1), copies.from_last[name])
    return rewired


def _stretches(ops: list, layer_order: list[str]) -> dict[str, _Stretch]:
    """Each layer's forward stretch (its first forward op up to the next layer's first) and
    backward stretch (its first backward op up to the next first backward op of any layer), for
    layers whose own ops all lie inside them."""
    first_at: dict[tuple[str, str], int] = {}
    for position, op in enumerate(ops):
        first_at.setdefault((op.layer, op.phase), position)
    starts = {phase: sorted(p for (_, ph), p in first_at.items() if ph == phase) for phase in ("forward", "backward")}
    end = len(ops)
    stretches = {}
    for name in layer_order:
        if (name, "forward") not in first_at or (name, "backward") not in first_at:
            continue
        forward_start, backward_start = first_at[(name, "forward")], first_at[(name, "backward")]
        forward_stop = next((p for p in starts["forward"] if p > forward_start), starts["backward"][0])
        backward_stop = next((p for p in starts["backward"] if p > backward_start), end)
        stretch = _Stretch(range(forward_start, forward_stop), range(backward_start, backward_stop))
        held = set(stretch.positions)
        if all(position in held for position, op in enumerate(ops) if op.layer == name):
            stretches[name] = stretch
    return stretches


def _aligned(ops: list, source: range, target: range) -> dict[str, str]:
    """Op of one stretch -> the op at the same place in another, where both hold the same ops."""
    if len(source) != len(target) or any(_same(ops[a]) != _same(ops[b]) for a, b in zip(source, target)):
        raise NotExpandable("the traced blocks' stretches differ")
    return {ops[a].name: ops[b].name for a, b in zip(source, target)}


def _same(op: Any) -> tuple:
    return (op.target, op.phase, op.flops, op.bytes_read, op.bytes_written, op.output_bytes,
            op.saved_for_backward_bytes, tuple(map(tuple, op.input_shapes)), tuple(map(tuple, op.output_shapes)))


def _full_input_names(traced: dict[str, str], full: dict[str, str]) -> dict[str, str]:
    """Traced input name -> the full graph's name for the same role (``full``: role -> name;
    make_fx names the flattened inputs ``params_<i>``, ``buffers_<i>``, ``batch_<i>``: checked on
    the traced graph)."""
    expected = full_input_names(list(traced.values()))
    names = {}
    for (name, role), named in zip(traced.items(), expected):
        if named != name or role not in full:
            raise NotExpandable(f"input {name} ({role}) is not named as expected")
        names[name] = full[role]
    return names


_INPUT_PREFIX = {"param": "params", "buffer": "buffers", "input": "batch"}


def full_input_names(roles: list[str]) -> list[str]:
    """The names a full trace gives inputs of these roles, in the same order (numbered from 1
    within each kind)."""
    counts: dict[str, int] = defaultdict(int)
    names = []
    for role in roles:
        kind = role.split(":", 1)[0]
        counts[kind] += 1
        names.append(f"{_INPUT_PREFIX[kind]}_{counts[kind]}")
    return names


def _input_order(name: str) -> tuple[int, int]:
    prefix, _, number = name.rpartition("_")
    return list(_INPUT_PREFIX.values()).index(prefix), int(number)


def _fx_names(order: list[Key], graph: torch.fx.Graph, inputs: list[str]) -> dict[Key, str]:
    """The names an fx graph gives these ops created in this order after these inputs, which are
    a full trace's names: asked of the namespace an fx graph names its nodes with (`Graph.create_node`
    asks it for every node), without building the nodes: tens of thousands at frontier scale."""
    nodes = {node.name: node for node in graph.nodes}
    names = torch.fx.Graph()._graph_namespace
    for name in inputs:
        names.create_name(name, None)
    for node in graph.nodes:
        if node.op == "get_attr":
            names.create_name(node.name, None)
    return {key: names.create_name(_candidate(nodes[key[1]]), None) for key in order}


def _candidate(node: torch.fx.Node) -> str:
    """The name make_fx asks for when it records a call (the op's packet name)."""
    packet = getattr(node.target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(node.target, "__name__", str(node.target))


def _full_grouping(runs: list[_RunCopies], grouping: Any, facts: Any, full_ops: list, name_of: Any,
                   added_nodes: int) -> Expansion:
    """Layers, parameters, repeats and graph facts of the full model."""
    after_second = {copies.run.second: copies.run.left_out for copies in runs}
    layer_names: list[str] = []
    for name in grouping.layer_names:
        layer_names.append(name)
        layer_names.extend(after_second.get(name, ()))
    param_layer, repeat_of = dict(grouping.param_layer), dict(grouping.repeat_of)
    saved = dict(facts.saved_by_layer)
    boundary_in = {layer: {name_of((None, k)): v for k, v in values.items()}
                   for layer, values in facts.boundary_in.items()}
    boundary_out = {layer: {name_of((None, k)): v for k, v in values.items()}
                    for layer, values in facts.boundary_out.items()}
    copies_of = set()
    for copies in runs:
        run = copies.run
        second_params = [param for param, layer in grouping.param_layer.items() if layer == run.second]
        for j, block in enumerate(run.left_out, start=1):
            copies_of.add(block)
            param_layer.update({renamed(param, run.second, block): block for param in second_params})
            repeat_of[block] = grouping.repeat_of.get(run.second, run.first)
            saved[block] = facts.saved_by_layer.get(run.second, 0)
            boundary_in[block] = {name_of(copies.copy_input(j, k)): v
                                  for k, v in facts.boundary_in.get(run.second, {}).items()}
            boundary_out[block] = {name_of(((copies.number, j), k)): v
                                   for k, v in facts.boundary_out.get(run.second, {}).items()}
        if copies.count:
            boundary_in[run.last] = {name_of(((copies.number, copies.count), k) if k in copies.inside else (None, k)): v
                                     for k, v in facts.boundary_in.get(run.last, {}).items()}
    blocks = set(grouping.block_names) | copies_of
    return Expansion(ops=full_ops, layer_names=layer_names, block_names=[n for n in layer_names if n in blocks],
                     param_layer=param_layer, repeat_of=repeat_of, saved_by_layer=saved,
                     boundary_in=boundary_in, boundary_out=boundary_out, added_nodes=added_nodes)

"""Tensor parallelism by propagation over the profiled forward graph.

Walk the forward ops in graph order, tracking for every tensor whether the t ranks of a TP
group hold it whole (replicated) or split along one dim (sharded, with that dim's index):

  GEMM with a weight (through views, from a 'param:' placeholder)
      activation replicated -> column-parallel: output sharded on its last dim, weight split;
                               backward all-reduces the input's gradient (Megatron's f).
      activation sharded on the contraction dim -> row-parallel: partial sums, all-reduced
                               (Megatron's g), output replicated.
  GEMM of two activations (scores, attention x values): sharded on a common batch/head dim
      stays sharded there.
  fused attention with q, k, v sharded on the head dim -> sharded outputs.
  element-wise, view, reductions and norms that keep the sharded dim -> sharded (a replicated
      operand is sliced locally, for free).
  norm over the sharded dim: with weights (LayerNorm) gather it first; without (the loss's
      log-softmax over a vocabulary-parallel output) all-reduce the row statistics.
  embedding looked up by graph inputs whose table's rows divide by t -> vocabulary-parallel:
      each rank looks up its rows, partial sums all-reduced.
  anything else meeting a sharded input gathers it.

This reproduces Megatron-LM's pairing (Shoeybi et al. 2019, §3: q/k/v and fc_in column,
out_proj and fc_out row, vocabulary-parallel embedding and output) without naming modules, and
gives per layer: which ops' work divides by t, which saved tensors are sharded, which parameters
are split, and the collectives (2 all-reduces forward and 2 backward of b·s·h per block).
Backward ops follow their module's forward sharding; backward ops of no module (the loss's,
gradient sums) are sharded when they read a sharded forward tensor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from cost_models.compute import LayerCompute, compute_dtype, compute_of_ops, ops_by_layer, op_roofline_s
from cost_models.hardware import GPUSpec
from cost_models.memory import LayerActivations, layer_activations
from cost_models.topology import GroupPlacement
from cost_models.tp_layout import ModuleTree, SPParts, sp_parts

if TYPE_CHECKING:
    from autopar.profile import ModelProfile

GATHER = -1  # a view result meaning "the sharding cannot follow; gather first"
ALL_REDUCE, ALL_GATHER = "all_reduce", "all_gather"
STATS_BYTES_PER_ROW = 2 * 4  # running max and sum of exponentials, fp32 (vocab-parallel cross-entropy)


@dataclass(frozen=True)
class TPLayerSplit:
    """A layer kind under tensor parallelism of degree t, at the profiled micro-batch.

    Attributes:
        compute: roofline and launches after sharding (sharded ops' work ÷ t).
        replicated_forward_s, replicated_backward_s: roofline seconds of ops TP leaves
            replicated.
        comm: (collective, bytes) per micro-batch, forward then backward.
        tp_sharded_activation_fraction: share of the saved bytes that TP shards.
        tp_sharded_param_fraction: share of the layer's parameters TP splits.
        styles: module FQN -> colwise | rowwise | vocab_parallel | sharded.
        activations: per-op activation accounting (None: use the fraction above).
        forward_comm: how many leading entries of `comm` are forward (None: half of them).
        sp: what sequence parallelism changes (`cost_models.tp_layout`): the replicated work
            that runs on the sequence slice and the collectives of the styles' boundaries.
    """

    compute: LayerCompute
    replicated_forward_s: float
    replicated_backward_s: float
    comm: tuple[tuple[str, float], ...]
    tp_sharded_activation_fraction: float
    tp_sharded_param_fraction: float
    styles: dict[str, str] = field(default_factory=dict)
    activations: LayerActivations | None = None
    forward_comm: int | None = None
    sp: SPParts = SPParts()
    comm_under_sp: tuple[tuple[str, float], ...] | None = None
    forward_comm_under_sp: int | None = None

    def collectives(self, sequence_parallel: bool) -> tuple[tuple[tuple[str, float], ...], int]:
        """(comm, how many of it lead in forward) as the styles issue them, with or without
        sequence parallelism (under it a split region gathers and reduce-scatters the sequence
        where it would all-reduce)."""
        if sequence_parallel and self.comm_under_sp is not None:
            return self.comm_under_sp, self.forward_comm_under_sp or 0
        return self.comm, len(self.comm) // 2 if self.forward_comm is None else self.forward_comm


class TPSplitter(Protocol):
    """Chooses and prices a layer's operator-wise TP split."""

    def split(self, layer_name: str, tp: int, group: GroupPlacement, gpu: GPUSpec) -> TPLayerSplit: ...


@dataclass
class TPSharding:
    """The propagation's result for the whole model at one degree.

    Attributes:
        tp: the degree.
        sharded_work: ops (forward and backward) whose FLOPs and bytes divide by t.
        sharded_outputs: forward ops whose (first) output is sharded.
        row_parallel: forward GEMMs whose output is a partial sum to all-reduce.
        comm: layer -> [(collective, bytes, phase)] at the profiled micro-batch.
        param_styles: parameter FQN -> style of the split.
        styles: module FQN -> style.
        column_inputs: forward ops whose outputs column-parallel GEMMs read (all-gathered and
            kept whole under sequence parallelism).
    """

    tp: int
    sharded_work: set[str] = field(default_factory=set)
    sharded_outputs: set[str] = field(default_factory=set)
    row_parallel: set[str] = field(default_factory=set)
    comm: dict[str, list[tuple[str, float, str]]] = field(default_factory=dict)
    param_styles: dict[str, str] = field(default_factory=dict)
    styles: dict[str, str] = field(default_factory=dict)
    column_inputs: set[str] = field(default_factory=set)


def propagate(profile: "ModelProfile", tp: int) -> TPSharding:
    """Shard the profiled model over a TP group of `tp` ranks."""
    if not profile.ops:
        raise ValueError("pricing tp > 1 needs the profile's per-op detail (profile saved with ops)")
    return _Propagation(profile, tp).run()


class _Propagation:
    def __init__(self, profile: "ModelProfile", tp: int):
        self.profile = profile
        self.tp = tp
        self.ops = {op.name: op for op in profile.ops}
        self.roles = profile.placeholders
        self.itemsize = 4 if profile.precision == "fp32" else 2
        self.state: dict[str, list[int | None]] = {}
        self.result = TPSharding(tp=tp)
        self._param_root: dict[str, str | None] = {}
        self._col_inputs: dict[str, tuple[str, float]] = {}  # activation root -> (layer, bytes)

    # -- graph helpers ----------------------------------------------------------------------

    def param_of(self, name: str) -> str | None:
        """FQN of the parameter a tensor is (through views), else None."""
        if name not in self._param_root:
            role = self.roles.get(name, "")
            op = self.ops.get(name)
            if role.startswith("param:"):
                self._param_root[name] = role[len("param:"):]
            elif op is not None and op.op_class == "view" and len(op.inputs) == 1 and op.phase == "forward":
                self._param_root[name] = self.param_of(op.inputs[0])
            else:
                self._param_root[name] = None
        return self._param_root[name]

    def from_graph_input(self, name: str) -> bool:
        if self.roles.get(name, "").startswith("input:"):
            return True
        op = self.ops.get(name)
        return op is not None and op.op_class == "view" and len(op.inputs) == 1 and self.from_graph_input(op.inputs[0])

    def root(self, name: str) -> str:
        """The tensor a view chain starts from."""
        op = self.ops.get(name)
        while op is not None and op.op_class == "view" and len(op.inputs) == 1:
            name, op = op.inputs[0], self.ops.get(op.inputs[0])
        return name

    def args(self, op: Any) -> list[tuple[str, list[int], int | None]]:
        """(input name, shape, state) per tensor input, aligning multi-output producers."""
        result, pos = [], 0
        for name in op.inputs:
            producer = self.ops.get(name)
            count = len(producer.output_shapes) if producer is not None else 1
            shapes = op.input_shapes[pos:pos + count]
            pos += count
            states = self.state.get(name, [None] * count)
            for i, shape in enumerate(shapes):
                result.append((name, shape, states[i] if i < len(states) else None))
        return result

    def nbytes(self, shape: list[int]) -> float:
        return float(math.prod(shape)) * self.itemsize

    def record(self, op: Any, collective: str, nbytes: float, phase: str = "forward") -> None:
        self.result.comm.setdefault(op.layer, []).append((collective, nbytes, phase))

    def gather(self, op: Any, args) -> None:
        for _, shape, state in args:
            if state is not None:
                self.record(op, ALL_GATHER, self.nbytes(shape))

    def set(self, op: Any, states: list[int | None], work: bool | None = None) -> None:
        self.state[op.name] = states
        if states and states[0] is not None:
            self.result.sharded_outputs.add(op.name)
        if work if work is not None else any(s is not None for s in states):
            self.result.sharded_work.add(op.name)

    def mark(self, param: str | None, module: str | None, style: str) -> None:
        if param is None:
            return
        self.result.param_styles.setdefault(param, style)
        owner = module or param.rsplit(".", 1)[0]
        self.result.styles.setdefault(owner, style)

    # -- propagation --------------------------------------------------------------------------

    def run(self) -> TPSharding:
        forward = [op for op in self.profile.ops if op.phase == "forward"]
        for op in forward:
            handler = getattr(self, f"on_{op.op_class}", self.on_other)
            handler(op)
        for layer, nbytes in self._col_inputs.values():  # Megatron's f: the input's gradient, summed
            self.result.comm.setdefault(layer, []).append((ALL_REDUCE, nbytes, "backward"))
        self.result.column_inputs = set(self._col_inputs)
        self._backward(forward)
        return self.result

    def on_view(self, op: Any) -> None:
        args = self.args(op)
        if op.target == "getitem" and args:
            producer = self.ops.get(op.inputs[0])
            states = self.state.get(op.inputs[0], [])
            shapes = producer.output_shapes if producer is not None else []
            pick = next((states[i] for i, shape in enumerate(shapes) if shape == (op.output_shapes or [None])[0]
                         and i < len(states)), None)
            self.set(op, [pick] * max(1, len(op.output_shapes)), work=False)
            return
        if not args:
            self.set(op, [None] * max(1, len(op.output_shapes)), work=False)
            return
        _, shape, state = args[0]
        states = [map_view(state, shape, out, self.tp, op.target) for out in op.output_shapes] or [None]
        if GATHER in states:
            self.gather(op, args[:1])
            states = [None] * len(states)
        self.set(op, states, work=False)

    def on_gemm(self, op: Any) -> None:
        args = self.args(op)
        target = op.target
        if "addmm" in target or "baddbmm" in target:
            bias, operands = args[0], args[1:3]
        else:
            bias, operands = None, args[:2]
        if len(operands) < 2 or not op.output_shapes:
            return self.on_other(op)
        (a_name, a_shape, a_state), (b_name, b_shape, b_state) = operands
        out = op.output_shapes[0]
        weight = self.param_of(b_name)
        if weight is not None and self.param_of(a_name) is None and len(a_shape) == 2:
            contraction = len(a_shape) - 1
            if a_state not in (None, contraction):
                self.gather(op, [operands[0]])
                a_state = None
            if a_state is None:
                if out[-1] % self.tp:
                    return self.set(op, [None], work=False)
                self.mark(weight, op.module, "colwise")
                if bias is not None:
                    self.mark(self.param_of(bias[0]), op.module, "colwise")
                self._col_inputs.setdefault(self.root(a_name), (op.layer, self.nbytes(a_shape)))
                return self.set(op, [len(out) - 1])
            self.mark(weight, op.module, "rowwise")
            self.result.row_parallel.add(op.name)
            self.record(op, ALL_REDUCE, self.nbytes(out))
            return self.set(op, [None], work=True)
        # Two activations (or an unusual weight position): batch/head sharding carries through.
        rank = len(out)
        if a_state is None and b_state is None:
            return self.set(op, [None], work=False)
        batch_dims = range(rank - 2)
        if a_state == b_state and a_state in batch_dims:
            return self.set(op, [a_state])
        if b_state is None and a_state is not None and a_state in (*batch_dims, rank - 2):
            return self.set(op, [a_state])
        if a_state is None and b_state is not None and b_state in (*batch_dims, rank - 1):
            return self.set(op, [b_state])
        if a_state == rank - 1 and b_state == rank - 2:
            self.record(op, ALL_REDUCE, self.nbytes(out))
            return self.set(op, [None], work=True)
        self.gather(op, operands)
        self.set(op, [None], work=False)

    def on_attention(self, op: Any) -> None:
        args = [arg for arg in self.args(op) if self.param_of(arg[0]) is None]
        qkv = args[:3]
        states = {state for _, _, state in qkv}
        if len(qkv) == 3 and len(states) == 1 and None not in states:
            dim = states.pop()
            if dim < len(qkv[0][1]) - 2:
                return self.set(op, [dim if len(shape) > dim else None for shape in op.output_shapes])
        self.gather(op, args)
        self.set(op, [None] * len(op.output_shapes), work=False)

    def on_elementwise(self, op: Any) -> None:
        if not op.output_shapes:
            return self.on_other(op)
        out = op.output_shapes[0]
        args = self.args(op)
        placed = {state + len(out) - len(shape) for _, shape, state in args if state is not None}
        if not placed:
            return self.set(op, [None] * len(op.output_shapes))
        if len(placed) == 1 and 0 <= (dim := placed.pop()) < len(out):
            for name, shape, _ in args:
                if self.param_of(name) is not None and shape and len(shape) > dim - len(out) + len(shape) >= 0:
                    self.mark(self.param_of(name), op.module, "sharded")
            return self.set(op, [dim] * len(op.output_shapes))
        self.gather(op, args)
        self.set(op, [None] * len(op.output_shapes), work=False)

    def on_norm(self, op: Any) -> None:
        args = self.args(op)
        activations = [arg for arg in args if self.param_of(arg[0]) is None]
        if not activations or activations[0][2] is None:
            return self.set(op, [None] * len(op.output_shapes))
        _, shape, dim = activations[0]
        if dim == len(shape) - 1:
            if len(activations) < len(args):  # has weights: gather the normalised dim
                self.gather(op, activations[:1])
                return self.set(op, [None] * len(op.output_shapes), work=False)
            rows = math.prod(shape[:-1])
            self.record(op, ALL_REDUCE, rows * STATS_BYTES_PER_ROW)
        self.set(op, [dim if len(out) == len(shape) and out[dim] == shape[dim] else None
                      for out in op.output_shapes], work=True)

    def on_reduction(self, op: Any) -> None:
        args = self.args(op)
        if not args or args[0][2] is None or not op.output_shapes:
            return self.set(op, [None] * max(1, len(op.output_shapes)))
        _, shape, dim = args[0]
        out = op.output_shapes[0]
        if dim < len(out) and out[dim] == shape[dim] and len(out) == len(shape):
            return self.set(op, [dim])
        self.record(op, ALL_REDUCE, self.nbytes(out))  # the sharded dim was reduced: partial sums
        self.set(op, [None], work=True)

    def on_memory(self, op: Any) -> None:
        args = self.args(op)
        if "embedding" in op.target and "backward" not in op.target and len(args) >= 2:
            table, indices = args[0], args[1]
            weight = self.param_of(table[0])
            if weight is not None and table[1] and table[1][0] % self.tp == 0 and self.from_graph_input(indices[0]):
                self.mark(weight, op.module, "vocab_parallel")
                for out in op.output_shapes:
                    self.record(op, ALL_REDUCE, self.nbytes(out))
                return self.set(op, [None] * len(op.output_shapes), work=True)
            return self.set(op, [None] * len(op.output_shapes))
        sharded = [(name, shape, state) for name, shape, state in args if state is not None]
        if not sharded:
            return self.set(op, [None] * len(op.output_shapes))
        _, shape, dim = sharded[0]
        if op.output_shapes and all(len(out) == len(shape) and out[dim] == shape[dim] for out in op.output_shapes):
            return self.set(op, [dim] * len(op.output_shapes))
        if op.output_shapes and math.prod(op.output_shapes[0]) < math.prod(shape):
            for out in op.output_shapes:  # e.g. the loss picking target logits: partial values
                self.record(op, ALL_REDUCE, self.nbytes(out))
            return self.set(op, [None] * len(op.output_shapes), work=True)
        self.gather(op, sharded)
        self.set(op, [None] * len(op.output_shapes), work=False)

    def on_other(self, op: Any) -> None:
        args = self.args(op)
        self.gather(op, args)
        self.set(op, [None] * max(1, len(op.output_shapes)), work=False)

    # -- backward -------------------------------------------------------------------------------

    def _backward(self, forward: list) -> None:
        votes: dict[str, list[int]] = {}
        for op in forward:
            if op.op_class == "view" or op.module is None:
                continue
            vote = votes.setdefault(op.module, [0, 0])
            vote[0 if op.name in self.result.sharded_work else 1] += 1
        sharded_modules = {module for module, (yes, no) in votes.items() if yes > no}
        for op in self.profile.ops:
            if op.phase != "backward" or op.op_class == "view":
                continue
            if op.module is not None:
                if op.module in sharded_modules:
                    self.result.sharded_work.add(op.name)
            elif any(self.root(name) in self.result.sharded_outputs for name in op.inputs):
                self.result.sharded_work.add(op.name)


def map_view(state: int | None, shape: list[int], out: list[int], tp: int, target: str = "") -> int | None:
    """Where a sharded dim goes through a view/reshape/transpose (GATHER if it cannot follow)."""
    if state is None:
        return None
    if list(shape) == list(out):
        return state
    if math.prod(shape) == math.prod(out):
        if len(shape) == len(out) and sorted(shape) == sorted(out):  # a permutation
            moved = [i for i in range(len(shape)) if shape[i] != out[i]]
            if state not in moved:
                return state
            return next(j for j in moved if out[j] == shape[state])
        outer = math.prod(shape[:state])
        inner_end = outer * shape[state]
        prefix = 1
        for j, size in enumerate(out):
            if prefix == outer and size != 1:  # the sharded dim starts output dim j (split or merge it leads)
                return j if size % tp == 0 or size >= shape[state] else GATHER
            if prefix < outer and inner_end <= prefix * size:  # inside a merged dim, strided
                return j
            prefix *= size
        return GATHER
    if state < len(out) and len(out) == len(shape) and out[state] == shape[state]:
        return state
    aligned = state + len(out) - len(shape)
    if 0 <= aligned < len(out) and out[aligned] == shape[state]:
        return aligned
    return GATHER


class PropagationSplitter:
    """TPSplitter from the propagation: the cost model's own operator-wise TP, no solver needed."""

    def __init__(self, profile: "ModelProfile"):
        self.profile = profile
        self.dtype = compute_dtype(profile.precision)
        self.ops_by_layer = ops_by_layer(profile) if profile.ops else {}
        self._runs: dict[int, TPSharding] = {}
        self._splits: dict[tuple, TPLayerSplit] = {}
        self.tree = ModuleTree.of_profile(profile) if profile.ops else None

    def sharding(self, tp: int) -> TPSharding:
        if tp not in self._runs:
            self._runs[tp] = propagate(self.profile, tp)
        return self._runs[tp]

    def split(self, layer_name: str, tp: int, group: GroupPlacement | None = None,
              gpu: GPUSpec | None = None) -> TPLayerSplit:
        """The layer's split at degree tp, priced on `gpu` (the group does not change it)."""
        key = (layer_name, tp, gpu.signature if gpu is not None else None)
        if key not in self._splits:
            self._splits[key] = self._split(layer_name, tp, gpu)
        return self._splits[key]

    def _split(self, layer_name: str, tp: int, gpu: GPUSpec | None) -> TPLayerSplit:
        run = self.sharding(tp)
        layer = self.profile.layer(layer_name)
        ops = [op for op in self.ops_by_layer.get(layer_name, []) if op.op_class != "view"]
        forward = [op for op in ops if op.phase == "forward"]
        backward = [op for op in ops if op.phase == "backward"]

        def seconds(selected, divide: bool) -> float:
            if gpu is None:
                return 0.0
            return sum(op_roofline_s(op, gpu, self.dtype) / (tp if divide and op.name in run.sharded_work else 1)
                       for op in selected)

        def replicated(selected) -> float:
            return seconds([op for op in selected if op.name not in run.sharded_work], False)

        compute = compute_of_ops(forward, backward, lambda selected: seconds(selected, True))
        comm = run.comm.get(layer_name, [])
        ordered = [(c, b) for c, b, phase in comm if phase == "forward"] + \
                  [(c, b) for c, b, phase in comm if phase == "backward"]
        acts = layer_activations(layer, forward, run.sharded_outputs, run.row_parallel, tp, run.column_inputs)
        params = {name: math.prod(self.profile.param_shapes.get(name, [0])) for name in layer.param_names}
        split_params = sum(count for name, count in params.items() if name in run.param_styles)
        modules = {op.module for op in forward}
        styles = {module: style for module, style in run.styles.items() if module in modules}
        sp = sp_parts(self.profile, self.tree, layer_name, styles,
                      [op for op in forward if op.name not in run.sharded_work],
                      [op for op in backward if op.name not in run.sharded_work],
                      lambda op: op_roofline_s(op, gpu, self.dtype) if gpu is not None else 0.0)
        return TPLayerSplit(
            compute=compute, replicated_forward_s=replicated(forward), replicated_backward_s=replicated(backward),
            comm=tuple(ordered),
            tp_sharded_activation_fraction=acts.saved_sharded_bytes / acts.saved_bytes if acts.saved_bytes else 0.0,
            tp_sharded_param_fraction=split_params / layer.param_count if layer.param_count else 0.0,
            styles=styles, activations=acts, forward_comm=sum(1 for _, _, phase in comm if phase == "forward"), sp=sp)

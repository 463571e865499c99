"""Which traced ops mix positions along the sequence, i.e. would compute something else when
context parallelism gives each rank only a shard of every sequence.

Context parallelism (autopar/sections/context_parallel.py) shards every [batch, sequence]
input, feeds the model its tokens' global positions, and replaces
``F.scaled_dot_product_attention`` (causal or full, without another mask) by ring or Ulysses
attention. Everything else runs per rank on the local tokens, which is right for position-wise
ops (linear layers, norms, activations, a loss on already shifted targets) and wrong for any op
whose output at one position reads others:

- attention written out (``softmax(Q K^T)`` over the sequence: eager attention, T5's biased
  attention), which the replacement never sees;
- attention through ``scaled_dot_product_attention`` with a mask other than the causal one;
- a shift along the sequence (a slice or pad that turns S positions into S±1: Hugging Face's
  ``labels=`` shifted inside the model, done per shard, drops a target per rank boundary);
- cumulative ops (cumsum, cumprod, ...) over activations along the sequence;
- positions numbered from the tokens: an integer cumulative op along the sequence whose result
  indexes an embedding (RoBERTa counts positions past its padding index, from padding_idx + 1),
  where CP would feed plain positions 0..S-1 instead; other integer cumulative ops are position
  bookkeeping CP replaces (a padding mask's, Hugging Face's packed-sequence check);
- reductions over the sequence that keep other dims (a per-sequence mean: pooling, a router's
  per-sequence load statistics, as a sequence-wise MoE auxiliary loss computes them), which a
  shard would take over its own tokens only; a reduction over every dim (a loss) is averaged
  over the shards like the loss, and one over the last dim (norms) reads one position;
- convolutions over the sequence (kernels wider than one position);
- recurrences: ``nn.RNN``/``LSTM``/``GRU`` (one fused ATen op, or a cell per step), whose state
  at one position carries every earlier one;
- the sequence cut into positions (``unbind``, ``select``, a ``split`` into pieces along it) of an
  activation: a loop over the positions (a scan written step by step) or one position read for
  the whole sequence (pooling the first or the last token), which a shard without that position
  cannot compute;
- ``nn.MultiheadAttention`` (torch.nn's Transformer layers): its attention kernel is called from
  C++, so the Python-level replacement does not reach it;
- positions numbered inside the model: without a position argument (POSITION_ARGUMENTS) in
  ``forward`` there is nothing to feed each shard's global positions through, and an ``arange``
  in the model would number every shard from 0 (``position_blocker``).

The analysis reads the ops' shapes on the traced forward: a dimension of the traced sequence
length S is taken for the sequence. A coincidental S-sized dimension can only make it refuse CP
for a model that could have had it (safe), never the reverse for the rules above.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._pytree import tree_flatten, tree_flatten_with_path

from autopar.model_profile import inside_any
from autopar.trace.capture import CapturedStep
from autopar.trace.ops import op_name, packet_of, schema_argument

_SOFTMAX = {"_softmax", "softmax", "_safe_softmax", "_log_softmax", "log_softmax"}
_CUMULATIVE = {"cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"}
_REDUCTIONS = {"sum", "mean", "amax", "amin", "prod", "var", "std", "var_mean", "std_mean", "logsumexp", "max", "min",
               "linalg_vector_norm"}
_SHIFTS = {"slice", "constant_pad_nd", "pad", "narrow", "roll"}
_RECURRENCES = {"lstm", "gru", "rnn_tanh", "rnn_relu", "mkldnn_rnn_layer", "_cudnn_rnn", "miopen_rnn",
                "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell",
                "rnn_relu_cell"}
_CUTS = {"unbind", "select", "split", "unsafe_split", "split_with_sizes", "unsafe_split_with_sizes"}
_MASK_ARGUMENTS = ("attn_mask", "attn_bias")  # what ATen's attention ops call the mask they take


PADDING_MASK_ARGUMENT = "attention_mask"  # Hugging Face's; CP fills it with ones where the batch has none
RECURRENCE = "a recurrence along the sequence (an RNN, LSTM or GRU)"
POSITION_ARGUMENTS = ("position_ids", "positions", "pos")  # Hugging Face, vLLM-style, nanoGPT-style
POSITION_ARGUMENT_NAMES = "/".join(POSITION_ARGUMENTS)  # as messages name them


def position_argument(model: torch.nn.Module) -> str | None:
    """The forward argument that takes token positions, if the model has one."""
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in POSITION_ARGUMENTS if name in parameters), None)


@dataclass(frozen=True)
class SequenceMixer:
    """One op that reads other positions of the sequence."""

    module: str | None  # FQN of the module that ran it ("": the root); None: outside the model (loss_fn)
    op: str  # "": no one op (the model as a whole)
    reason: str

    def describe(self) -> str:
        if not self.op:
            return self.reason
        where = (f"module '{self.module}'" if self.module else
                 "the root module's own forward" if self.module == "" else "the loss (outside the model)")
        return f"{self.reason} ({self.op} in {where})"


def sequence_mixers(captured: CapturedStep, seq_len: int | None, model: torch.nn.Module | None = None,
                    batch: Any = None) -> list[SequenceMixer]:
    """Forward ops that mix positions along a sequence of ``seq_len`` tokens, one per
    (module, reason) in graph order; empty when the step has no sequence. With ``model``,
    attention inside ``nn.MultiheadAttention`` counts too: it calls the attention kernel from
    C++, past the Python function CP replaces. With the traced ``batch``, an attention mask
    computed from positions and a padding mask is evaluated on the values CP feeds them."""
    if not seq_len or seq_len < 2:
        return []
    fed = cp_fed_inputs(captured, batch) if batch is not None else {}
    native = _native_attention_modules(model) if model is not None else set()
    recurrent = _recurrent_modules(model) if model is not None else set()
    found: dict[tuple[str | None, str], SequenceMixer] = {}
    for node in captured.forward_calls():
        name = op_name(node.target).split(".")[-1]
        if name in ("default", "int", "Tensor", "dim"):
            name = op_name(node.target).split(".")[-2]
        module = captured.node_module.get(node.name)
        # A softmax in the loss (outside the model) is over the vocabulary, never attention: a
        # vocabulary as large as the sequence must not look like S x S scores.
        if module is None and name in _SOFTMAX:
            continue
        reason = _mixing_reason(name, node, seq_len, fed)
        if reason is None and "scaled_dot_product" in name and inside_any(module, native):
            reason = "attention inside nn.MultiheadAttention, which context parallelism does not replace"
        if reason and inside_any(module, recurrent):
            reason = RECURRENCE  # a recurrent module's steps, whichever ops its kernel runs as
        if reason:
            found.setdefault((module, reason), SequenceMixer(module, name, reason))
    return list(found.values())


def _mixing_reason(name: str, node: torch.fx.Node, seq_len: int, fed: dict[str, torch.Tensor]) -> str | None:
    out = _value(node)
    args = [_value(a) if isinstance(a, torch.fx.Node) else a for a in node.args]
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if name in _RECURRENCES and first is not None and seq_len in first.shape:
        return RECURRENCE
    if name in _CUTS and first is not None and first.dtype.is_floating_point \
            and _cuts_sequence(name, args, first, seq_len):
        return "the sequence cut into positions (a loop over them, or one position read for the whole sequence)"
    if first is None or not isinstance(out, torch.Tensor):
        return _sdpa_mask_reason(node, args, seq_len, fed) if first is not None else None
    if name in _SOFTMAX:
        dim = _dim(args, 1, first)
        if first.dim() >= 2 and first.shape[-2] == seq_len \
                and (first.shape[dim] == seq_len or _scores_with_columns_beside(node, dim, seq_len)):
            return "attention computed outside scaled_dot_product_attention (a softmax over the sequence)"
    # Integer cumulative ops are position bookkeeping (positions from a padding mask, Hugging
    # Face's packed-sequence check), which CP replaces by feeding the global positions and a
    # full padding mask; a floating-point one accumulates activations (a scan).
    if name in _CUMULATIVE and first.dtype.is_floating_point:
        dim = _dim(args, 1, first)
        if first.shape[dim] == seq_len:
            return "a cumulative op along the sequence"
    if name in _CUMULATIVE and first.dim() >= 2 and first.shape[_dim(args, 1, first)] == seq_len \
            and _indexes_embedding(node):
        return ("positions numbered from the tokens (an integer cumulative op along the sequence that indexes an "
                "embedding, where context parallelism would feed plain positions 0..S-1)")
    if name in _REDUCTIONS and first.dtype.is_floating_point and _reduces_sequence(args, first, seq_len):
        return "a reduction over the sequence (a per-sequence statistic)"
    if name in _SHIFTS and first.dim() == out.dim():
        for d in range(first.dim()):
            if first.shape[d] == seq_len and out.shape[d] in (seq_len - 1, seq_len + 1):
                return "a shift along the sequence (e.g. labels shifted inside the model)"
        if name == "roll" and seq_len in first.shape:
            return "a shift along the sequence (roll)"
    if name == "convolution" and first.dim() == 3 and first.shape[-1] == seq_len:
        weight = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
        if weight is not None and weight.shape[-1] > 1:
            return "a convolution over the sequence"
    return _sdpa_mask_reason(node, args, seq_len, fed)


def _scores_with_columns_beside(softmax: torch.fx.Node, dim: int, seq_len: int, hops: int = 4) -> bool:
    """Whether a softmax's input is S x S scores with columns concatenated beside them along the
    softmax's dim (attention sinks: gpt-oss appends a learned logit per head, so the softmax runs
    over S + 1 entries), reached back through ops that keep its shape (the max subtracted first)."""
    current = softmax.args[0] if softmax.args and isinstance(softmax.args[0], torch.fx.Node) else None
    shape = tuple(_value(current).shape) if current is not None else ()
    for _ in range(hops):
        if current is None or current.op != "call_function":
            return False
        if packet_of(current.target) is torch.ops.aten.cat:
            parts = current.args[0] if current.args and isinstance(current.args[0], (list, tuple)) else []
            along = current.args[1] if len(current.args) > 1 and isinstance(current.args[1], int) else 0
            if along % len(shape) != dim % len(shape):
                return False
            values = [_value(part) for part in parts if isinstance(part, torch.fx.Node)]
            return any(isinstance(v, torch.Tensor) and v.dim() == len(shape) and v.shape[dim] == seq_len
                       and v.shape[-2] == seq_len for v in values)
        current = next((a for a in current.args if isinstance(a, torch.fx.Node)
                        and tuple(getattr(_value(a), "shape", ())) == shape), None)
    return False


def _cuts_sequence(name: str, args: list[Any], first: torch.Tensor, seq_len: int) -> bool:
    """Whether a cut op takes pieces of a dim of size S other than the last (features, which a
    fused projection splits): one position (``select``), every position (``unbind``), or pieces
    shorter than the sequence (``split``)."""
    if first.dim() < 2:
        return False
    splits = name.startswith(("split", "unsafe_split"))
    index = 2 if splits else 1  # select(self, dim, index), unbind(self, dim=0), split(self, sizes, dim=0)
    dim = args[index] if len(args) > index and isinstance(args[index], int) else 0
    dim %= first.dim()
    if first.shape[dim] != seq_len or dim == first.dim() - 1:
        return False
    if splits:
        sizes = args[1] if len(args) > 1 else None
        pieces = [sizes] if isinstance(sizes, int) else list(sizes) if isinstance(sizes, (list, tuple)) else []
        return bool(pieces) and all(isinstance(p, int) and p < seq_len for p in pieces)
    return True


def _indexes_embedding(node: torch.fx.Node, hops: int = 8) -> bool:
    """Whether ``node``'s value reaches the indices of an ``aten.embedding`` within ``hops`` ops
    (through the arithmetic that offsets and casts positions)."""
    frontier, seen = [node], {node}
    for _ in range(hops):
        following = []
        for current in frontier:
            for user in current.users:
                if user.op == "call_function" and "embedding" in op_name(user.target).split(".") \
                        and len(user.args) > 1 and user.args[1] is current:
                    return True
                if user not in seen:
                    seen.add(user)
                    following.append(user)
        frontier = following
    return False


def _reduces_sequence(args: list[Any], first: torch.Tensor, seq_len: int) -> bool:
    """Whether the op reduces a dim of size S other than the last, keeping some dims: its dim
    argument (an int or a list; absent or None: every dim, a scalar such as a loss)."""
    dims = args[1] if len(args) > 1 else None
    if dims is None or first.dim() < 2:
        return False
    dims = [dims] if isinstance(dims, int) else list(dims) if isinstance(dims, (list, tuple)) else []
    reduced = {d % first.dim() for d in dims if isinstance(d, int)}
    if not reduced or len(reduced) == first.dim():
        return False
    return any(first.shape[d] == seq_len and d != first.dim() - 1 for d in reduced)


def _sdpa_mask_reason(node: torch.fx.Node, args: list[Any], seq_len: int,
                      fed: dict[str, torch.Tensor]) -> str | None:
    mask_node = _mask_argument(node)
    mask = _value(mask_node) if mask_node is not None else None
    if mask_node is None or not isinstance(mask, torch.Tensor):
        return None
    query, key = args[0], args[1]
    # The one mask CP understands: causal over the local tokens (queries x keys, both S). A mask
    # computed from nothing but constants (Hugging Face builds its causal and sliding-window
    # masks from an arange) is evaluated: a window or any other pattern is found here, where the
    # generated attention would refuse it only once it runs.
    if tuple(mask.shape[-2:]) == (seq_len, seq_len) and query.shape[-2] == key.shape[-2] == seq_len:
        value = constant_value(mask_node, fed)
        if value is None or _is_causal(value):
            return None
        allowed = value if value.dtype == torch.bool else value == 0  # boolean, or additive with 0 where allowed
        if bool(allowed.all()):  # every query sees every key here: a padding mask read from the batch
            return ("attention with a mask built from the batch (a padding mask such as attention_mask), which "
                    "context parallelism's attention does not take")
        return "attention with a mask other than the causal one (a sliding window or local attention)"
    return "attention with a mask other than the causal one"


def _recurrent_modules(model: torch.nn.Module) -> set[str]:
    return {name for name, module in model.named_modules() if isinstance(module, torch.nn.RNNBase)}


_MOST_CONSTANT_NODES = 2000  # a mask's computation; more is not a mask built from an arange
# Planning allocates no large memory: a mask of more elements (S > 4096: 128k tokens would be a
# 64 GiB float mask) is not evaluated, and is taken for causal as before; the generated attention
# still refuses any other mask when it runs.
_MOST_CONSTANT_ELEMENTS = 2**24


def constant_value(node: torch.fx.Node, inputs: dict[str, torch.Tensor] | None = None,
                   most_elements: int = _MOST_CONSTANT_ELEMENTS) -> torch.Tensor | None:
    """The value of ``node`` when it is computed from constants and ``inputs`` (graph input name
    -> value) alone, by running those ops on real tensors; None when a parameter or any other
    graph input is among its ancestors, or a tensor on the way holds more than ``most_elements``."""
    inputs = inputs or {}
    ancestors: set[torch.fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in ancestors:
            continue
        known = current.op == "placeholder" and current.name in inputs
        if (current.op != "call_function" and not known) or len(ancestors) > _MOST_CONSTANT_NODES:
            return None
        if any(isinstance(value, torch.Tensor) and value.numel() > most_elements
               for value in tree_flatten(_value(current))[0]):
            return None
        ancestors.add(current)
        stack.extend(current.all_input_nodes)
    graph = torch.fx.Graph()
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    placeholders = []
    for current in node.graph.nodes:  # graph order is a topological order
        if current in ancestors:
            copies[current] = graph.node_copy(current, lambda n: copies[n])
            if current.op == "placeholder":
                placeholders.append(inputs[current.name])
    graph.output(copies[node])
    try:
        with unset_fake_temporarily():
            value = torch.fx.GraphModule(torch.nn.Module(), graph)(*placeholders)
    except Exception:  # noqa: BLE001 - an op that cannot run on real tensors here: no value, no verdict
        return None
    return value if isinstance(value, torch.Tensor) and not value.is_meta else None


# Pricing evaluates larger masks than the check above: a boolean mask of 2 x 8192 x 8192 tokens is
# 128 MiB; beyond 256 MiB a mask is priced as computing every key (the cost without skipping).
_MOST_PRICED_MASK_ELEMENTS = 2**28


def causal_mask_attention(captured: CapturedStep, batch: Any) -> set[str]:
    """Names of the attention nodes, forward and backward, whose mask is the causal one once
    computed from constants and the inputs a run without padding gives (positions 0..S-1, a
    padding mask of ones). A model library builds such a mask only while traced: run eagerly
    with no padding mask, Hugging Face's SDPA path passes ``is_causal`` instead, and the kernel
    skips the key blocks past each query block (`cost_models.compute` prices that)."""
    fed = cp_fed_inputs(captured, batch) if batch is not None else {}
    verdicts: dict[Any, bool] = {}  # by what computes the mask: each block's copy is judged once
    spelled: dict[torch.fx.Node, Any] = {}
    found = set()
    for node in captured.graph_module.graph.nodes:
        mask_node = _mask_argument(node)
        if mask_node is None:
            continue
        key = _computation(mask_node, spelled)
        if key not in verdicts:
            value = constant_value(mask_node, fed, _MOST_PRICED_MASK_ELEMENTS)
            verdicts[key] = value is not None and value.dim() >= 2 and value.shape[-1] == value.shape[-2] \
                and _is_causal(value)
        if verdicts[key]:
            found.add(node.name)
    return found


def _computation(node: torch.fx.Node, spelled: dict[torch.fx.Node, Any]) -> Any:
    """A hashable spelling of what computes ``node``: its op and arguments, its inputs spelled the
    same way down to the graph's inputs (by name) and parameters; equal spellings, equal values."""
    if node in spelled:
        return spelled[node]
    stack = [node]
    while stack:  # inputs first, without recursion (a mask's computation can be deep)
        current = stack[-1]
        pending = [n for n in current.all_input_nodes if n not in spelled]
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        if current.op != "call_function":
            spelled[current] = (current.op, current.name)
            continue

        def spell(value: Any) -> Any:
            if isinstance(value, torch.fx.Node):
                return spelled[value]
            if isinstance(value, (list, tuple)):
                return tuple(spell(item) for item in value)
            return repr(value)

        spelled[current] = (str(current.target), spell(current.args),
                            tuple(sorted((k, spell(v)) for k, v in current.kwargs.items())))
    return spelled[node]


def _mask_argument(node: torch.fx.Node) -> torch.fx.Node | None:
    """The mask node an attention op is given (its schema's attn_mask or attn_bias, by position or
    by keyword: the CPU flash kernel takes it only by keyword), None without one."""
    if node.op != "call_function" or "scaled_dot_product" not in op_name(node.target):
        return None
    _, mask = schema_argument(node.target, node.args, node.kwargs, _MASK_ARGUMENTS)
    return mask if isinstance(mask, torch.fx.Node) else None


def cp_fed_inputs(captured: CapturedStep, batch: Any) -> dict[str, torch.Tensor]:
    """Graph input name -> the value context parallelism gives it, for the batch's position
    argument (the global positions, 0..S-1 in every row) and padding mask (all ones where the
    batch has none: autopar/sections/context_parallel.py); the traced ``batch`` supplies names
    and shapes (its leaves are the graph's last inputs, in pytree order)."""
    leaves = tree_flatten_with_path(batch)[0]
    names = [n.name for n in captured.graph_module.graph.nodes if n.op == "placeholder"][-len(leaves):] \
        if leaves else []
    fed = {}
    with unset_fake_temporarily():
        for name, (path, leaf) in zip(names, leaves):
            key = getattr(path[-1], "key", None) if path else None
            if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
                continue
            if key in POSITION_ARGUMENTS:
                fed[name] = torch.arange(leaf.shape[-1], dtype=leaf.dtype).expand(tuple(leaf.shape)).clone()
            elif key == PADDING_MASK_ARGUMENT:
                fed[name] = torch.ones(tuple(leaf.shape), dtype=leaf.dtype)
    return fed


_CAUSAL_CHECK_ROWS = 256  # rows of a mask judged at a time: temporaries that stay in cache


def _is_causal(mask: torch.Tensor) -> bool:
    """Whether ``mask`` passes the generated attention's own test of a causal mask
    (`is_local_causal_mask`: boolean, or additive with 0 where allowed), and holds no finite
    non-zero entry (a bias, which that test would take for masked). Judged a few rows at a time:
    an 8192-token mask is 67M entries, and whole-mask temporaries made this check cost twice as long."""
    queries, keys = mask.shape[-2:]
    columns = torch.arange(keys)
    additive = mask.dtype != torch.bool
    masked_below = torch.finfo(mask.dtype).min / 2 if additive else None
    for matrix in mask.reshape(-1, queries, keys):
        for first in range(0, queries, _CAUSAL_CHECK_ROWS):
            rows = matrix[first:first + _CAUSAL_CHECK_ROWS]
            causal = columns <= torch.arange(first, first + rows.shape[0])[:, None]
            allowed = rows == 0 if additive else rows
            if not torch.equal(allowed, causal):
                return False
            if additive and not bool((allowed | (rows <= masked_below)).all()):
                return False  # an entry neither 0 nor masked: a bias
    return True


def _native_attention_modules(model: torch.nn.Module) -> set[str]:
    return {name for name, module in model.named_modules() if isinstance(module, torch.nn.MultiheadAttention)}


def _dim(args: list[Any], index: int, tensor: torch.Tensor) -> int:
    dim = args[index] if len(args) > index and isinstance(args[index], int) else -1
    return dim % tensor.dim() if tensor.dim() else 0


def _value(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def position_blocker(captured: CapturedStep, seq_len: int | None, model: torch.nn.Module) -> SequenceMixer | None:
    """Why the model cannot be given its tokens' global positions (None if it can): its forward has
    no position argument, so the generated code could not feed them (codegen refuses such a
    plan, autopar.codegen.generate.check_context_parallel); names the ``arange`` that numbers
    the sequence inside the model where there is one, and says so where the batch holds no
    sequence of tokens at all (then the planner refuses a pinned cp before it plans)."""
    if position_argument(model) is not None:
        return None
    if not seq_len or seq_len < 2:  # an image classifier's batch, say: nothing for cp to shard either
        return SequenceMixer("", "", f"no sequence of tokens in the batch to shard, and no {POSITION_ARGUMENT_NAMES} "
                                     "argument in forward")
    reason = f"no {POSITION_ARGUMENT_NAMES} argument in forward to give each sequence shard its global positions"
    for node in captured.forward_calls():
        if "arange" in op_name(node.target).split("."):
            out = _value(node)
            if isinstance(out, torch.Tensor) and out.dim() == 1 and out.shape[0] == seq_len:
                return SequenceMixer(captured.node_module.get(node.name), "arange", reason + ", and an arange over "
                                     "the sequence numbers every shard from 0")
    return SequenceMixer("", "", reason)

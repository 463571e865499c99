"""Fake tensors for code whose shapes or branches depend on tensor values.

A fake tensor has a shape but no values, so ``torch.nonzero``, boolean indexing,
``masked_select``, ``.item()`` and an ``if`` on a tensor stop an ordinary fake trace. Such code
is common where users cannot change it: Hugging Face's CTC heads check ``labels.max()`` and
``masked_select`` the labels, ELECTRA-style losses index by the attention mask, DBRX and many
hand-written mixtures of experts loop over ``nonzero(routing == expert)``.

Where that happens, the model is traced again in a fake mode with a shape environment, so such
sizes become symbols (torch's unbacked SymInts), and with torch's real-value propagation: the
example batch is made for real (it is small), so every value computed from the batch alone
(label counts, mask lengths, ``labels.max()``) is exact. The weights stay fake; a value that
depends on them (how many tokens an expert gets) has none, and is taken at the upper bound
torch proves for it (every token, for a ``nonzero``) — a guess that can only overstate time
and memory — or 0 where no bound exists. Each guess is recorded with the line of the user's
code that needed it, and the plan says what was estimated rather than traced. The compiled plan
is still proven by running it on real numbers, where every value is real.

Cost: real-value propagation runs the batch-only ops for real, and factory calls in forward
(``torch.ones(s, s)`` for a mask) allocate real memory; it is used only for models that need it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch._functorch.config as functorch_config
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
import torch.fx.experimental._config as _shapes_config
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

if TYPE_CHECKING:
    import sympy
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

# sympy and torch's symbolic shapes (about half a second to import) are imported where a fake
# mode with symbolic sizes is made or read, not with this module: planning from a kept profile
# imports it (autopar.model_file, autopar.profile) without tracing anything.

# torch's config modules gain patch() when they are installed, which a type checker cannot see.
SHAPES_CONFIG: Any = _shapes_config


# What fake tensors stop at when a value is needed (exception class names, checked by name:
# several live in private modules whose paths move between torch releases).
_DATA_DEPENDENT_ERRORS = ("DataDependentOutputException", "DynamicOutputShapeException",
                          "GuardOnDataDependentSymNode", "PendingUnbackedSymbolNotFound")


class ValueHints(dict):
    """The shape environment's values for its unbacked symbols: the real one where the batch
    alone determines it (filled by torch's real-value propagation), otherwise a guess made the
    first time the shape environment must decide on one. ``guesses`` (with where each was made)
    and ``read`` remember which were guessed and which read.

    A symbol without a real value is offered for guessing only while the shape environment
    evaluates a guard or a size (`allow_guesses`): torch's real-value propagation asks the
    same mapping whether an op's symbolic arguments have real values, and a guess there would
    run the op for real at the guessed size and contradict the real value found later."""

    def __init__(self, shape_env: ShapeEnv):
        super().__init__()
        self.shape_env = shape_env
        self.guesses: dict[sympy.Symbol, tuple[int, str]] = {}
        self.read: set[sympy.Symbol] = set()
        self.deciding = 0

    def __bool__(self) -> bool:
        return True  # torch consults the mapping only when it is non-empty

    def __setitem__(self, symbol: Any, value: Any) -> None:
        if _is_unbacked(symbol) and symbol not in self.guesses:
            self.read.add(symbol)  # where: its creation stack, read once in `described`
        super().__setitem__(symbol, value)

    def __contains__(self, symbol: object) -> bool:
        return super().__contains__(symbol) or (self.deciding > 0 and _is_unbacked(symbol))

    def allow_guesses(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """``method`` of the shape environment, with guesses offered while it runs."""
        @functools.wraps(method)
        def deciding(*args: Any, **kwargs: Any) -> Any:
            self.deciding += 1
            try:
                return method(*args, **kwargs)
            finally:
                self.deciding -= 1
        return deciding

    def __getitem__(self, symbol: Any) -> Any:
        if super().__contains__(symbol):
            return super().__getitem__(symbol)
        value = self._bound(symbol)
        self.guesses.setdefault(symbol, (value, self._made_at(symbol)))
        import sympy

        return sympy.Integer(value)

    def get(self, symbol: Any, default: Any = None) -> Any:
        return self[symbol] if symbol in self else default

    def _made_at(self, symbol: sympy.Symbol) -> str:
        """The user's line whose op made ``symbol`` (else the line asking for it now)."""
        made = self.shape_env.var_to_stack.get(symbol)
        return user_frame(made.summary() if made is not None else None)

    def _bound(self, symbol: sympy.Symbol) -> int:
        """A size at the upper bound torch proves for it (every token, for a ``nonzero``), and a
        0/1 value (a branch's comparison) at 1, the branch taken: both can only overstate time
        and memory. Any other value (an index a ``nonzero`` returned, a scalar read) at its lower
        bound, which an index always reaches (DBRX indexes its experts by such values; their
        upper bound is past the last expert). 0 where no bound is known."""
        value_range = self.shape_env.var_to_range.get(symbol)
        lower, upper = getattr(value_range, "lower", None), getattr(value_range, "upper", None)
        at_upper = symbol in self.shape_env.size_like or (lower == 0 and upper == 1)
        bound = upper if at_upper else lower
        try:  # torch's own infinities are sympy numbers that int() refuses
            return int(bound) if bound is not None and bound.is_finite else 0
        except (AttributeError, TypeError, ValueError, OverflowError):
            return 0

    def described(self) -> list[str]:
        """One line per place in the user's code where a value was needed: read from the batch,
        guessed, or decided by torch without us (some branches are settled on an expression of a
        value, which the mapping records under that expression)."""
        lines = []
        read_at = sorted({self._made_at(symbol) for symbol in self.read} - {""})
        if self.read:
            lines.append(f"{len(self.read)} value-dependent size(s) or branch(es) read from the example batch"
                         + (f" ({', '.join(read_at[:3])}{', ...' if len(read_at) > 3 else ''})" if read_at else ""))
        by_line: dict[str, list[int]] = {}
        for value, where in self.guesses.values():
            by_line.setdefault(where or "a line not found", []).append(value)
        for where, values in by_line.items():
            bounded = [value for value in values if value]
            taken = (f"taken at their upper bounds ({', '.join(map(str, sorted(set(bounded))))})" if bounded else "")
            unbounded = (f"{len(values) - len(bounded)} taken as 0 (an index at its lower bound, or no bound known)"
                         if len(bounded) < len(values) else "")
            lines.append(f"{len(values)} size(s) or value(s) that depend on the weights, made at {where}: "
                         + "; ".join(part for part in (taken, unbounded) if part))
        known = self.read | set(self.guesses) | {key for key in self.keys() if _is_unbacked(key)}
        others = sorted({self._made_at(symbol) or "a line not found" for symbol in self.shape_env.var_to_stack
                         if _is_unbacked(symbol) and symbol not in known})
        if others:
            lines.append(f"value-dependent branch(es) or size(s) decided by torch from the batch's values or its "
                         f"proven bounds, made at {', '.join(others[:3])}{', ...' if len(others) > 3 else ''}")
        return lines


def _is_unbacked(symbol: object) -> bool:
    import sympy
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    return isinstance(symbol, sympy.Symbol) and symbol_is_type(symbol, (SymT.UNBACKED_INT, SymT.UNBACKED_FLOAT))


def data_dependent_fake_mode(allow_non_fake_inputs: bool = False) -> tuple[FakeTensorMode, ValueHints]:
    """A FakeTensorMode with symbolic sizes for value-dependent ops and real-value propagation
    (off until `real_values` turns it on, so building the model allocates nothing)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    _quiet_value_logging()
    shape_env = ShapeEnv()
    with functorch_config.patch(fake_tensor_propagate_real_tensors=True):
        fake_mode = FakeTensorMode(allow_non_fake_inputs=allow_non_fake_inputs, shape_env=shape_env,
                                   static_shapes=True)
    hints = ValueHints(shape_env)
    shape_env.real_tensor_prop_unbacked_vals = hints
    for method in ("size_hint", "_evaluate_expr"):
        setattr(shape_env, method, hints.allow_guesses(getattr(shape_env, method)))
    fake_mode.propagate_real_tensors = False
    return fake_mode, hints


@contextlib.contextmanager
def real_values(fake_mode: FakeTensorMode, on: bool = True) -> Iterator[None]:
    """Propagate real values in ``fake_mode`` (a `data_dependent_fake_mode`) while the block runs."""
    if fake_mode.shape_env is None:
        yield
        return
    previous = fake_mode.propagate_real_tensors
    fake_mode.propagate_real_tensors = on
    try:
        yield
    finally:
        fake_mode.propagate_real_tensors = previous


@contextlib.contextmanager
def tracing_in(fake_mode: FakeTensorMode) -> Iterator[None]:
    """Enter ``fake_mode``; in a data-dependent one, propagate real values and do not bind new
    symbols to graph outputs (we read sizes through their values, never compile the graph)."""
    if fake_mode.shape_env is None:
        with fake_mode:
            yield
        return
    with fake_mode, real_values(fake_mode), fake_mode.shape_env.ignore_fresh_unbacked_symbols(), \
            SHAPES_CONFIG.patch(meta_nonzero_assume_all_nonzero=True), _AtenOnlyRealValues(fake_mode), \
            _dtensor_shapes_without_values(fake_mode):
        yield


@contextlib.contextmanager
def _dtensor_shapes_without_values(fake_mode: FakeTensorMode) -> Iterator[None]:
    """DTensor finds an op's global output shape by running the op on arguments it makes from
    shapes alone (``torch.empty_strided``: uninitialised memory). With real values on, torch ran
    the op on that memory too: a loss-parallel ``nll_loss_backward`` indexed with a garbage
    target ("Target 140376092386032 is out of bounds"). Shapes need no values: off while DTensor
    computes them."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = getattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", None)
    if original is None:  # another torch: nothing to turn off
        yield
        return

    @functools.wraps(original)
    def shapes_only(self: Any, op_schema: Any) -> Any:
        with real_values(fake_mode, False):
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = shapes_only  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]


def _quiet_value_logging() -> None:
    """torch logs a warning for every value real-value propagation reads or we guess; the plan
    lists them once (`ValueHints.described`), so those records are dropped (idempotent)."""
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    if not any(isinstance(f, _ValueReadRecords) for f in shapes_log.filters):
        shapes_log.addFilter(_ValueReadRecords())


class _ValueReadRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("propagate_real_tensors")


class _AtenOnlyRealValues(TorchDispatchMode):
    """Real values propagated through ATen ops only: torch checks that a custom op (FSDP's
    ``chunk_cat``, c10d's collectives) mutates what its schema says by running it for real, which
    fails on the placeholder values of outputs it allocates and on fake process groups.
    (Entered above the fake mode, so it sees each op first; meta tensors, which pipeline stages
    infer shapes on, take every ``nonzero`` element as non-zero, the same upper bound.)"""

    def __init__(self, fake_mode: FakeTensorMode):
        super().__init__()
        self.fake_mode = fake_mode

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.namespace not in ("aten", "prims"):
            with real_values(self.fake_mode, False):
                return func(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, FakeTensor)]
        if any(t.real_tensor is None for t in inputs):
            # torch ran no real op (an input has no value: it depends on the weights), so a value
            # an output already held is stale (an in-place op returns the tensor it wrote, whose
            # value was a factory's, zeros or uninitialised memory): drop it.
            for t in tree_leaves(out):
                if isinstance(t, FakeTensor):
                    t.real_tensor = None
        return out


def concrete(value: Any) -> Any:
    """``value`` with every SymInt/SymFloat/SymBool inside it (dataclasses, lists, tuples, dicts)
    replaced by its number: the real one, or the guess (`ValueHints`)."""
    if isinstance(value, torch.SymInt):
        return int(value)
    if isinstance(value, torch.SymFloat):
        return float(value)
    if isinstance(value, torch.SymBool):
        return bool(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: concrete(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return dataclasses.replace(value, **{k: v for k, v in changes.items() if v is not getattr(value, k)})
    if isinstance(value, (list, tuple)):
        items = [concrete(item) for item in value]
        if all(new is old for new, old in zip(items, value)):
            return value
        return type(value)(items) if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        entries = {key: concrete(item) for key, item in value.items()}
        return value if all(entries[key] is value[key] for key in value) else type(value)(entries)
    return value


def is_data_dependent(err: BaseException) -> bool:
    """Whether ``err`` is a fake tensor stopping where a tensor's value was needed."""
    for cause in _chain(err):
        if type(cause).__name__ in _DATA_DEPENDENT_ERRORS:
            return True
        text = str(cause)
        if any(word in text for word in ("_local_scalar_dense", "data-dependent", "DataDependent")):
            return True
    return False


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def user_frame(stack: traceback.StackSummary | None = None) -> str:
    """The innermost frame of ``stack`` (default: the current one) outside torch, sympy and
    autopar, as 'file.py:12 (`code`)'."""
    import sympy

    skipped = (str(Path(torch.__file__).parent), str(Path(sympy.__file__).parent), str(Path(__file__).parent))
    frames = [frame for frame in (stack if stack is not None else traceback.extract_stack())
              if not frame.filename.startswith(skipped) and "importlib" not in frame.filename
              and not frame.filename.startswith("<")]
    if not frames:
        return ""
    frame = frames[-1]
    return f"{Path(frame.filename).name}:{frame.lineno} (`{(frame.line or '').strip()}`)"


def register_missing_fake_kernels() -> None:
    """Fake kernels for ATen ops that torch marks dynamic-output and gives none (idempotent).

    ``aten._ctc_loss`` (every CTC speech model's loss): its ``log_alpha`` output is sized by the
    longest target, a value; we size it by the targets' padded width (2-D targets) or their
    count (1-D), an upper bound, since only the backward reads it — or by the longest target
    where the lengths' values are known (`data_dependent_fake_mode`), as the real kernel does."""
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    torch.library.register_fake("aten::_ctc_loss.Tensor", _ctc_loss)
    torch.library.register_fake("aten::_ctc_loss_backward.Tensor", _ctc_loss_backward)


_REGISTERED = False


def _ctc_loss(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
              target_lengths: torch.Tensor, blank: int = 0, zero_infinity: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    batched = log_probs.dim() == 3
    steps, batch = log_probs.shape[0], (log_probs.shape[1] if batched else 1)
    lengths = getattr(target_lengths, "real_tensor", None)  # the batch's, where its values are known
    if lengths is not None and lengths.numel():
        with unset_fake_temporarily():  # a real tensor: read outside the fake mode
            longest = int(lengths.max())
    else:
        longest = targets.shape[-1] if targets.dim() == 2 else targets.numel()
    return (log_probs.new_empty((batch,) if batched else ()),
            log_probs.new_empty((batch, steps, 2 * longest + 1)))


def _ctc_loss_backward(grad: torch.Tensor, log_probs: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.empty_like(log_probs)

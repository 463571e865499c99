"""Load a user's model.py and build its model and batch without allocating real memory.

The contract (ARCHITECTURE.md):

    def build_model(**kw) -> torch.nn.Module     # called under FakeTensorMode when planning
    def example_batch(batch_size: int, **kw)      # a tensor, or a tuple/list/dict of tensors
    def loss_fn(output, batch) -> torch.Tensor    # optional

``**kw`` are the ``model.<name>=<value>`` overrides; each function receives the ones its
signature names (all of them if it takes ``**kw``). How a batch reaches the model: a dict is
passed as keyword arguments (only the keys ``forward`` accepts, so labels may ride along for
``loss_fn``), a tuple/list positionally (only as many items as ``forward`` takes), a tensor as
the single argument. Without ``loss_fn`` the loss is ``output.loss`` (Hugging Face models), else
``output.mean()``.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import inspect
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

try:
    import resource
except ImportError:  # not on Windows: there the address-space cap is not set
    resource = None  # type: ignore[assignment]

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

from autopar.data_dependent import (ValueHints, data_dependent_fake_mode, is_data_dependent, real_values,
                                    register_missing_fake_kernels, tracing_in, user_frame)
from autopar.sections import contract
from autopar.sections.contract import accepted_kwargs, model_inputs, signature_module
from autopar.errors import ModelFileError, UserError
from autopar.user_code import (IMPORT_TIMEOUT_ENV, TimeLimitReached, describe_exit, exits_refused, import_timeout_s,
                               time_limit)

REQUIRED_FUNCTIONS = ("build_model", "example_batch")

# Importing model.py may create tensors for real (planning never needs their values): one op
# whose outputs exceed this is refused before it allocates. Constants, masks and lookup tables
# are far smaller; weights belong in build_model(), which runs on fake tensors.
IMPORT_ALLOCATION_LIMIT_BYTES = 2 * 2**30

# The torch guard cannot see numpy arrays, `array`, bytearrays or C extensions: while the user's
# code runs (import, build_model, example_batch) the process's address space is capped this far
# above its size, so such an allocation fails with MemoryError before it takes the memory
# (Linux RLIMIT_AS; elsewhere the cap is not set). Room for imports of large libraries remains.
USER_CODE_ADDRESS_SPACE_HEADROOM_BYTES = 4 * 2**30
_CAP_GIB = USER_CODE_ADDRESS_SPACE_HEADROOM_BYTES // 2**30

# Tracing costs time per module (about 0.1 s per GPT block on a 2-core machine), so a model of
# more modules than this is refused while it is being built, before the tracing that would not
# end (model.layers=100000). The largest dense models have a few thousand modules; a
# 1,800-block GPT traces in about 4 minutes.
MAX_MODULES = 20_000

# Code no fake tensor can run (`.numpy()`, a custom op without a fake kernel) is traced once with
# real tensors instead: the model built for real and run on one micro-batch, its values those of
# the example batch. Only a model whose parameters take at most this many bytes (and an eighth of
# the machine's memory) is built so; a larger one gets the fake run's error.
REAL_TRACE_LIMIT_BYTES = 2 * 2**30

META_BUILD_FIX = ("build the model without touching real memory: create its tensors inside build_model() "
                  "(autopar calls it under FakeTensorMode, where even a 70B model costs no memory) or under "
                  "`with torch.device('meta'):`; don't create large tensors at import time or with real storage "
                  "(numpy arrays, explicit device='cpu' tensors made outside build_model) and don't load "
                  "checkpoints in build_model: load weights in the training script instead.")


EXIT_FIX = ("remove the sys.exit() / os._exit() / raise SystemExit (a script's own entry point goes under "
            "`if __name__ == '__main__':`, which autopar's import does not run); raise an exception to report a "
            "problem.")


@dataclass(frozen=True)
class ModelFile:
    """A loaded model.py: its functions plus what identifies the file (for stale-plan checks)."""

    path: Path
    sha256: str
    build_model: Callable[..., torch.nn.Module]
    example_batch: Callable[..., Any]
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    dataset: Callable[..., Any] | None = None  # dataset(split, **kw): the data to train on (optional)

    @property
    def name(self) -> str:
        return self.path.stem


def load_model_file(path: str | Path) -> ModelFile:
    """Import model.py from a path (not from sys.path) and check the contract's functions."""
    path = Path(path).resolve()
    if not path.is_file():
        raise ModelFileError(f"Model file {path} does not exist.",
                             "pass the path of a model.py that defines build_model() and "
                             "example_batch(batch_size).")
    source = path.read_bytes()
    try:
        compile(source, str(path), "exec")
    except SyntaxError as err:
        code = f" (`{err.text.strip()}`)" if err.text and err.text.strip() else ""
        raise ModelFileError(f"{path.name}:{err.lineno}: syntax error: {err.msg}{code}.",
                             "correct the syntax; `python -m py_compile` shows the same error.") from None
    module_name = f"autopar_user_model_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"{path} cannot be imported as a Python module.", "pass a .py file.")
    module = importlib.util.module_from_spec(spec)
    # Registered so dataclasses/pickle inside the user's file can find their module; the file's
    # folder goes on sys.path so it can import its neighbours, as `python model.py` would.
    sys.modules[module_name] = module
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    timeout_s = import_timeout_s()
    try:
        with _AllocationGuard(IMPORT_ALLOCATION_LIMIT_BYTES), address_space_cap(), exits_refused(), \
                time_limit(timeout_s):
            spec.loader.exec_module(module)
    except TimeLimitReached as err:
        raise ModelFileError(f"Importing {path.name} did not finish within {timeout_s:g} s (stopped at "
                             f"{_frame_text(err.where)}); autopar bounds the import so that a file that waits "
                             "forever cannot hold the command.",
                             "make the import quick (download or wait in build_model() or the training script, "
                             f"not at import), or allow it longer: {IMPORT_TIMEOUT_ENV}=SECONDS.") from None
    except _OversizedAllocation as err:
        raise ModelFileError(f"Importing {path.name} creates a real tensor of {err.nbytes / 2**30:,.1f} GiB "
                             f"({err.op}{_location(err, path)}); planning must not allocate the model's memory "
                             "(refused before allocating).", META_BUILD_FIX) from None
    except Exception as err:  # noqa: BLE001 - any import-time failure is the user's to fix
        if _is_out_of_memory(err):
            raise ModelFileError(f"Importing {path.name} ran out of memory: {_describe(err, path)}; planning caps "
                                 f"real allocations (numpy arrays, buffers) at {_CAP_GIB} GiB, so this one was "
                                 "refused before it was made.", META_BUILD_FIX) from None
        raise ModelFileError(f"Importing {path.name} raised {_describe(err, path)}.",
                             "make the file importable on its own (`python -c 'import ...'`).") from None
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # noqa: BLE001 - SystemExit, os._exit, GeneratorExit: it must not end autopar
        raise ModelFileError(f"Importing {path.name} {describe_exit(err)}: the file must not end the process, "
                             "autopar imports it to plan.", EXIT_FIX) from None
    missing = [name for name in REQUIRED_FUNCTIONS if not callable(getattr(module, name, None))]
    if missing:
        raise ModelFileError(
            f"{path.name} does not define {', '.join(f'{m}()' for m in missing)}.",
            "define build_model(**kw) -> nn.Module and example_batch(batch_size, **kw) "
            "(see the model.py contract in docs/model_contract.md).")
    loss_fn = getattr(module, "loss_fn", None)
    dataset = getattr(module, "dataset", None)
    return ModelFile(path=path, sha256=hashlib.sha256(source).hexdigest(),
                     build_model=module.build_model, example_batch=module.example_batch,
                     loss_fn=loss_fn if callable(loss_fn) else None, dataset=dataset if callable(dataset) else None)


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes: what plans record, checked before a file is imported."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def check_model_kwargs(model_file: ModelFile, kwargs: dict[str, Any]) -> None:
    """Refuse an override that neither build_model, example_batch nor dataset takes (a typo, usually)."""
    functions = [f for f in (model_file.build_model, model_file.example_batch, model_file.dataset) if f is not None]
    used = {name for function in functions for name in accepted_kwargs(function, kwargs)}
    unused = sorted(set(kwargs) - used)
    if unused:
        known = sorted(set().union(*(_named_parameters(f) for f in functions)))
        raise ModelFileError(
            f"model.{unused[0]} is not a parameter of build_model() or example_batch() in "
            f"{model_file.path.name}.",
            f"use one of: {', '.join('model.' + k for k in known) or '(none)'}.")


def build_model(model_file: ModelFile, kwargs: dict[str, Any]) -> torch.nn.Module:
    """Call build_model with the kwargs it accepts, turning its exceptions into clear errors."""
    with _module_count_limit(model_file, MAX_MODULES):
        model = _call_user(model_file, model_file.build_model, **accepted_kwargs(model_file.build_model, kwargs))
    if not isinstance(model, torch.nn.Module):
        raise ModelFileError(f"build_model() in {model_file.path.name} returned "
                             f"{type(model).__name__}, not a torch.nn.Module.",
                             "return the model instance.")
    return model


def make_batch(model_file: ModelFile, batch_size: int, kwargs: dict[str, Any]) -> Any:
    """Call example_batch and check every leaf is a tensor."""
    batch = _call_user(model_file, model_file.example_batch, batch_size,
                       **accepted_kwargs(model_file.example_batch, kwargs))
    leaves, _ = tree_flatten(batch)
    bad = [type(leaf).__name__ for leaf in leaves if not isinstance(leaf, torch.Tensor)]
    if not leaves or bad:
        raise ModelFileError(
            f"example_batch() in {model_file.path.name} returned "
            f"{'nothing' if not leaves else 'non-tensor values (' + ', '.join(sorted(set(bad))) + ')'}.",
            "return a tensor, or a tuple/list/dict whose values are tensors.")
    return batch


@dataclass
class FakeBuild:
    """A model and batch living in one FakeTensorMode: shapes and dtypes only, no storage.

    With ``real_values`` (why fake tensors could not run the model) there is no fake mode: the
    model and batch are real (`build_real`)."""

    fake_mode: FakeTensorMode | None
    model: torch.nn.Module
    batch: Any
    value_hints: ValueHints | None = None
    real_values: str | None = None

    @property
    def data_dependent(self) -> bool:
        return self.value_hints is not None

    def active(self) -> contextlib.AbstractContextManager:
        """The fake mode to run the model in (see autopar.data_dependent.tracing_in)."""
        return contextlib.nullcontext() if self.fake_mode is None else tracing_in(self.fake_mode)


def build_fake(model_file: ModelFile, kwargs: dict[str, Any], batch_size: int,
               dtype: torch.dtype | None = None, data_dependent: bool = False) -> FakeBuild:
    """Build model and batch under FakeTensorMode, so a 70B model costs no real memory.

    Models built on the meta device (``with torch.device("meta")``) are accepted too: their
    parameters are materialised as fake CPU tensors. With ``dtype``, floating-point
    parameters and inputs are created in that dtype (16-bit training) through the default dtype.
    With ``data_dependent``, the mode is autopar.data_dependent's: the weights fake, the batch's
    values real, for code whose shapes or branches depend on values.
    """
    check_model_kwargs(model_file, kwargs)
    register_missing_fake_kernels()
    value_hints = None
    if data_dependent:
        fake_mode, value_hints = data_dependent_fake_mode()
    else:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    with fake_mode, default_dtype(dtype), _value_free_initialisers():
        model = build_model(model_file, kwargs)
        if any(t.device.type == "meta" for t in _tensors_of(model)):
            model = model.to_empty(device="cpu")
        with real_values(fake_mode, data_dependent):
            batch = make_batch(model_file, batch_size, kwargs)
    real = [name for name, t in _named_tensors_of(model) if not isinstance(t, FakeTensor)]
    if real:
        raise ModelFileError(
            f"build_model() in {model_file.path.name} produced real tensors ({real[0]} and "
            f"{len(real) - 1} more), so planning would allocate the model's full memory.",
            "create parameters inside build_model() with ordinary constructors (nn.Linear, "
            "torch.empty, ...) instead of loading or reusing tensors made outside it; autopar "
            "calls it under FakeTensorMode, where such constructors allocate nothing. " + META_BUILD_FIX)
    return FakeBuild(fake_mode=fake_mode, model=model, batch=batch, value_hints=value_hints)


def build_fake_for(model_file: ModelFile, kwargs: dict[str, Any], batch_size: int,
                   run: Callable[[FakeBuild], Any], dtype: torch.dtype | None = None,
                   real_values: str | None = None) -> Any:
    """``run(build_fake(...))``, built again in the data-dependent mode where the ordinary fake
    run stops at a tensor's value (autopar.data_dependent), and for real (`build_real`) where a
    fake run cannot go on at all and the model is small enough. ``real_values`` (the reason a
    profile gave) goes straight to the real build."""
    if real_values is not None:
        return run(build_real(model_file, kwargs, batch_size, dtype, real_values))
    try:
        build: FakeBuild | None = build_fake(model_file, kwargs, batch_size, dtype)
    except UserError as err:
        if not is_data_dependent(err):
            raise
        build = None  # building read a value (ConvNeXt's drop-path rates, linspace(...).tolist())
    if build is not None:
        try:
            return run(build)
        except Exception as err:  # noqa: BLE001 - a stop at a value is retried with values; the rest for real
            if not (is_data_dependent(err) or getattr(err, "data_dependent", False)):
                return _run_for_real(model_file, kwargs, batch_size, run, dtype, build, err)
    build = build_fake(model_file, kwargs, batch_size, dtype, data_dependent=True)
    try:
        return run(build)
    except Exception as err:  # noqa: BLE001 - as above
        return _run_for_real(model_file, kwargs, batch_size, run, dtype, build, err)


def _run_for_real(model_file: ModelFile, kwargs: dict[str, Any], batch_size: int, run: Callable[[FakeBuild], Any],
                  dtype: torch.dtype | None, fake: FakeBuild, err: Exception) -> Any:
    """``run`` on a real build after the fake one raised ``err``; ``err`` itself where the model
    is too large to build for real, or the real run fails too (then the fault is not the fakes')."""
    if isinstance(err, UserError) and not getattr(err, "fake_unsupported", None):
        raise err  # autopar's own refusal (the user's function raised, a loss without parameters, ...)
    size = sum(t.numel() * t.element_size() for t in _tensors_of(fake.model))
    limit = real_trace_limit_bytes()
    if size > limit:
        if isinstance(err, UserError):  # say why it was not traced for real either
            raise type(err)(f"{err.problem.rstrip('.')}; at {size / 2**30:.1f} GiB of parameters the model is too "
                            f"large to trace with real tensors instead (at most {limit / 2**30:.1f} GiB here).",
                            err.fix) from None
        raise err
    try:
        return run(build_real(model_file, kwargs, batch_size, dtype, _reason(err)))
    except Exception:  # noqa: BLE001 - the real run failing too: the first error is the one to report
        raise err from None


def _reason(err: Exception) -> str:
    """Where and why fake tensors stopped, in a line: 'model.py:29 (`...`): RuntimeError: ...'."""
    reason = getattr(err, "fake_unsupported", None)
    if isinstance(reason, str):
        return reason
    where = user_frame(traceback.extract_tb(err.__traceback__))
    text = f"{type(err).__name__}: {err}".splitlines()[0]
    return f"{where}: {text}" if where else text


def real_trace_limit_bytes() -> int:
    """The largest model (parameter bytes) traced with real tensors: REAL_TRACE_LIMIT_BYTES, or an
    eighth of the machine's memory where that is less."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return REAL_TRACE_LIMIT_BYTES
    return min(REAL_TRACE_LIMIT_BYTES, memory // 8)


def build_real(model_file: ModelFile, kwargs: dict[str, Any], batch_size: int, dtype: torch.dtype | None,
               reason: str) -> FakeBuild:
    """Model and batch built for real (seeded), for code fake tensors cannot run (``reason``)."""
    check_model_kwargs(model_file, kwargs)
    torch.manual_seed(0)
    with default_dtype(dtype):
        model = build_model(model_file, kwargs)
        if any(t.device.type == "meta" for t in _tensors_of(model)):
            model = model.to_empty(device="cpu")
        batch = make_batch(model_file, batch_size, kwargs)
    return FakeBuild(fake_mode=None, model=model, batch=batch, real_values=reason)


def check_batch_feeds(model: torch.nn.Module, batch: Any, model_file: ModelFile) -> None:
    """Refuse a batch forward cannot take, as the contract feeds it (a dict's items by keyword,
    only those forward names; a tuple's positionally; a tensor alone), before tracing: inside the
    trace the TypeError would read as an op that fake tensors cannot run."""
    module = signature_module(model)
    args, kwargs = model_inputs(model, batch)
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):  # a forward without a signature to check: the trace will tell
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as err:
        given = (f"a dict with keys {', '.join(map(repr, batch))}" if isinstance(batch, dict)
                 else f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (tuple, list))
                 else f"a {type(batch).__name__}")
        raise ModelFileError(f"example_batch in {model_file.path.name} returns {given}, which "
                             f"{type(module).__name__}.forward"
                             f"{signature.replace(return_annotation=inspect.Signature.empty)} cannot take ({err}).",
                             "name a dict batch's keys after forward's arguments (they are passed by keyword; "
                             "other keys ride along for loss_fn), or return a tuple (passed positionally).") from None


def call_model(model: torch.nn.Module, batch: Any) -> Any:
    """Run the model on a batch as the contract says."""
    args, kwargs = model_inputs(model, batch)
    return model(*args, **kwargs)


def compute_loss(model_file: ModelFile, output: Any, batch: Any) -> torch.Tensor:
    """The contract's loss (autopar.sections.contract), refused as the model file's fault when there is none."""
    try:
        return contract.compute_loss(model_file, output, batch)
    except contract.NoLoss:
        raise ModelFileError(f"The model returned {type(output).__name__} with no loss and "
                             f"{model_file.path.name} defines no loss_fn(output, batch).",
                             "define loss_fn, or return a tensor or an object with a .loss.") from None


def _call_user(model_file: ModelFile, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        with address_space_cap(), exits_refused():
            return fn(*args, **kwargs)
    except ModelFileError:
        raise
    except Exception as err:  # noqa: BLE001 - the user's function failed; say where
        call = ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()])
        if _is_out_of_memory(err):
            raise ModelFileError(f"{fn.__name__}({call}) in {model_file.path.name} ran out of memory "
                                 f"({_describe(err, model_file.path)}): it allocates real memory, which planning "
                                 f"never needs (planning caps real allocations at {_CAP_GIB} GiB, so this one was "
                                 "refused before it was made).", META_BUILD_FIX) from None
        raise ModelFileError(f"{fn.__name__}({call}) in {model_file.path.name} raised "
                             f"{_describe(err, model_file.path)}.",
                             "fix the function, or the model.<name> overrides it was given.") from None
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # noqa: BLE001 - SystemExit, os._exit, GeneratorExit: it must not end autopar
        raise ModelFileError(f"{fn.__name__}() in {model_file.path.name} {describe_exit(err)}: it must return, "
                             "not end the process (autopar calls it to plan).", EXIT_FIX) from None


def _address_space_bytes() -> int | None:
    """This process's virtual size (Linux), or None where /proc is not there."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[0]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def address_space_cap(headroom_bytes: int = USER_CODE_ADDRESS_SPACE_HEADROOM_BYTES) -> Iterator[None]:
    """Cap the process's address space ``headroom_bytes`` above its current size while the
    block runs (any allocation beyond it raises MemoryError at once, allocating nothing), then
    restore the previous soft limit. Nested caps keep the outer one."""
    current = _address_space_bytes()
    if current is None or resource is None:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = current + headroom_bytes
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    if soft != resource.RLIM_INFINITY and soft <= cap:
        yield  # already capped as tightly (an outer cap, or the user's own ulimit)
        return
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@contextlib.contextmanager
def _module_count_limit(model_file: ModelFile, limit: int) -> Iterator[None]:
    """Refuse, as soon as it happens, a build that registers more than ``limit`` submodules."""
    count = 0

    def count_module(module: torch.nn.Module, name: str, submodule: torch.nn.Module | None) -> None:
        nonlocal count
        count += 1
        if count > limit:
            raise ModelFileError(f"build_model() in {model_file.path.name} creates more than {limit:,} modules; "
                                 f"autopar plans models of up to {limit:,} modules (tracing a larger one would not "
                                 "finish in bounded time).", "use fewer layers (e.g. a smaller model.layers).")

    handle = torch.nn.modules.module.register_module_module_registration_hook(count_module)
    try:
        yield
    finally:
        handle.remove()


def _frame_text(frame: traceback.FrameSummary | None) -> str:
    """'model.py:3, in <module>' for a frame, or 'an unknown place'."""
    return f"{Path(frame.filename).name}:{frame.lineno}, in {frame.name}" if frame is not None else "an unknown place"


def _describe(err: BaseException, path: Path) -> str:
    """'ValueError: message (model.py:12)', locating the innermost frame in the user's file."""
    where = _location(err, path)
    return f"{type(err).__name__}: {err}" + (f" ({where.removeprefix(', ')})" if where else "")


def _location(err: BaseException, path: Path) -> str:
    """', model.py:12' for the innermost frame of the traceback in the user's file, or ''."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if Path(f.filename) == path]
    return f", {path.name}:{frames[-1].lineno}" if frames else ""


def _is_out_of_memory(err: BaseException) -> bool:
    """MemoryError (numpy), or torch's allocator refusing ('not enough memory', 'out of memory')."""
    text = str(err).lower()
    return isinstance(err, MemoryError) or any(words in text for words in (
        "not enough memory", "out of memory", "cannot allocate memory", "can't allocate memory",
        "unable to allocate"))


class _OversizedAllocation(Exception):
    """An op would create more real memory than the guard allows (raised before it runs)."""

    def __init__(self, op: str, nbytes: int):
        super().__init__(f"{op} would allocate {nbytes} bytes")
        self.op, self.nbytes = op, nbytes


class _AllocationGuard(TorchDispatchMode):
    """Refuses any op whose outputs would exceed ``limit_bytes``, before it allocates them.

    Each op is first run on meta copies of its arguments, which gives its output sizes without
    storage; ops without a meta kernel run unchecked."""

    def __init__(self, limit_bytes: int):
        super().__init__()
        self.limit_bytes = limit_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        nbytes = _new_output_bytes(func, args, kwargs)
        if nbytes is not None and nbytes > self.limit_bytes:
            raise _OversizedAllocation(str(func.overloadpacket.__name__), nbytes)
        return func(*args, **kwargs)


def _new_output_bytes(func: Any, args: tuple, kwargs: dict) -> int | None:
    """Bytes of the new tensors ``func`` returns (views and in-place results excluded), from a
    meta run; None when the op cannot run on meta."""
    schema = func._schema
    fresh = [not ret.alias_info for ret in schema.returns]
    if not any(fresh):
        return 0

    def to_meta(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    meta_args, meta_kwargs = tree_map_only(torch.Tensor, to_meta, (args, kwargs))
    if any(arg.name == "device" for arg in schema.arguments):
        meta_kwargs["device"] = torch.device("meta")
    try:
        out = func(*meta_args, **meta_kwargs)
    except Exception:  # noqa: BLE001 - no meta kernel: the op is allowed to run as written
        return None
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return sum(t.numel() * t.element_size() for t, new in zip(outs, fresh) if new and isinstance(t, torch.Tensor))


@contextlib.contextmanager
def _value_free_initialisers() -> Iterator[None]:
    """Let ``nn.init.trunc_normal_`` run on fake tensors.

    PyTorch's truncated normal redraws out-of-range samples until none is left (``if not
    mask.any()``), a branch on values a fake tensor does not have; ViT and most vision models
    initialise with it. On a fake tensor the values never matter, so a clamped normal draw of the
    same shape stands in. Patched at the private function every public alias calls (Hugging Face keeps its
    own reference to ``trunc_normal_``), and only for fake tensors."""
    original = getattr(torch.nn.init, "_no_grad_trunc_normal_", None)
    if original is None:
        yield
        return

    def trunc_normal(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, *args, **kwargs):
        if not isinstance(tensor, FakeTensor):
            return original(tensor, mean, std, a, b, *args, **kwargs)
        with torch.no_grad():
            return tensor.normal_(mean, std).clamp_(a, b)

    torch.nn.init._no_grad_trunc_normal_ = trunc_normal
    try:
        yield
    finally:
        torch.nn.init._no_grad_trunc_normal_ = original


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    """Tensors made without a dtype are made in ``dtype`` inside (nothing changes for None)."""
    previous = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _named_parameters(fn: Callable[..., Any]) -> set[str]:
    return {p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            and p.name != "batch_size"}


def _named_tensors_of(model: torch.nn.Module):
    yield from model.named_parameters()
    yield from model.named_buffers()


def _tensors_of(model: torch.nn.Module):
    return (t for _, t in _named_tensors_of(model))

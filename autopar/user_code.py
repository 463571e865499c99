"""The user's code (model.py) runs inside autopar's process; this keeps it from ending that
process or holding it forever.

autopar imports the model file and calls its functions (build_model, example_batch, forward,
loss_fn) in the CLI's own process. Code there that ends the process (``sys.exit``, ``raise
SystemExit``, ``os._exit``, an ``os.exec*`` that replaces it) would make the CLI stop with an exit
code autopar never chose, 0 included, with nothing written. While autopar runs:

- ``os._exit``/``os.exec*`` called from Python raise `ExitCalled` (a SystemExit) instead, naming
  the caller's file and line (only in the process that installed the guard: a forked child exits
  as it should);
- `describe_exit` turns a SystemExit (or GeneratorExit) into words naming where it came from;
- `time_limit` bounds the import (`import_timeout_s`, ``AUTOPAR_IMPORT_TIMEOUT_S``), so a file that
  sleeps or waits forever at import is stopped with a message.

Exits through C code (ctypes' ``_exit``, a signal sent to itself) stay out of reach: those end the
process without Python seeing them.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

from autopar.errors import ConfigError

IMPORT_TIMEOUT_ENV = "AUTOPAR_IMPORT_TIMEOUT_S"
DEFAULT_IMPORT_TIMEOUT_S = 120.0  # a model file importing transformers takes seconds, not minutes

EXEC_FUNCTIONS = ("execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe")
AUTOPAR_ROOT = Path(__file__).resolve().parent


class ExitCalled(SystemExit):
    """``os._exit(code)`` or ``os.exec*`` was called while autopar ran; ``where`` is the caller."""

    def __init__(self, call: str, where: traceback.FrameSummary | None):
        super().__init__(1)
        self.call, self.where = call, where


class TimeLimitReached(BaseException):
    """A bounded block ran past its time (a BaseException, so ``except Exception`` in the user's
    code cannot swallow it)."""

    def __init__(self, seconds: float, where: traceback.FrameSummary | None):
        super().__init__(f"stopped after {seconds:g} s")
        self.seconds, self.where = seconds, where


def import_timeout_s() -> float:
    """The bound on importing the model file: $AUTOPAR_IMPORT_TIMEOUT_S seconds, default 120."""
    text = os.environ.get(IMPORT_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_IMPORT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{IMPORT_TIMEOUT_ENV}={text} is not a number of seconds above 0.",
                          f"set it to the seconds importing the model file may take (default "
                          f"{DEFAULT_IMPORT_TIMEOUT_S:g}), or unset it.")
    return value


@contextlib.contextmanager
def exits_refused() -> Iterator[None]:
    """Make ``os._exit`` and ``os.exec*`` raise `ExitCalled` in this process while the block
    runs (nested use keeps the outer guard)."""
    if getattr(os._exit, "_autopar_guard", False):
        yield
        return
    owner = os.getpid()
    originals = {name: getattr(os, name) for name in ("_exit", *EXEC_FUNCTIONS) if hasattr(os, name)}
    posix = sys.modules.get("posix")
    posix_exit = getattr(posix, "_exit", None)

    def guarded(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            if os.getpid() != owner:  # a forked child (multiprocessing): its exit is its own
                return original(*args, **kwargs)
            call = f"os._exit({args[0] if args else ''})" if name == "_exit" else f"os.{name}()"
            raise ExitCalled(call, caller_frame())
        setattr(refuse, "_autopar_guard", True)  # a marker the nested guard looks for
        return refuse

    for name, original in originals.items():
        setattr(os, name, guarded(name, original))
    if posix is not None and posix_exit is not None:
        setattr(posix, "_exit", os._exit)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(os, name, original)
        if posix is not None and posix_exit is not None:
            setattr(posix, "_exit", posix_exit)


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise `TimeLimitReached` in the block once it has run ``seconds`` (SIGALRM: only on the
    main thread and where no other alarm is set; elsewhere the block runs unbounded)."""
    usable = (hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
              and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
              and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.SIG_IGN, None))
    if not usable:
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        where = traceback.extract_stack(frame, limit=1)[-1] if frame is not None else None
        raise TimeLimitReached(seconds, where)

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def caller_frame() -> traceback.FrameSummary | None:
    """The innermost frame outside this module: who called the guarded function."""
    here = str(Path(__file__).resolve())
    for frame in reversed(traceback.extract_stack()):
        if str(Path(frame.filename).resolve()) != here:
            return frame
    return None


def exit_origin(err: BaseException) -> traceback.FrameSummary | None:
    """Where a SystemExit/GeneratorExit came from: the caller `ExitCalled` recorded, else the
    innermost frame of its traceback."""
    if isinstance(err, (ExitCalled, TimeLimitReached)):
        return err.where
    frames = traceback.extract_tb(err.__traceback__)
    return frames[-1] if frames else None


def in_autopar(frame: traceback.FrameSummary | None) -> bool:
    """Whether a frame is autopar's own code (an exit there is autopar's bug)."""
    if frame is None:
        return False
    try:
        return Path(frame.filename).resolve().is_relative_to(AUTOPAR_ROOT)
    except OSError:
        return False


def describe_exit(err: BaseException, located: bool = True) -> str:
    """'raised SystemExit(3) (model.py:4, in build_model)': what ended it, and (``located``) where."""
    if isinstance(err, ExitCalled):
        what = f"called {err.call}"
    elif isinstance(err, SystemExit):
        what = f"raised SystemExit({'' if err.code is None else repr(err.code)}) (what sys.exit() does)"
    else:
        what = f"raised {type(err).__name__}"
    frame = exit_origin(err) if located else None
    where = f" ({Path(frame.filename).name}:{frame.lineno}, in {frame.name})" if frame is not None else ""
    return what + where

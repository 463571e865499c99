"""Processes autopar starts die with the command that started them.

A CLI killed by a signal it cannot handle (SIGKILL, the OOM killer) runs no cleanup: torchrun
and the proof's processes it started would live on, holding the run folder's lock, training into
it and spending its ``--max-restarts`` on ranks that die of the closed output pipe. So every
child autopar starts through one of its own modules (torchrun through autopar.runtime.loopback,
a proof step through autopar.runtime.proof) first calls `die_with_parent`: Linux's
PR_SET_PDEATHSIG sends it SIGTERM when the process that started it ends, and torchrun answers
SIGTERM by stopping its ranks. The parent names itself in `PARENT_ENV` (`child_environment`) so
a child whose parent is gone before the call ends at once; elsewhere than Linux nothing is done.
"""
from __future__ import annotations

import ctypes
import gc
import os
import signal
import sys
from typing import Mapping, NoReturn

PARENT_ENV = "AUTOPAR_PARENT_PID"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def child_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) for a child that should die with this process."""
    return {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}


def die_with_parent(parent: int | None = None) -> bool:
    """Ask for SIGTERM when the parent named in `PARENT_ENV` ends (removed from the environment,
    so grandchildren do not inherit it), or ``parent`` (a pid) where given; whether that was
    arranged."""
    named = os.environ.pop(PARENT_ENV, None)
    expected = str(parent) if parent is not None else named
    if expected is None or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if str(os.getppid()) != expected:  # the parent ended before the request: nobody will signal
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def end_process(code: int | None) -> NoReturn:
    """End a child process with ``code``, its work done: what it still holds is frozen out of the
    collector first, so the interpreter's last collection on the way out does not walk everything
    torch loaded (over a second of every launcher's and proof step's exit; 0.4 s then). Its
    objects are freed as the process ends either way."""
    gc.freeze()
    sys.exit(code)

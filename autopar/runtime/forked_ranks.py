"""Run a function on N local ranks (one process each), forked from a process that imported torch
once, and collect what each returns.

    results = run_ranks(my_fn, 4, arg)   # my_fn(rank, world_size, arg) -> picklable, on 4 gloo ranks

Why not torchrun: each of its workers is a fresh interpreter importing torch and the distributed
packages (3-4 s of CPU each), and its agent one more. Compile's proof (proof.py) runs a plan's
module for two steps on a handful of ranks, beside a full-scale fake step: on a 2-core machine
those imports were most of the proof's time. Here the ranks (and the fake steps) fork from
multiprocessing's fork server, a process that imported torch and what generated modules import
(`PRELOAD`) and did nothing else, so a rank starts as clean as a spawned interpreter without the
imports. `autopar run` keeps torchrun: restarts, its rendezvous, and launch.sh's way of starting
ranks on a cluster are what it runs.

A rank gets the caller's environment at the time of the call (and, as any multiprocessing child,
its sys.path and working folder), with RANK, WORLD_SIZE and LOCAL_RANK set as torchrun sets them.
Ranks meet through a file store in a fresh temporary folder (``file://``), so two runs at once
never race for a TCP port, and nothing listens on the network. When any rank raises or dies, the
others are stopped and `RankFailure` carries the failing rank's traceback (or the signal that
killed it). Ranks that fail to set up gloo itself (inside init_process_group, before the function
runs) are started again once (INIT_ATTEMPTS). A rank dies with the fork server, which ends with
the process that started it (even by SIGKILL: lifeline.py), so a killed compile leaves no rank.
"""
from __future__ import annotations

import contextlib
import functools
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
import traceback
import types
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator

from autopar.runtime.lifeline import PARENT_ENV, die_with_parent
from autopar.runtime.local import LOOPBACK_ENV

# Imported once by the fork server (torch, what generated modules import, and the autopar modules
# rank functions import); one that fails to import there is imported by the rank.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.pipelining", "torch.distributed.checkpoint", "autopar.runtime.generated",
           "autopar.codegen", "autopar.solver.planner"]
# How long one collective may wait for its peers before gloo raises (its default is 30 minutes): a
# rank stuck in a collective fails in minutes instead of holding its caller until the timeout.
COLLECTIVE_TIMEOUT = timedelta(seconds=300)
# Setting up gloo's full mesh over loopback TCP fails now and then on a loaded machine ("Connection
# closed by peer" inside init_process_group, before any of the function runs): such a run is
# started again, all ranks afresh, this many times in all. A failure in the function itself never is.
INIT_ATTEMPTS = 2
POLL_S = 0.5  # how often a wait for results looks for ranks that died without a word


class RankFailure(RuntimeError):
    """A rank raised or died; the message holds its rank number and traceback.

    ``killed`` lists ranks whose process died by a signal (no Python exception: e.g. a C++ abort
    inside the transport), whose peers then fail with lost connections. ``rank`` is the rank
    whose failure is reported (None: the ranks did not finish in time)."""

    def __init__(self, message: str, killed: list[int] | None = None, rank: int | None = None,
                 error: str = ""):
        super().__init__(message)
        self.killed = killed or []
        self.rank = rank
        self.error = error  # the rank's traceback, or what ended it


class Cancelled(RuntimeError):
    """The caller's ``cancel`` event was set: the ranks were stopped."""


@functools.lru_cache(maxsize=None)
def _context() -> Any:
    """The fork server's context, its server started; where it cannot start, spawn's (each rank
    then imports torch itself: slower, the same ranks)."""
    import multiprocessing
    from multiprocessing import forkserver

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # no effect once the server runs: it has them already
    try:
        with _main_hidden():
            forkserver.ensure_running()
    except OSError:  # its socket's path is too long (AF_UNIX allows 107 bytes): a deep TMPDIR
        return multiprocessing.get_context("spawn")
    return context


def start_server() -> None:
    """Start the fork server now, so that its imports run beside the caller's work (compile's
    search) instead of before its first rank."""
    _context()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0,
              join_group: bool = True, cancel: threading.Event | None = None,
              output: Path | None = None) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` processes; results by rank.

    Args:
        join_group: each rank joins a gloo process group of all of them before the call (without
            it, the ranks are plain processes: a fake-tensor step makes its own fake group).
        cancel: once set, the ranks are stopped and `Cancelled` is raised.
        output: a folder where each rank's stdout and stderr go (``rank<R>.log``); by default
            they are the fork server's, i.e. those of the process that started it.

    Raises:
        RankFailure: a rank raised or died, or they did not all finish within ``timeout_s``.
    """
    for _ in range(INIT_ATTEMPTS - 1):
        try:
            return _run_once(fn, world_size, args, timeout_s, join_group, cancel, output)
        except _InitFailure:
            pass
    return _run_once(fn, world_size, args, timeout_s, join_group, cancel, output)


class _InitFailure(RankFailure):
    """A rank failed inside init_process_group: the transport, not the code under test."""


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout_s: float, join_group: bool,
              cancel: threading.Event | None, output: Path | None) -> list[Any]:
    context = _context()
    results = context.Queue()
    folder = Path(tempfile.mkdtemp(prefix="autopar-ranks-"))
    store = f"file://{folder / 'store'}" if join_group else None  # gloo's FileStore creates the file
    # The fork server's environment is the one it started with: each rank takes the caller's.
    environment = {**LOOPBACK_ENV, **os.environ}
    environment.pop(PARENT_ENV, None)  # the caller's own lifeline is not the ranks
    processes = [context.Process(target=_rank_main, daemon=True,
                                 args=(fn, rank, world_size, store, results, args, environment,
                                       None if output is None else Path(output) / f"rank{rank}.log"))
                 for rank in range(world_size)]
    with _main_hidden():
        for process in processes:
            process.start()
    outcome: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while len(outcome) < world_size:
            rank, stage, value = _next_result(results, processes, outcome, deadline, timeout_s, cancel)
            if stage != "done":
                killed = _killed_by_signal(processes)
                note = "".join(f"\nrank {r} died by signal {-processes[r].exitcode}" for r in killed)
                failure = _InitFailure if stage == "init" and not killed else RankFailure
                raise failure(f"rank {rank} of {world_size} failed:{note}\n{value}", killed, rank, value)
            outcome[rank] = value
    finally:
        for process in processes:
            process.join(timeout=10 if len(outcome) == world_size else 0.1)
            if process.is_alive():
                process.kill()
                process.join()
        shutil.rmtree(folder, ignore_errors=True)
    return [outcome[rank] for rank in range(world_size)]


_STARTING = threading.Lock()  # one start at a time hides __main__ (the proof starts from two threads)


@contextlib.contextmanager
def _main_hidden() -> Iterator[None]:
    """The caller's ``__main__`` hidden while processes start. A multiprocessing child imports the
    main module again (what the ``if __name__ == "__main__":`` idiom guards against): a user's
    script calling autopar's API from its top level would run again in every rank. The ranks'
    functions live in importable modules and need none of it."""
    with _STARTING:
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")  # no __file__, no __spec__: nothing to import
        try:
            yield
        finally:
            sys.modules["__main__"] = main


def _next_result(results: Any, processes: list, outcome: dict[int, Any], deadline: float, timeout_s: float,
                 cancel: threading.Event | None) -> tuple[int, str, Any]:
    """The next (rank, stage, value) a rank put. Raises `Cancelled` once ``cancel`` is set, and
    `RankFailure` for a rank that ended without a result (killed by a signal, or os._exit) once
    its result could no longer be on its way, or for ranks still running past the deadline."""
    while True:
        if cancel is not None and cancel.is_set():
            raise Cancelled("stopped by the caller")
        try:
            return results.get(timeout=POLL_S)
        except queue.Empty:
            pass
        ended = [rank for rank, process in enumerate(processes) if rank not in outcome and process.exitcode is not None]
        if ended:
            try:  # a result put just before its process ended can still be in the pipe: one more look
                return results.get(timeout=POLL_S)
            except queue.Empty:
                pass
            rank, code = ended[0], processes[ended[0]].exitcode
            how = f"died by signal {-code}" if code < 0 else f"exited with status {code} without a result"
            killed = [r for r in ended if processes[r].exitcode < 0]
            raise RankFailure(f"rank {rank} of {len(processes)} failed:\nrank {rank} {how}", killed, rank, how)
        if time.monotonic() > deadline:
            missing = sorted(set(range(len(processes))) - set(outcome))
            raise RankFailure(f"ranks {missing} did not finish within {timeout_s:.0f} s")


def _killed_by_signal(processes: list, wait_s: float = 2.0) -> list[int]:
    """Ranks whose process ended by a signal (checked after a short grace period)."""
    for process in processes:
        process.join(timeout=wait_s / len(processes))
    return [rank for rank, process in enumerate(processes) if process.exitcode is not None and process.exitcode < 0]


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, store: str | None, results: Any, args: tuple,
               environment: dict[str, str], log: Path | None) -> None:
    import torch.distributed as dist

    die_with_parent(os.getppid())  # the fork server, which ends with the process that started it
    if log is not None:
        with open(log, "ab") as file:
            os.dup2(file.fileno(), 1)
            os.dup2(file.fileno(), 2)
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    stage = "init"
    try:
        if store is not None:
            dist.init_process_group(_backend(), init_method=store, rank=rank, world_size=world_size,
                                    timeout=COLLECTIVE_TIMEOUT)
        stage = "call"
        value = fn(rank, world_size, *args)
        results.put((rank, "done", value))
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit from user code
        results.put((rank, stage, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _backend() -> str:
    """gloo, and NCCL for CUDA tensors where there is a GPU (what a generated module picks)."""
    import torch

    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"

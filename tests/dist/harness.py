"""Run a function on N local gloo ranks (one process each) and collect what each returns.

    results = run_ranks(my_fn, world_size=4, arg)   # my_fn(rank, world_size, arg) -> picklable

The function must be importable (defined at module level) because ranks start fresh: each is
forked from multiprocessing's fork server, a process that imported torch (and the distributed
packages generated modules use) once and did nothing else, so a rank starts as clean as a
spawned interpreter without importing torch again (about 3 s of CPU per rank, which on a 2-core
machine is most of a small case's run). A rank gets the caller's environment at the time of the
call (and, as any multiprocessing child, its sys.path and working folder), as a spawned one would.
Ranks meet through a file store in a fresh temporary folder (``file://`` init method), so two
runs at once never race for a TCP port. When any rank raises, the others are stopped and
`RankFailure` carries the failing rank's traceback, so a test failure shows the real error
instead of a hung or silent process group. Ranks that fail to set up gloo itself (inside
init_process_group, before the function runs) are started again once (INIT_ATTEMPTS).
"""
from __future__ import annotations

import os
import queue
import shutil
import socket
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailure(RuntimeError):
    """A rank raised; the message holds its rank number and traceback.

    ``killed`` lists ranks whose process died by a signal (no Python exception: e.g. a C++ abort
    inside the transport), whose peers then fail with lost connections."""

    def __init__(self, message: str, killed: list[int] | None = None):
        super().__init__(message)
        self.killed = killed or []


def free_port() -> int:
    """A TCP port free at the moment of asking (another process may take it before it is used:
    only for launchers that need a port, such as torchrun's rendezvous; ranks of `run_ranks`
    meet through a file store instead)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Imported once by the fork server (torch, what generated modules import, and the autopar
# modules the suites' rank functions import); one that fails to import there is imported by the rank.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.pipelining", "torch.distributed.checkpoint", "autopar.runtime.generated",
           "autopar.codegen", "autopar.solver.planner"]
_CONTEXT = mp.get_context("forkserver")
# How long one collective may wait for its peers before gloo raises (its default is 30 minutes): a
# rank stuck in a collective (seen once: rank 0 spinning in a ring all-reduce whose last message
# never came) fails its test in minutes instead of holding the suite until the harness's timeout.
COLLECTIVE_TIMEOUT = timedelta(seconds=300)
_CONTEXT.set_forkserver_preload(PRELOAD)


# Setting up gloo's full mesh over loopback TCP fails now and then on a loaded machine ("Connection
# closed by peer" inside init_process_group, before any test code runs): such a run is started
# again, all ranks afresh, this many times in all. A failure in the function itself never is.
INIT_ATTEMPTS = 2


class _InitFailure(RankFailure):
    """A rank failed inside init_process_group: the transport, not the code under test."""


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; results by rank."""
    for _ in range(INIT_ATTEMPTS - 1):
        try:
            return _run_once(fn, world_size, args, timeout_s)
        except _InitFailure:
            pass
    return _run_once(fn, world_size, args, timeout_s)


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout_s: float) -> list[Any]:
    context = _CONTEXT
    results = context.Queue()
    folder = Path(tempfile.mkdtemp(prefix="ranks_"))
    store = f"file://{folder / 'store'}"  # the file must not exist yet: gloo's FileStore creates it
    # The fork server's environment is the one it started with: each rank takes the caller's.
    environment = dict(os.environ)
    processes = [context.Process(target=_rank_main, args=(fn, rank, world_size, store, results, args, environment),
                                 daemon=True)
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    outcome: dict[int, Any] = {}
    try:
        while len(outcome) < world_size:
            try:
                rank, stage, value = results.get(timeout=timeout_s)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(outcome))
                raise RankFailure(f"ranks {missing} did not finish within {timeout_s:.0f} s") from None
            if stage != "done":
                killed = _killed_by_signal(processes)
                note = "".join(f"\nrank {r} died by signal {-processes[r].exitcode}" for r in killed)
                failure = _InitFailure if stage == "init" and not killed else RankFailure
                raise failure(f"rank {rank} of {world_size} failed:{note}\n{value}", killed)
            outcome[rank] = value
    finally:
        for process in processes:
            process.join(timeout=10 if len(outcome) == world_size else 0.1)
            if process.is_alive():
                process.kill()
                process.join()
        shutil.rmtree(folder, ignore_errors=True)
    return [outcome[rank] for rank in range(world_size)]


def _killed_by_signal(processes: list, wait_s: float = 2.0) -> list[int]:
    """Ranks whose process ended by a signal (checked after a short grace period)."""
    for process in processes:
        process.join(timeout=wait_s / len(processes))
    return [rank for rank, process in enumerate(processes) if process.exitcode is not None and process.exitcode < 0]


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, store: str, results: Any, args: tuple,
               environment: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    stage = "init"
    try:
        dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world_size,
                                timeout=COLLECTIVE_TIMEOUT)
        stage = "call"
        value = fn(rank, world_size, *args)
        results.put((rank, "done", value))
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit from user code
        results.put((rank, stage, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

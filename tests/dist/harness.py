"""Run a function on N local gloo ranks and collect what each returns: the suites use compile's
own rank launcher (autopar/runtime/forked_ranks.py), so what it does is tested wherever they run.

    results = run_ranks(my_fn, world_size=4, arg)   # my_fn(rank, world_size, arg) -> picklable

The function must be importable (defined at module level): ranks fork from a server process.
"""
from __future__ import annotations

import socket

from autopar.runtime.forked_ranks import RankFailure, run_ranks

__all__ = ["RankFailure", "free_port", "run_ranks"]


def free_port() -> int:
    """A TCP port free at the moment of asking (another process may take it before it is used:
    only for launchers that need a port, such as torchrun's rendezvous; ranks of `run_ranks`
    meet through a file store instead)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

"""torchrun for one machine, with its rendezvous store listening on 127.0.0.1 only.

torchrun's own c10d rendezvous store (``--standalone``) listens on every interface, and torch
offers no option for its address; torch's rendezvous registry does take new backends, so this
registers ``loopback``: the same dynamic rendezvous over a TCPStore given a socket bound to
127.0.0.1 at a free port. The ranks' own store (where the process group meets) is hosted here
too, anew for every attempt (`FreshStorePerAttempt`). Everything else is torchrun's (its
arguments, restarts, logs). Started by autopar, it ends with the process that started it
(autopar/runtime/lifeline.py).

    python -m autopar.runtime.loopback --nproc-per-node=2 [torchrun options] script.py [args]
"""
from __future__ import annotations

import socket
import sys
from datetime import timedelta

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (RendezvousHandler, RendezvousInfo, RendezvousParameters,
                                                  RendezvousStoreInfo)
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as handler_registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from autopar.launch_env import BACKEND, LOOPBACK


class LoopbackBackend(C10dRendezvousBackend):
    """torch's c10d rendezvous state, under this backend's name (torch checks the two agree)."""

    @property
    def name(self) -> str:
        return BACKEND


def loopback_store(timeout: timedelta) -> TCPStore:
    """A store this process hosts on 127.0.0.1, at a port it holds from the start."""
    listener = socket.create_server((LOOPBACK, 0))
    port = listener.getsockname()[1]
    # The store takes over the listening descriptor (detach: Python must not close it).
    return TCPStore(LOOPBACK, port, is_master=True, master_listen_fd=listener.detach(), multi_tenant=True,
                    timeout=timeout)


class FreshStorePerAttempt(RendezvousHandler):
    """torch's dynamic rendezvous, whose ranks meet in a store this agent hosts anew for every
    attempt. Why not torch's two ways: left to rank 0, the store's port is one the agent found
    free and closed again, and rank 0 binds it seconds later, once it has imported torch: anything
    on the machine may take the port meanwhile (a run failed so, "Address already in use", beside
    other runs). torch's shared agent store listens from the start but is kept across restarts,
    where restarted ranks read the dead attempt's addresses (pytorch/pytorch#135712)."""

    def __init__(self, rendezvous: RendezvousHandler, timeout: timedelta):
        self._rendezvous = rendezvous
        self._timeout = timeout
        self.store: TCPStore | None = None

    @property
    def use_agent_store(self) -> bool:
        return True  # the ranks connect to ``self.store`` (TORCHELASTIC_USE_AGENT_STORE)

    def next_rendezvous(self) -> RendezvousInfo:
        met = self._rendezvous.next_rendezvous()
        self.store = loopback_store(self._timeout)  # the last attempt's ranks are gone: its store goes
        return RendezvousInfo(met.store, met.rank, met.world_size, RendezvousStoreInfo(LOOPBACK, self.store.port))

    def get_backend(self) -> str:
        return self._rendezvous.get_backend()

    def is_closed(self) -> bool:
        return self._rendezvous.is_closed()

    def set_closed(self) -> None:
        self._rendezvous.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._rendezvous.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._rendezvous.get_run_id()

    def shutdown(self) -> bool:
        return self._rendezvous.shutdown()


def loopback_handler(params: RendezvousParameters) -> FreshStorePerAttempt:
    """A c10d dynamic rendezvous whose store this process hosts on 127.0.0.1 at a free port."""
    timeout = timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
    store = loopback_store(timeout)
    return FreshStorePerAttempt(create_handler(store, LoopbackBackend(store, params.run_id), params), timeout)


def _calling_method_name(depth: int = 2) -> str:
    """What torch's ``dynamic_rendezvous.get_method_name`` returns (the function ``depth`` frames
    up), read from the frame itself: torch's asks ``inspect.stack()`` twice, which reads the
    source file of every frame on the stack, 0.8 s of each launch's 18 rendezvous events."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return "no_method_name"


def main(argv: list[str]) -> None:
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    from torch.distributed.run import main as torchrun

    from autopar.runtime.lifeline import die_with_parent

    die_with_parent()  # torchrun ends (and stops its ranks) when the autopar that started it ends
    handler_registry.register(BACKEND, loopback_handler)
    if callable(getattr(dynamic_rendezvous, "get_method_name", None)):
        dynamic_rendezvous.get_method_name = _calling_method_name
    torchrun(argv)


if __name__ == "__main__":
    from autopar.runtime.lifeline import end_process

    main(sys.argv[1:])
    end_process(0)

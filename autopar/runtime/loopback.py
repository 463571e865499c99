"""torchrun for one machine, with its rendezvous store listening on 127.0.0.1 only.

torchrun's own c10d rendezvous store (``--standalone``) listens on every interface, and torch
offers no option for its address; torch's rendezvous registry does take new backends, so this
registers ``loopback``: the same dynamic rendezvous over a TCPStore given a socket bound to
127.0.0.1 at a free port. Everything else is torchrun's (its arguments, restarts, logs). Started
by autopar, it ends with the process that started it (autopar/runtime/lifeline.py).

    python -m autopar.runtime.loopback --nproc-per-node=2 [torchrun options] script.py [args]
"""
from __future__ import annotations

import socket
import sys
import uuid
from datetime import timedelta

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as handler_registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, create_handler

LOOPBACK = "127.0.0.1"
BACKEND = "autopar-loopback"


class LoopbackBackend(C10dRendezvousBackend):
    """torch's c10d rendezvous state, under this backend's name (torch checks the two agree)."""

    @property
    def name(self) -> str:
        return BACKEND


def loopback_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    """A c10d dynamic rendezvous whose store this process hosts on 127.0.0.1 at a free port."""
    listener = socket.create_server((LOOPBACK, 0))
    port = listener.getsockname()[1]
    # The store takes over the listening descriptor (detach: Python must not close it).
    store = TCPStore(LOOPBACK, port, is_master=True, master_listen_fd=listener.detach(), multi_tenant=True,
                     timeout=timedelta(seconds=params.get_as_int("read_timeout", 60)))
    return create_handler(store, LoopbackBackend(store, params.run_id), params)


def torchrun_arguments(nproc: int) -> list[str]:
    """The torchrun options of a one-machine run on the loopback rendezvous (what
    ``--standalone`` sets, with this backend)."""
    return [f"--nproc-per-node={nproc}", "--nnodes=1", f"--rdzv-backend={BACKEND}",
            f"--rdzv-endpoint={LOOPBACK}:0", f"--rdzv-id={uuid.uuid4()}", f"--local-addr={LOOPBACK}"]


def main(argv: list[str]) -> None:
    from torch.distributed.run import main as torchrun

    from autopar.runtime.lifeline import die_with_parent

    die_with_parent()  # torchrun ends (and stops its ranks) when the autopar that started it ends
    handler_registry.register(BACKEND, loopback_handler)
    torchrun(argv)


if __name__ == "__main__":
    main(sys.argv[1:])

"""How autopar starts torchrun on one machine, and the environment every torchrun it starts or
writes a script for runs with. Free of imports: the CLI that launches a run reads them without
importing torch (the launcher, autopar/runtime/loopback.py, imports it in its own process)."""
from __future__ import annotations

import uuid

LOOPBACK = "127.0.0.1"
BACKEND = "autopar-loopback"  # the rendezvous backend autopar/runtime/loopback.py registers

# Restarted ranks must not meet in the store of the attempt before: torchrun's agent shares one
# TCPStore across attempts by default, and the new process group then reads the dead ranks'
# addresses (pytorch/pytorch#135712). With sharing off, every attempt gets a fresh store.
STORE_PER_ATTEMPT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun_arguments(nproc: int) -> list[str]:
    """The torchrun options of a one-machine run on the loopback rendezvous (what
    ``--standalone`` sets, with this backend)."""
    return [f"--nproc-per-node={nproc}", "--nnodes=1", f"--rdzv-backend={BACKEND}",
            f"--rdzv-endpoint={LOOPBACK}:0", f"--rdzv-id={uuid.uuid4()}", f"--local-addr={LOOPBACK}"]

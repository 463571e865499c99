"""`autopar run`'s torchrun hosts the ranks' store itself, listening before they start, anew
for every attempt (autopar/runtime/loopback.py)."""
from __future__ import annotations

import re
import textwrap
from datetime import timedelta

from torch.distributed import HashStore, TCPStore
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo

from autopar.runtime.local import run_local
from autopar.runtime.loopback import LOOPBACK, FreshStorePerAttempt
from tests.sockets import LOOPBACK_HEX, listening_addresses


class OneNodeRendezvous(RendezvousHandler):
    """A rendezvous of this node alone, as torchrun's with the rank-0 store (no store of its own)."""

    def __init__(self):
        self.rounds = 0

    def next_rendezvous(self) -> RendezvousInfo:
        self.rounds += 1
        return RendezvousInfo(HashStore(), 0, 1, RendezvousStoreInfo(LOOPBACK, 1))

    def get_backend(self): return "one-node"
    def is_closed(self): return False
    def set_closed(self): pass
    def num_nodes_waiting(self): return 0
    def get_run_id(self): return "test"
    def shutdown(self): return True


def test_every_attempt_meets_in_a_new_store_listening_on_loopback_before_the_ranks_start():
    handler = FreshStorePerAttempt(OneNodeRendezvous(), timedelta(seconds=10))
    assert handler.use_agent_store  # the agent tells the ranks to connect, not to host
    first = handler.next_rendezvous().bootstrap_store_info
    assert first.master_addr == LOOPBACK and listening_addresses(first.master_port) == {LOOPBACK_HEX}
    TCPStore(LOOPBACK, first.master_port, is_master=False, timeout=timedelta(seconds=5)).set("address", "dead rank")
    second = handler.next_rendezvous().bootstrap_store_info
    assert second.master_port != first.master_port and listening_addresses(second.master_port) == {LOOPBACK_HEX}
    assert not TCPStore(LOOPBACK, second.master_port, is_master=False,
                        timeout=timedelta(seconds=5)).check(["address"])


RESTARTED_RANK = textwrap.dedent("""\
    import os, sys, time
    from datetime import timedelta
    from torch.distributed import TCPStore
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                     timeout=timedelta(seconds=60))
    print(f"rank {os.environ['RANK']} attempt {attempt} agent store {os.environ['TORCHELASTIC_USE_AGENT_STORE']} "
          f"port {os.environ['MASTER_PORT']} stale {store.check(['left by attempt 0'])}", flush=True)
    if attempt == 0:  # once both have looked, leave a key and fail
        store.add("looked", 1)
        while store.add("looked", 0) < 2:
            time.sleep(0.05)
        store.set("left by attempt 0", "1")
        sys.exit(3)
""")


def test_a_restarted_run_meets_in_a_fresh_store(tmp_path):
    """Both ranks fail once; the restarted pair finds nothing the first attempt left."""
    (tmp_path / "parallel_stub.py").write_text(RESTARTED_RANK)
    result = run_local(tmp_path, nproc=2, max_restarts=1, timeout_s=120)
    assert result.ok, result.output
    seen = re.findall(r"rank (\d) attempt (\d) agent store (\w+) port (\d+) stale (\w+)", result.output)
    assert sorted((rank, attempt) for rank, attempt, *_ in seen) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    assert {(agent, stale) for _, _, agent, _, stale in seen} == {("True", "False")}
    assert len({port for _, attempt, _, port, _ in seen if attempt == "0"}) == 1
    assert {port for _, attempt, _, port, _ in seen if attempt == "0"} \
        != {port for _, a, _, port, _ in seen if a == "1"}


def test_the_launcher_imports_no_code_generation():
    """The process torchrun runs in imports torch's launcher, not autopar's code generation (which
    took 2 of its 4 seconds of CPU at every launch, in `autopar run` and in compile's check)."""
    import subprocess
    import sys

    probe = "import sys, autopar.runtime.loopback; print(sorted(m for m in sys.modules if m.startswith('autopar')))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert "autopar.runtime.loopback" in loaded
    assert "autopar.codegen" not in loaded and "autopar.runtime.local" not in loaded


def test_the_rendezvous_event_names_are_torchs():
    """The launcher names rendezvous events from the calling frame, as torch's get_method_name
    does from the whole stack (which it reads, with every frame's source file, twice an event)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import get_method_name

    from autopar.runtime.loopback import _calling_method_name

    def caller(name_of):
        return name_of()

    def outer(name_of):
        return caller(name_of)

    assert outer(_calling_method_name) == outer(get_method_name) == "outer"
    assert _calling_method_name(10_000) == get_method_name(10_000) == "no_method_name"

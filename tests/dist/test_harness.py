"""The gloo harness itself: collectives across real processes, and failures that surface."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from autopar.runtime import forked_ranks as harness
from tests.dist.harness import RankFailure, run_ranks


def _all_reduce_rank_ids(rank: int, world_size: int) -> list[float]:
    tensor = torch.tensor([float(rank), 1.0])
    dist.all_reduce(tensor)
    return tensor.tolist()


def _fail_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank one is broken on purpose")
    return rank


def test_all_reduce_over_four_ranks():
    results = run_ranks(_all_reduce_rank_ids, 4)
    assert results == [[6.0, 4.0]] * 4


def _counted_runs(monkeypatch) -> list[int]:
    """How many times run_ranks starts the ranks (its attempts), recorded as they start."""
    attempts: list[int] = []
    run_once = harness._run_once

    def counted(*args, **kwargs):
        attempts.append(1)
        return run_once(*args, **kwargs)

    monkeypatch.setattr(harness, "_run_once", counted)
    return attempts


def test_failing_rank_traceback_is_surfaced(monkeypatch):
    attempts = _counted_runs(monkeypatch)
    with pytest.raises(RankFailure, match=r"rank 1 of 2 failed:(.|\n)*ValueError: rank one is broken on purpose"):
        run_ranks(_fail_on_rank_one, 2, timeout_s=60)
    assert len(attempts) == 1  # a failure of the code under test is never run again


def test_ranks_that_cannot_set_up_gloo_are_started_again_then_reported(monkeypatch):
    attempts = _counted_runs(monkeypatch)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-interface")  # every rank's init_process_group fails
    with pytest.raises(RankFailure, match=r"rank \d of 2 failed:(.|\n)*init_process_group"):
        run_ranks(_all_reduce_rank_ids, 2, timeout_s=60)
    assert len(attempts) == harness.INIT_ATTEMPTS


def _abort_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        os.abort()  # dies by SIGABRT, as a C++ abort in a transport thread would
    dist.all_reduce(torch.ones(1))


def test_rank_killed_by_a_signal_is_named():
    with pytest.raises(RankFailure) as failure:
        run_ranks(_abort_on_rank_one, 2, timeout_s=60)
    assert failure.value.killed == [1]
    assert "rank 1 died by signal 6" in str(failure.value)


def _rendezvous_port(rank: int, world_size: int) -> str | None:
    return os.environ.get("MASTER_PORT")


def test_ranks_meet_without_a_tcp_port():
    """A port picked free and bound later can be taken in between by another run (two test
    test runs at once); the file store needs none."""
    assert run_ranks(_rendezvous_port, 2) == [os.environ.get("MASTER_PORT")] * 2


def _exit_quietly_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)  # no exception, no result: as a library calling exit() from C
    return rank


def test_rank_that_exits_without_a_result_is_named_at_once():
    """Not after the timeout: the wait notices the process is gone."""
    import time

    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 exited with status 3 without a result") as failure:
        run_ranks(_exit_quietly_on_rank_one, 2, timeout_s=120, join_group=False)
    assert failure.value.rank == 1 and time.monotonic() - start < 30


def _say_and_wait(rank: int, world_size: int, seconds: float) -> None:
    import time

    print(f"rank {rank} here", flush=True)
    time.sleep(seconds)


def test_ranks_write_their_output_to_the_folder_given_and_stop_when_cancelled(tmp_path):
    import threading

    cancel = threading.Event()
    timer = threading.Timer(3.0, cancel.set)
    timer.start()
    with pytest.raises(harness.Cancelled):
        run_ranks(_say_and_wait, 2, 600.0, join_group=False, cancel=cancel, output=tmp_path)
    assert sorted(path.read_text() for path in tmp_path.glob("rank*.log")) == ["rank 0 here\n", "rank 1 here\n"]


def _rank_id(rank: int, world_size: int) -> int:
    return rank


def test_ranks_start_where_the_fork_servers_socket_cannot(tmp_path):
    """A TMPDIR deeper than an AF_UNIX socket's path allows (107 bytes) stops the fork server from
    listening: the ranks are spawned instead (a fresh process, so that no server runs yet)."""
    import subprocess
    import sys

    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    code = ("from autopar.runtime.forked_ranks import _context, run_ranks; "
            "from tests.dist.test_harness import _rank_id; "
            "print(_context().get_start_method(), run_ranks(_rank_id, 2))")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(deep)}, capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert done.stdout.split() == ["spawn", "[0,", "1]"], done.stderr[-2000:]

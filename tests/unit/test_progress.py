"""`autopar run`'s progress: the ranks' lines and run.jsonl's new records -> step, losses, rate, ETA."""
from __future__ import annotations

import json

import pytest

from autopar.runtime.progress import PlainDisplay, ProgressState, RecordTail, RunEvents, RunProgress, default_steps


def step_line(step: int, loss: float, tokens: str = "1,234", prefix: str = "") -> str:
    """The generated module's rank-0 line (train.py's timed_step)."""
    return f"{prefix}step {step}  loss {loss:.4f}  40.1 ms  {tokens} tokens/s  peak 512 MiB\n"


def test_step_lines_move_the_state_and_others_do_not():
    state = ProgressState(total_steps=10)
    assert not state.feed_line("warning: model.py changed since the plan was made\n", now=0.0)
    assert state.feed_line(step_line(0, 3.25, "81,234"), now=1.0)
    assert (state.done, state.loss, state.tokens_per_s) == (1, 3.25, 81234.0)
    assert state.feed_line(step_line(1, 3.0, prefix="[rank0]:"), now=3.0)
    assert (state.done, state.loss) == (2, 3.0)


def test_eta_is_the_remaining_steps_at_the_rate_seen():
    state = ProgressState(total_steps=10)
    state.feed_line(step_line(0, 3.0), now=100.0)
    assert state.eta_s() is None  # one step: no rate yet
    state.feed_line(step_line(1, 2.9), now=102.0)
    state.feed_line(step_line(2, 2.8), now=104.0)
    assert state.eta_s() == pytest.approx(7 * 2.0)  # 3 of 10 done, 2 s per step
    assert state.describe() == "step 3/10  loss 2.8000  1,234 tokens/s  ETA 0:00:14"


def test_a_restart_going_back_measures_the_rate_afresh():
    """torchrun restarts every rank; they resume at the last checkpoint (step 4 here), and the
    time the restart took is not a step's."""
    state = ProgressState(total_steps=10)
    for step, now in ((4, 10.0), (5, 11.0), (6, 12.0)):
        state.feed_line(step_line(step, 2.0), now)
    state.feed_line(step_line(4, 2.0), now=60.0)
    assert state.done == 5 and state.eta_s() is None
    state.feed_line(step_line(5, 2.0), now=63.0)
    assert state.eta_s() == pytest.approx(4 * 3.0)


def test_validation_records_add_the_val_loss(tmp_path):
    log = tmp_path / "run.jsonl"
    log.write_text(json.dumps({"step": 0, "loss": 9.0}) + "\n")  # an earlier run: not this one's
    lines = []
    progress = RunProgress(ProgressState(total_steps=4), PlainDisplay(lines.append, clock=lambda: 0.0),
                           RecordTail(log), clock=lambda: 0.0)
    with log.open("a") as out:
        out.write(json.dumps({"step": 0, "loss": 3.5, "tokens_per_s": 10.0}) + "\n")
        out.write(json.dumps({"step": 0, "val_loss": 3.75}) + "\n")
        out.write('{"step": 1, "lo')  # being written: read once complete
    progress.feed_line("something else\n")
    assert (progress.state.step, progress.state.loss, progress.state.val_loss) == (0, 3.5, 3.75)
    assert lines[-1].endswith("step 1/4  loss 3.5000  val loss 3.7500  10 tokens/s")
    with log.open("a") as out:
        out.write('ss": 3.25}\n')
    progress.feed_line("")
    assert (progress.state.step, progress.state.loss) == (1, 3.25)


def test_plain_lines_come_every_ten_seconds_and_at_the_end():
    clock = iter([0.0, 4.0, 9.9, 10.0, 12.0, 13.0])
    lines = []
    display = PlainDisplay(lines.append, interval_s=10.0, clock=lambda: next(clock))
    state = ProgressState(total_steps=6)
    for step in range(5):
        state.feed_line(step_line(step, 2.0 - step / 10), now=float(step))
        display.show(state)
    display.show(state, final=True)
    shown = [line.split("] ", 1)[1].split("  ")[0] for line in lines]
    assert shown == ["step 1/6", "step 4/6", "step 5/6"]
    assert all(line.startswith("[") and line[9] == "]" for line in lines)  # [HH:MM:SS]


def test_default_steps_are_the_modules_own(tmp_path):
    script = tmp_path / "parallel_gpt.py"
    script.write_text('MODEL_FILE = "gpt.py"\nDEFAULT_STEPS = 25\n')
    assert default_steps(script) == 25


def test_checkpoint_skip_rank_death_and_resume_are_one_line_each():
    """What torchrun and the module print when a run changes course, as the run without --echo
    shows it (the lines come from a 2-rank run killed at step 3 with one restart)."""
    lines = []
    events = RunEvents(max_restarts=1)
    progress = RunProgress(ProgressState(total_steps=6), PlainDisplay(lines.append, clock=lambda: 0.0),
                           clock=lambda: 0.0, events=events)
    for line in ("skipping checkpoint /r/checkpoints/step_6: /r/checkpoints/step_6/__0_0.distcp does not match "
                 "its checksum (truncated or overwritten)\n",
                 "E1126 04:12:13.452000 27050 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
                 "(exitcode: -9) local_rank: 1 (pid: 27076) of binary: /usr/bin/python\n",
                 "resumed from /r/checkpoints/step_2 (2 steps done)\n",
                 "[rank0]:failed (exitcode: 3) local_rank: 0 (pid: 1) of binary: python\n"):
        progress.feed_line(line)
    shown = [line.split("] ", 1)[1] for line in lines]
    assert shown == [
        "skipped checkpoint /r/checkpoints/step_6: /r/checkpoints/step_6/__0_0.distcp does not match its checksum "
        "(truncated or overwritten)",
        "rank 1 died (signal SIGKILL); torchrun restarts every rank (restart 1 of 1), resuming from the latest "
        "usable checkpoint if there is one",
        "resumed from step 2 (checkpoint /r/checkpoints/step_2)",
        "rank 0 died (exit 3); no restart is left, so the run stops"]
    assert RunEvents().event("failed (exitcode: 1) local_rank: 0 (pid: 5) of binary: x") == (
        "rank 0 died (exit 1); no restarts allowed (--max-restarts K), so the run stops")
    assert RunEvents().event("step 3  loss 2.0000  1.0 ms  10 tokens/s  peak 1 MiB") is None


def test_a_rank_failing_because_its_peer_was_killed_is_not_named_the_cause():
    """torchrun names the failure with the smallest timestamp, and a rank that raised carries its
    error file's second while a killed rank carries the second torchrun noticed it: under load it
    names the survivor whose collective failed (or that it then stopped). The killed rank is named."""
    events = RunEvents(max_restarts=1, world=2)
    assert events.event("[rank0]:RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                        "[127.0.0.1]:1234") is None
    said = events.event("E1127 failed (exitcode: -15) local_rank: 0 (pid: 7) of binary: python")
    assert said.startswith("rank 1 died without an error of its own (killed by a signal: SIGKILL or the "
                           "out-of-memory killer); rank 0 failed with it (signal SIGTERM); torchrun restarts")
    # The next attempt starts clean: a rank failing of its own is named as torchrun names it.
    assert events.event("failed (exitcode: 1) local_rank: 0 (pid: 9) of binary: python").startswith(
        "rank 0 died (exit 1); no restart is left")
    # Without the world size, or with two candidates, torchrun's choice is all there is.
    unknown = RunEvents(world=None)
    assert unknown.event("failed (exitcode: -15) local_rank: 0 (pid: 7) of binary: x").startswith(
        "rank 0 died (signal SIGTERM)")
    several = RunEvents(world=4)
    assert several.event("[rank2]:Connection reset by peer") is None
    assert several.event("failed (exitcode: -15) local_rank: 0 (pid: 7) of binary: x").startswith(
        "rank 0 died (signal SIGTERM)")


def test_a_death_after_every_rank_finished_is_not_called_a_stop():
    """A rank dying in the process group's teardown after all ranks said they finished is the
    run's own note ("the run counts as finished"), not a line saying the run stops."""
    events = RunEvents()
    for rank in (0, 1):
        assert events.event(f"rank-finished: rank {rank} of 2 attempt 0\n") is None
    assert events.event("failed (exitcode: -6) local_rank: 1 (pid: 7) of binary: python") is None

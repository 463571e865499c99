"""Progress of a local run as it goes: step of total, loss, validation loss, tokens/s and ETA.

`RunProgress` follows the ranks' output lines (`run_local`'s ``on_line``): rank 0's step line
(``step 12  loss 3.2100  40.1 ms  81,234 tokens/s  peak 512 MiB``) moves it at once, and the
records appended to run.jsonl since the run started add what the line does not say (the
validation loss). On a terminal it is a rich progress bar; elsewhere (CI, a pipe) one
timestamped line at the first step, then at most one per `PLAIN_INTERVAL_S`, and one at the end.

What changes the run's course is said in one line each, also without ``--echo`` (`RunEvents`):
a checkpoint skipped because its files no longer match, a rank's death (and torchrun's restart
of every rank, or that none is left), and the step a run resumed from.
"""
from __future__ import annotations

import json
import re
import signal
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from autopar.sections.markers import FINISHED_MARKER

# The generated module's rank-0 step line (train.py's timed_step), maybe under torchrun's [rankN]: prefix.
STEP_LINE = re.compile(r"^(?:\[rank\d+\]:)?step (\d+)  loss (\S+)  [\d.]+ ms  ([\d,.]+) tokens/s")
PLAIN_INTERVAL_S = 10.0
# The module's and torchrun's own lines for the events a run without --echo must still show.
_PREFIX = r"^(?:\[rank\d+\]:)?"
SKIPPED_LINE = re.compile(_PREFIX + r"skipping checkpoint (.+?): (.*)$")
RESUMED_LINE = re.compile(_PREFIX + r"resumed from (.+) \((\d+) steps done\)$")
# torchrun's agent (torch/distributed/elastic/multiprocessing/api.py), when a worker exits non-zero.
RANK_FAILED_LINE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
FINISHED_LINE = re.compile(re.escape(FINISHED_MARKER) + r" rank (\d+) of (\d+) attempt (\d+)")
RANK_LINE = re.compile(r"^\[rank(\d+)\]:")
# A rank that dies takes its peers' collectives down with it: their errors are consequences.
PEER_GONE = ("Connection closed by peer", "remote worker crashing", "Connection reset by peer",
             "Signal 15 (SIGTERM)")


@dataclass
class ProgressState:
    """What the run has shown so far. Steps count from 0; ``done`` is steps finished.

    Attributes:
        total_steps: the step the run stops before (its --steps), or None when unknown.
        step: the last step finished, or None before the first.
        loss, val_loss, tokens_per_s: the latest of each, or None before one is known.
        segment_start: (step, time) of the first step seen since the steps last went back (a
            restart resumes at an earlier step): the ETA's rate is measured from there.
        last_time: when the last step finished.
    """

    total_steps: int | None = None
    step: int | None = None
    loss: float | None = None
    val_loss: float | None = None
    tokens_per_s: float | None = None
    segment_start: tuple[int, float] | None = None
    last_time: float | None = None

    @property
    def done(self) -> int:
        return 0 if self.step is None else self.step + 1

    def finish_step(self, step: int, now: float, loss: float | None = None,
                    tokens_per_s: float | None = None) -> None:
        """Step ``step`` finished at ``now``."""
        if self.step is None or step <= self.step:  # the first step, or a restart going back
            self.segment_start = (step, now)
        self.step, self.last_time = step, now
        self.loss = loss if loss is not None else self.loss
        self.tokens_per_s = tokens_per_s if tokens_per_s is not None else self.tokens_per_s

    def feed_line(self, line: str, now: float) -> bool:
        """Read one output line; whether it was a step line."""
        match = STEP_LINE.match(line.strip())
        if match is None:
            return False
        step, loss, tokens = match.groups()
        self.finish_step(int(step), now, float(loss), float(tokens.replace(",", "")))
        return True

    def feed_record(self, record: dict, now: float) -> bool:
        """Read one run.jsonl record; whether it told something new (a validation loss, or a step
        the output has not shown yet)."""
        if "val_loss" in record:
            self.val_loss = float(record["val_loss"])
            return True
        if "loss" in record and "step" in record and (self.step is None or record["step"] > self.step):
            self.finish_step(int(record["step"]), now, float(record["loss"]), record.get("tokens_per_s"))
            return True
        return False

    def eta_s(self) -> float | None:
        """Seconds left at the rate of the steps since `segment_start`; None until two steps of
        one segment are seen, or without a total."""
        if self.total_steps is None or self.segment_start is None or self.step is None or self.last_time is None:
            return None
        first_step, first_time = self.segment_start
        if self.step == first_step:
            return None
        per_step = (self.last_time - first_time) / (self.step - first_step)
        return max(0, self.total_steps - self.done) * per_step

    def fields(self) -> dict[str, Any]:
        """The shown values, formatted ("" for what is not known yet)."""
        eta = self.eta_s()
        return {"loss": "" if self.loss is None else f"loss {self.loss:.4f}",
                "val_loss": "" if self.val_loss is None else f"val loss {self.val_loss:.4f}",
                "tokens": "" if self.tokens_per_s is None else f"{self.tokens_per_s:,.0f} tokens/s",
                "eta": "" if eta is None else f"ETA {timedelta(seconds=round(eta))}"}

    def describe(self) -> str:
        """One line: ``step 5/20  loss 3.2100  val loss 3.3000  1,234 tokens/s  ETA 0:00:42``."""
        total = "?" if self.total_steps is None else str(self.total_steps)
        return "  ".join([f"step {self.done}/{total}", *(value for value in self.fields().values() if value)])


@dataclass
class RunEvents:
    """Turns the output lines that change a run's course into one line each for the user.

    torchrun names one failed rank per failed attempt: the failure with the smallest timestamp,
    where a rank that raised carries the second its error file was written and a rank killed
    by a signal the second torchrun noticed it. So a rank whose collective failed because a peer
    was killed can be named instead of that peer, or the rank torchrun then stopped (SIGTERM).
    When the named rank's failure is such a consequence and, of the other ranks, exactly one
    showed no consequence of its own, that one is named as the cause.

    Attributes:
        max_restarts: torchrun's ``--max-restarts``: the rank deaths it answers with a restart.
        world: the run's ranks, when known (it lets the cause be named).
        failures: rank failures seen so far (one per torchrun attempt that failed).
        finished: per attempt, the ranks that said they finished; a death after all of them did
            is the teardown failure `autopar run` notes on its own (the run counts as finished).
        peer_gone: ranks whose output since the last failure shows a peer's death.
    """

    max_restarts: int = 0
    world: int | None = None
    failures: int = 0
    finished: dict[str, tuple[int, set[int]]] = field(default_factory=dict)  # attempt -> (world, ranks)
    peer_gone: set[int] = field(default_factory=set)

    def event(self, line: str) -> str | None:
        """The line to show for ``line``, or None when it tells nothing of the kind."""
        text = line.strip()
        skipped = SKIPPED_LINE.match(text)
        if skipped:
            return f"skipped checkpoint {skipped.group(1)}: {skipped.group(2)}"
        resumed = RESUMED_LINE.match(text)
        if resumed:
            return f"resumed from step {resumed.group(2)} (checkpoint {resumed.group(1)})"
        done = FINISHED_LINE.search(text)
        if done:
            self.finished.setdefault(done.group(3), (int(done.group(2)), set()))[1].add(int(done.group(1)))
            return None
        failed = RANK_FAILED_LINE.search(text)
        if failed:
            rank, exitcode = int(failed.group(2)), int(failed.group(1))
            consequences, self.peer_gone = self.peer_gone, set()
            if any(len(ranks) == world for world, ranks in self.finished.values()):
                return None
            return self._rank_failed(rank, exitcode, consequences)
        ranked = RANK_LINE.match(text)
        if ranked and any(symptom in text for symptom in PEER_GONE):
            self.peer_gone.add(int(ranked.group(1)))
        return None

    def _rank_failed(self, rank: int, exitcode: int, consequences: set[int]) -> str:
        self.failures += 1
        how = f"exit {exitcode}" if exitcode >= 0 else f"signal {_signal_name(-exitcode)}"
        died = f"rank {rank} died ({how})"
        if (rank in consequences or exitcode == -signal.SIGTERM) and self.world is not None:
            causes = set(range(self.world)) - consequences - {rank}
            if len(causes) == 1:
                died = (f"rank {causes.pop()} died without an error of its own (killed by a signal: SIGKILL or "
                        f"the out-of-memory killer); rank {rank} failed with it ({how})")
        if self.failures <= self.max_restarts:
            return (f"{died}; torchrun restarts every rank (restart {self.failures} of "
                    f"{self.max_restarts}), resuming from the latest usable checkpoint if there is one")
        left = "no restart is left" if self.max_restarts else "no restarts allowed (--max-restarts K)"
        return f"{died}; {left}, so the run stops"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


class RecordTail:
    """The records appended to a run.jsonl since this was made (a line being written waits)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def read(self) -> list[dict]:
        if not self.path.exists() or self.path.stat().st_size <= self.offset:
            return []
        with open(self.path, "rb") as log:
            log.seek(self.offset)
            chunk = log.read()
        complete = chunk[:chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        records = []
        for line in complete.decode(errors="replace").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # not a record (progress is a view: the run's own reading reports it)
        return records


class PlainDisplay:
    """Timestamped lines for logs: the first step, then at most one per ``interval_s``, and the last."""

    def __init__(self, write: Callable[[str], None], interval_s: float = PLAIN_INTERVAL_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.write, self.interval_s, self.clock = write, interval_s, clock
        self.printed_at: float | None = None
        self.printed = ""

    def show(self, state: ProgressState, final: bool = False) -> None:
        now = self.clock()
        text = state.describe()
        due = self.printed_at is None or now - self.printed_at >= self.interval_s
        if state.step is None or text == self.printed or not (due or final):
            return
        self.write(f"[{time.strftime('%H:%M:%S', time.localtime(now))}] {text}")
        self.printed_at, self.printed = now, text

    def note(self, text: str) -> None:
        """An event line (`RunEvents`), timestamped like the progress lines."""
        self.write(f"[{time.strftime('%H:%M:%S', time.localtime(self.clock()))}] {text}")

    def __enter__(self) -> "PlainDisplay":
        return self

    def __exit__(self, *_) -> None:
        pass


class BarDisplay:
    """A rich progress bar on a terminal."""

    def __init__(self, console: Console, title: str, total_steps: int | None) -> None:
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[loss]}"), TextColumn("{task.fields[val_loss]}"),
                                 TextColumn("{task.fields[tokens]}"), TextColumn("{task.fields[eta]}"),
                                 console=console, transient=False)
        self.task = self.progress.add_task(title, total=total_steps, loss="", val_loss="", tokens="", eta="")

    def show(self, state: ProgressState, final: bool = False) -> None:
        self.progress.update(self.task, total=state.total_steps, completed=state.done, **state.fields())

    def note(self, text: str) -> None:
        """An event line (`RunEvents`), printed above the bar."""
        self.progress.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def __enter__(self) -> "BarDisplay":
        self.progress.start()
        return self

    def __exit__(self, *_) -> None:
        self.progress.stop()


class RunProgress:
    """A run's progress, fed the ranks' output lines; use as a context manager around the run."""

    def __init__(self, state: ProgressState, display: PlainDisplay | BarDisplay, tail: RecordTail | None = None,
                 clock: Callable[[], float] = time.monotonic, events: RunEvents | None = None) -> None:
        self.state, self.display, self.tail, self.clock = state, display, tail, clock
        self.events = events if events is not None else RunEvents()

    @classmethod
    def for_console(cls, console: Console, total_steps: int | None, log: Path, title: str,
                    max_restarts: int = 0, world: int | None = None) -> "RunProgress":
        """A bar on a terminal, timestamped lines elsewhere; run.jsonl read from its current end."""
        if console.is_terminal:
            display: PlainDisplay | BarDisplay = BarDisplay(console, title, total_steps)
        else:
            display = PlainDisplay(lambda text: console.print(text, markup=False, highlight=False, soft_wrap=True))
        return cls(ProgressState(total_steps=total_steps), display, RecordTail(log),
                   events=RunEvents(max_restarts=max_restarts, world=world))

    def feed_line(self, line: str) -> None:
        event = self.events.event(line)
        if event is not None:
            self.display.note(event)
        now = self.clock()
        changed = self.state.feed_line(line, now)
        for record in self.tail.read() if self.tail is not None else []:
            changed = self.state.feed_record(record, now) or changed
        if changed:
            self.display.show(self.state)

    def __enter__(self) -> "RunProgress":
        self.display.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.feed_line("")  # records written after the last line
        self.display.show(self.state, final=True)
        self.display.__exit__(*exc)


def default_steps(script: Path) -> int | None:
    """The generated module's own default step count (its ``DEFAULT_STEPS``), or None."""
    from autopar.runtime.run_settings import module_constants

    return module_constants(script, ("DEFAULT_STEPS",)).get("DEFAULT_STEPS")

"""Progress of a planning verb by phase: tracing, pricing, solving, writing.

On a terminal, one live status line that each phase and each search step rewrites (the incumbent
plan's step time and its gap to the lowest open bound while solving). Anywhere else (CI logs, a
pipe, nohup) a timestamped line per phase and, while solving, at most one line every
``interval_s``, so a long search in a log is not silent.
"""
from __future__ import annotations

import time
from typing import Any, Protocol

from rich.console import Console

from autopar.solver.search import SearchProgress


class Reporter(Protocol):
    """What the driver tells about its progress (see `PhaseProgress`)."""

    def phase(self, text: str) -> None: ...

    def search(self, state: SearchProgress) -> None: ...


def describe(state: SearchProgress) -> str:
    if state.phase == "pricing":
        return f"pricing {state.total:,} candidates (compute floors)"
    text = f"solving: candidate {state.done:,} of {state.total:,} in bound order"
    if state.incumbent_s is not None:
        text += f", best plan so far {state.incumbent_s * 1e3:,.1f} ms/step"
        if state.gap is not None:
            text += f", gap ≤ {state.gap:.1%}"
    return text


class PhaseProgress:
    """A `Reporter` on ``console``: a rich status line on a terminal (starting with ``first``),
    log lines otherwise; a quiet console prints neither."""

    def __init__(self, console: Console, first: str, interval_s: float = 10.0):
        self.console = console
        self.live = console.is_terminal
        self.first = first
        self.interval_s = interval_s
        self.started = time.perf_counter()
        self.last_line = -float("inf")
        self.status: Any = None
        self.search_phase: str | None = None

    def __enter__(self) -> "PhaseProgress":
        if self.live:
            self.status = self.console.status(self.first)
            self.status.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.status is not None:
            self.status.__exit__(*exc)

    def phase(self, text: str) -> None:
        if self.status is not None:
            self.status.update(text + " ...")
        else:
            self._line(text)

    def search(self, state: SearchProgress) -> None:
        if self.status is not None:
            self.status.update(describe(state) + " ...")
        elif state.phase != self.search_phase or time.perf_counter() - self.last_line >= self.interval_s:
            self._line(describe(state))
        self.search_phase = state.phase

    def _line(self, text: str) -> None:
        self.last_line = time.perf_counter()
        self.console.print(f"[{self.last_line - self.started:6.1f} s] {text}", markup=False, highlight=False)

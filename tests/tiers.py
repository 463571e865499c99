"""Test tiers: the default run (`make test`, what CI runs) and the extended one (`make test-full`).

The default run keeps at least one representative of every property (each parallelism technique
trains like one process, checkpoints resume, the safety behaviours, the CLI's exit codes); the
extended tier adds the exhaustive variants of a property already covered by default (the same
check on a second model, at another size, for every combination). A test or a parameter marked
``extended`` is skipped unless pytest runs with ``--extended``.

Suites that run their cases in one shared spawn of ranks (a module- or session-scoped fixture)
ask `selected` which cases this session's tests will read, so a skipped or deselected case is
never run either.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import pytest

EXTENDED = pytest.mark.extended
OPTION = "--extended"


def extended_on(config: pytest.Config) -> bool:
    """Whether this session runs the extended tier too."""
    return bool(config.getoption(OPTION, default=False))


def tiered(values: Iterable[Any], default: Iterable[Any], ids: Iterable[str] | None = None,
           unpack: bool = False) -> list[Any]:
    """``values`` as pytest parameters (each a tuple of several arguments when ``unpack``), those
    outside ``default`` marked extended. At least one
    stays in the default run: a parametrized property always keeps a representative there."""
    default = set(default)
    values = list(values)
    assert any(v in default for v in values), f"no default case among {values}"
    ids = list(ids) if ids is not None else [None] * len(values)
    return [pytest.param(*(v if unpack else (v,)), id=i, marks=() if v in default else EXTENDED)
            for v, i in zip(values, ids)]


def runs(item: pytest.Item) -> bool:
    """Whether ``item`` runs in this session (not an extended test of a default session)."""
    return item.get_closest_marker("extended") is None or extended_on(item.config)


def selected(request: pytest.FixtureRequest, argname: str, fixture: str, where: Path) -> set[Any]:
    """The values of parameter ``argname`` among this session's tests that will run and use
    ``fixture``, in the file or folder ``where`` (another folder may name a fixture alike): the
    cases a shared fixture must produce."""
    found = set()
    for item in session_items(request, fixture, where):
        callspec = getattr(item, "callspec", None)
        if callspec is not None and argname in callspec.params:
            found.add(callspec.params[argname])
    return found


def session_items(request: pytest.FixtureRequest, fixture: str, where: Path) -> list[pytest.Item]:
    """This session's tests in ``where`` that will run and use ``fixture``."""
    return [item for item in request.session.items
            if Path(item.path).resolve().is_relative_to(where) and fixture in getattr(item, "fixturenames", ())
            and runs(item)]

"""The zoo runs a representative subset by default (CI's budget) and every case with
AUTOPAR_ZOO=all (`make test-zoo`); cases outside the subset are deselected, not skipped."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.zoo.cases import CI_CASES

HERE = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "zoo: models autopar did not write, checked against one process (tests/zoo)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    everything = os.environ.get("AUTOPAR_ZOO") == "all"
    kept, dropped = [], []
    for item in items:
        if HERE not in Path(item.fspath).resolve().parents:
            kept.append(item)
            continue
        item.add_marker(pytest.mark.zoo)
        case = getattr(item, "callspec", None) and item.callspec.params.get("case")
        (kept if everything or case is None or case in CI_CASES else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept

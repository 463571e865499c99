"""Shared fixtures (paths of the example models) and the markers each test folder implies."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.tiers import OPTION, runs

# compile's small-scale numerical check (2 steps on gloo ranks against one process, 10-20 s per
# compile on this machine) is off in tests about something else; the tests of the proof
# (tests/dist/test_proof.py) and the zoo turn it on explicitly. The full-scale step on fake
# tensors always runs.
os.environ.setdefault("AUTOPAR_CHECK", "off")
# Profiles kept between runs (autopar/profile_cache.py) are off too: a test's trace must not come
# from another test's run; tests/unit/test_profile_cache.py turns them on in a folder of its own.
os.environ.setdefault("AUTOPAR_PROFILE_CACHE", "off")

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


@pytest.fixture(scope="session")
def examples_dir() -> Path:
    return EXAMPLES


def write_model_file(tmp_path: Path, source: str, name: str = "model.py") -> Path:
    """A throwaway model.py for error-path tests."""
    path = tmp_path / name
    path.write_text(source)
    return path


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(OPTION, action="store_true", default=False,
                     help="also run the extended tier (tests marked extended: exhaustive variants; make test-full)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test by its folder (tests/unit -> unit, tests/dist -> dist) and skip the
    extended tier unless --extended (tests/tiers.py)."""
    skip = pytest.mark.skip(reason=f"extended tier: run with {OPTION} (make test-full)")
    for item in items:
        folder = Path(item.fspath).parent.name
        if folder in ("unit", "dist"):
            item.add_marker(getattr(pytest.mark, folder))
        if not runs(item):
            item.add_marker(skip)

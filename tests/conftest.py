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


# The suites that start ranks, longest first (seconds on 2 cores, `--durations`): `make test`
# hands files to its two workers in this order (--no-loadscope-reorder), the unit files after
# them, so that the last file a worker starts is a short one, not the zoo's while the other
# worker idles.
LONGEST_FIRST = ["dist/test_equivalence.py",  # about 150
                 "dist/test_expert_parallel.py",  # 95
                 "zoo/test_zoo.py",  # 75
                 "dist/test_proof.py",  # 90 in 7 tests
                 "dist/test_compile_cli.py",  # 80
                 "dist/test_interrupts.py",  # 60
                 "dist/test_data_resume.py",  # 55
                 "dist/test_fused_projections.py",  # 40
                 "dist/test_kv_groups.py",  # 40
                 "dist/test_api.py",  # 35
                 "dist/test_received_folders.py",  # 30
                 "dist/test_run_safety.py"]  # 30


def _longest_first(item: pytest.Item) -> int:
    path = Path(item.fspath)
    name = f"{path.parent.name}/{path.name}"
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test by its folder (tests/unit -> unit, tests/dist -> dist), skip the
    extended tier unless --extended (tests/tiers.py), and put the longest files first."""
    skip = pytest.mark.skip(reason=f"extended tier: run with {OPTION} (make test-full)")
    for item in items:
        folder = Path(item.fspath).parent.name
        if folder in ("unit", "dist"):
            item.add_marker(getattr(pytest.mark, folder))
        if not runs(item):
            item.add_marker(skip)
    items.sort(key=_longest_first)  # stable: each file's tests keep their order

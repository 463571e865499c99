"""The equivalence suite's run, shared by the tests that read it (one spawn per world size per
session: tests/dist/equivalence.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist.equivalence import Outcome, run_cases
from tests.tiers import selected

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def outcomes(request, tmp_path_factory) -> dict[str, Outcome]:
    """Per equivalence case this session's tests read (tests/tiers.py): its plan, losses, final
    parameters and issued collectives."""
    return run_cases(tmp_path_factory.mktemp("equivalence"), selected(request, "case_id", "outcomes", HERE))

"""Models people bring, compiled under pinned plans: each case trains exactly like one process
(losses of every step and the final parameters) or is refused at compile with its reason.
Never a crash after compile succeeded, never a different loss. See tests/zoo/harness.py."""
from __future__ import annotations

import os

import pytest

from tests.zoo.cases import ALL_CASES, CI_CASES, KNOWN_FAILURES, REFUSED
from tests.zoo.harness import run_zoo


def _param(case: str):
    known = KNOWN_FAILURES.get(case)
    marks = [pytest.mark.xfail(strict=True, reason=known)] if known else []
    return pytest.param(case, marks=marks, id=case)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Run the cases this pytest run selected (all with AUTOPAR_ZOO=all, else CI's subset)."""
    selected = ALL_CASES if os.environ.get("AUTOPAR_ZOO") == "all" else [c for c in ALL_CASES if c in CI_CASES]
    return run_zoo([tuple(case.split("-")) for case in selected], tmp_path_factory.mktemp("zoo"))


@pytest.mark.parametrize("case", [_param(case) for case in ALL_CASES])
def test_case_trains_like_one_process_or_is_refused(case, outcomes):
    outcome = outcomes[case]
    if case in REFUSED:
        assert outcome.kind == "refused", f"{outcome.kind}: {outcome.detail}"
        assert REFUSED[case] in outcome.detail, outcome.detail
    else:
        assert outcome.kind == "trains", f"{outcome.kind}: {outcome.detail}"

"""Shared fixtures: paths of the example models and small traced profiles reused across tests."""
from __future__ import annotations

from pathlib import Path

import pytest

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

"""The constants fitted to the calibration set (the published runs of
benchmarks/published/runs.yaml marked `calibration: true`), as `python -m benchmarks.published.refit`
last wrote them to calibration.json beside this file.

The file is generated, never edited by hand: it holds each fitted constant (the per-GPU compute
time scale), the out-of-sample residual of every calibration row (priced with every fitted
constant refitted on the other rows), and the prediction interval computed from those
residuals (cost_models.uncertainty reads it; tests/unit/test_calibration.py recomputes it).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

CALIBRATION_FILE = Path(__file__).resolve().parent / "calibration.json"


@functools.cache
def load_calibration() -> dict[str, Any]:
    """The generated calibration (module docstring); read once per process."""
    return json.loads(CALIBRATION_FILE.read_text())

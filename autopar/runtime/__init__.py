"""Running generated modules: local multi-process runs and the single-process reference.

    result = run_local("out/", nproc=4, steps=5)   # torchrun on this machine; result.records

The names below are imported when first used: the launcher (``python -m
autopar.runtime.loopback``) and the proof's fake step (``python -m autopar.runtime.proof``) run
this package's modules in processes of their own, which need none of code generation's imports
(3 of every launch's 4 seconds of imports before).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autopar.runtime.local import RunResult, read_records, run_local
    from autopar.runtime.reference import ReferenceRun, run_reference

_HOMES = {"RunResult": "local", "read_records": "local", "run_local": "local",
          "ReferenceRun": "reference", "run_reference": "reference"}

__all__ = ["ReferenceRun", "RunResult", "read_records", "run_local", "run_reference"]


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"autopar.runtime.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'autopar.runtime' has no attribute {name!r}")

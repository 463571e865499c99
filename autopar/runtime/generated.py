"""Loading a generated module in this process (tests, benchmarks, one-rank memory checks)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def import_generated(script: str | Path, name: str) -> ModuleType:
    """Import ``parallel_<model>.py`` from its file under ``name`` (its top level only defines
    things; ``main()`` is guarded). Registered in sys.modules first: its dataclasses look their
    module up while the file executes."""
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def command_line(module: ModuleType, steps: int = 1, lr: float = 3e-4, argv: list[str] | None = None):
    """The module's parsed arguments with these defaults (as its ``main`` would build them)."""
    return module.parse_args(argv or [], {"steps": steps, "lr": lr, "model_file": module.MODEL_FILE,
                                          "log_file": None})

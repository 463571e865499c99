"""A compiled folder's generated module: found, and loaded in this process (tests, benchmarks,
one-rank memory checks)."""
from __future__ import annotations

from pathlib import Path
from types import ModuleType

from autopar.errors import UserError


def find_script(out_dir: Path) -> Path:
    """The one generated module (parallel_*.py) of a folder `autopar compile` wrote."""
    scripts = sorted(out_dir.glob("parallel_*.py"))
    if len(scripts) != 1:
        raise UserError(f"{out_dir} holds {len(scripts)} generated modules (parallel_*.py), expected one.",
                        "pass the folder `autopar compile` wrote.")
    return scripts[0]


def import_generated(script: str | Path, name: str) -> ModuleType:
    """Import ``parallel_<model>.py`` from its file under ``name`` (its top level only defines
    things; ``main()`` is guarded), the way the generated module imports checkpointing.py beside
    it (registered first: its dataclasses look their module up while the file executes)."""
    from autopar.sections.contract import import_file  # torch: not for the launcher, which only finds the file

    return import_file(script, name)


def command_line(module: ModuleType, steps: int = 1, lr: float = 3e-4, argv: list[str] | None = None):
    """The module's parsed arguments with these defaults (as its ``main`` would build them)."""
    return module.parse_args(argv or [], {"steps": steps, "lr": lr, "model_file": module.MODEL_FILE,
                                          "log_file": None})

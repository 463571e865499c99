"""The package's layering (docs/layout.md): every import, at module level or inside a function,
goes to a module of the same layer or one below, and no modules import each other in a circle.
A stage that reaches back up (the driver's services once imported by runtime/, report/ and
benchmarks/) fails here with the import that does."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Ground first; a module's layer is that of the longest prefix naming it.
LAYERS = [
    ["autopar/errors.py", "autopar/serialize.py", "autopar/data_dependent.py", "autopar/launch_env.py",
     "autopar/model_profile.py", "autopar/domain"],
    ["autopar/sections"],
    ["autopar/user_code.py", "autopar/model_file.py", "autopar/output_dir.py", "autopar/emit"],
    ["autopar/trace", "autopar/profile.py", "autopar/profile_cache.py", "autopar/kept_ops.py"],
    ["cost_models"],
    ["autopar/config.py", "autopar/plans.py", "autopar/specs.py"],
    ["autopar/solver", "autopar/codegen"],
    ["autopar/saved.py", "autopar/report", "autopar/runtime", "autopar/progress.py"],
    ["autopar/driver.py"],
    ["autopar/api.py", "autopar/hydra_app.py", "autopar/sweep.py"],
    ["autopar/cli.py"],
]


def _files() -> list[Path]:
    # A package's __init__ only hands names on (autopar's lazily imports the API it exports).
    return [path for root in ("autopar", "cost_models") for path in sorted((REPO / root).rglob("*.py"))
            if path.name != "__init__.py"]


def _module_file(module: str) -> str | None:
    """The repository file a dotted module name imports, or None outside the two packages."""
    parts = module.split(".")
    if parts[0] not in ("autopar", "cost_models"):
        return None
    for end in range(len(parts), 0, -1):
        candidate = Path(*parts[:end])
        if (REPO / candidate).with_suffix(".py").is_file():
            return str(candidate.with_suffix(".py"))
        if (REPO / candidate).is_dir() and end == len(parts):
            return str(candidate / "__init__.py")
    return None


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported file) of every import in ``path`` (`from package import module` names the module)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            file = _module_file(target)
            if file is not None:
                found.append((node.lineno, file))
    return found


def _layer(file: str) -> int:
    matches = [(len(prefix), index) for index, layer in enumerate(LAYERS) for prefix in layer
               if file == prefix or file.startswith(prefix + "/")]
    assert matches, f"{file} is in no layer of tests/unit/test_layers.py (and docs/layout.md): place it"
    return max(matches)[1]


def test_every_import_goes_down_or_across():
    upward = []
    for path in _files():
        here = str(path.relative_to(REPO))
        for line, target in _imports(path):
            if target.endswith("__init__.py"):
                continue
            if _layer(target) > _layer(here):
                upward.append(f"{here}:{line} imports {target} (layer {_layer(target)} above {_layer(here)})")
    assert not upward, "\n".join(upward)


def test_no_modules_import_each_other_in_a_circle():
    graph = {str(path.relative_to(REPO)): {t for _, t in _imports(path) if not t.endswith("__init__.py")}
             for path in _files()}
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    circles = []

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                walk(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node, [node])
    assert not circles, "\n".join(circles)


def test_the_type_checker_skips_no_module():
    """pyproject.toml's [tool.mypy] reports every module's errors: no override hides a module
    (`ignore_errors`), so a new or changed module cannot go in untyped."""
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]
    skipped = [module for override in config.get("overrides", []) if override.get("ignore_errors")
               for module in override["module"]]
    assert not skipped, skipped

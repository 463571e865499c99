"""Concatenate the runtime sections into one module: merged imports, then each section's code.

Imports from ``autopar.sections`` are dropped (every section shares the generated
file's namespace); the rest are merged per module so the file has one import block, which
keeps only the names the finished module uses (see `ImportBlock.source`).
"""
from __future__ import annotations

import ast
import functools
import textwrap
from importlib import resources
from typing import Callable

from autopar.codegen.specialize import comments_above, last_line

SECTIONS = ("markers", "contract", "mesh", "tensor_parallel", "linear_like", "fused", "recompute", "pipeline",
            "data_parallel", "context_parallel", "expert_parallel", "gradient_sync", "optimizer", "clipping",
            "token_loss", "checkpoint", "pretrained", "metrics", "data", "loader", "batches", "train")
# Sections that depend on no plan: written once beside the training module as their own file
# (section -> file name), which the module imports by path where the section would stand.
BESIDE = {"checkpoint": "checkpointing.py", "pretrained": "pretrained.py", "metrics": "metrics.py",
          "data": "training_data.py", "loader": "data_loading.py"}
_INTERNAL = "autopar"


def section_source(name: str) -> str:
    return resources.files("autopar.sections").joinpath(f"{name}.py").read_text()


class ImportBlock:
    """Imports gathered from several sources, merged and printed in a stable order."""

    def __init__(self) -> None:
        self.plain: set[str] = set()
        self.from_names: dict[str, set[str]] = {}

    def add(self, node: ast.Import | ast.ImportFrom) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                self.plain.add(alias.name if alias.asname is None else f"{alias.name} as {alias.asname}")
            return
        if node.module == "__future__" or (node.module or "").split(".")[0] == _INTERNAL:
            return
        names = self.from_names.setdefault(node.module or "", set())
        for alias in node.names:
            names.add(alias.name if alias.asname is None else f"{alias.name} as {alias.asname}")

    def source(self, used: set[str] | None = None) -> str:
        """The import lines; with ``used``, only imports binding one of those names."""
        def wanted(name: str) -> bool:
            bound = name.split(" as ")[-1] if " as " in name else name.split(".")[0]
            return used is None or bound in used

        plain = {p for p in self.plain if wanted(p)}
        plain -= {p.split(".")[0] for p in plain if "." in p and " as " not in p}  # `import a.b` binds a too
        from_names = {m: {n for n in names if wanted(n)} for m, names in self.from_names.items()}
        from_names = {m: names for m, names in from_names.items() if names}
        stdlib = sorted(p for p in plain if not p.startswith("torch"))
        torch_plain = sorted(p for p in plain if p.startswith("torch"))
        lines = [f"import {p}" for p in stdlib]
        lines += [_from_line(m, n) for m, n in sorted(from_names.items()) if not m.startswith("torch")]
        lines.append("")
        lines += [f"import {p}" for p in torch_plain]
        lines += [_from_line(m, n) for m, n in sorted(from_names.items()) if m.startswith("torch")]
        return "\n".join(lines).strip("\n") + "\n"


def _from_line(module: str, names: set[str]) -> str:
    """``from module import a, b``, wrapped in parentheses at 110 columns as the sections write it."""
    joined = ", ".join(sorted(names))
    line = f"from {module} import {joined}"
    if len(line) <= 110:
        return line
    head = f"from {module} import ("
    return "\n".join(textwrap.wrap(joined + ")", width=110, initial_indent=head, subsequent_indent=" " * len(head),
                                   break_on_hyphens=False, break_long_words=False))


def split_section(source: str, imports: ImportBlock) -> tuple[str, str]:
    """(first line of the module docstring, code without docstring and imports); imports go to ``imports``."""
    summary, code, nodes = _split(source)
    for node in nodes:
        imports.add(node)
    return summary, code


@functools.lru_cache(maxsize=64)
def _split(source: str) -> tuple[str, str, tuple[ast.Import | ast.ImportFrom, ...]]:
    """`split_section`, its imports as nodes: parsed once per section and process (every
    generate split each of the 21 sections again: 0.15 s)."""
    tree = ast.parse(source)
    drop: set[int] = set()
    summary = ""
    body = tree.body
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        summary = first.value.value.strip().splitlines()[0]
        drop.update(range(first.lineno, last_line(first) + 1))
    lines = source.splitlines()
    imports = tuple(node for node in body if isinstance(node, (ast.Import, ast.ImportFrom)))
    for node in imports:
        drop.update(range(node.lineno, last_line(node) + 1))
        # A comment directly above an import explains the import: it goes with it.
        drop.update(range(comments_above(lines, node.lineno, ""), node.lineno))
    lines = [line for number, line in enumerate(lines, start=1) if number not in drop]
    return summary, "\n".join(lines).strip("\n") + "\n", imports


BANNER = "# ===== "


def banner(title: str) -> str:
    """One line naming a section's job, padded with rules to 100 columns when it fits."""
    line = f"{BANNER}{title} "
    return (line + "=" * max(0, 100 - len(line))).rstrip() + "\n"


def assemble_sections(imports: ImportBlock, transform: Callable[[str], str] = lambda code: code) -> str:
    """All sections' code, each passed through ``transform`` (see `specialize.fold`) and put
    under a banner naming its job."""
    parts = []
    for name in SECTIONS:
        if name in BESIDE:
            summary, _ = split_section(section_source(name), ImportBlock())
            module = BESIDE[name].removesuffix(".py")
            parts.append(f"{banner(summary)}\n# The same for every plan: {BESIDE[name]} beside this file.\n"
                         f'{module} = import_file(Path(__file__).with_name("{BESIDE[name]}"), '
                         f'f"{{__name__}}_{module}")\n')
            continue
        summary, code = split_section(section_source(name), imports)
        parts.append(f"{banner(summary)}\n{transform(code)}")
    return "\n\n".join(parts)


@functools.lru_cache(maxsize=None)
def module_beside(name: str) -> str:
    """Section ``name`` as a module of its own (`BESIDE`): its docstring, its imports, its code.
    The same for every plan, so built once per process (every generate parsed the five again)."""
    source = section_source(name)
    imports = ImportBlock()
    _, code = split_section(source, imports)
    docstring = ast.get_docstring(ast.parse(source), clean=False)
    return (f'"""{docstring}"""\nfrom __future__ import annotations\n\n{imports.source().strip(chr(10))}\n\n\n'
            f"{code}")


def drop_empty_sections(source: str) -> str:
    """``source`` without banners that no code follows before the next banner (a section the
    plan does not use, once specialised)."""
    lines = source.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(BANNER)]
    empty: set[int] = set()
    for index, start in enumerate(starts):
        end = starts[index + 1] if index + 1 < len(starts) else len(lines)
        if not any(line.strip() for line in lines[start + 1:end]):
            empty.update(range(start, end))
    return "\n".join(line for i, line in enumerate(lines) if i not in empty) + "\n"

"""Specialise the runtime sections to one plan: fold the branches the plan decides, drop what no
path reaches.

The sections (autopar/sections) are ordinary modules that handle every plan, so they
stay importable and testable on their own. A generated file serves one plan: a dp-only plan
never runs pipeline or context-parallel code, so a reader should not have to read it. Two
source-to-source passes, both on lines so comments survive (``ast.unparse`` would drop them):

    fold    ``if <test>:`` whose test the plan decides (``dims.pp_enabled`` ...) becomes the
            branch the plan takes; statements after a ``return``/``raise`` in the same block go.
    prune   top-level definitions that no root reaches (transitively, by name) go, and so do
            comment lines directly above them.

The plan's facts are values by source text: a flag (``dims.pp_enabled``: False) decides a test
written as it, a number or name (``config.zero_stage``: 2) decides a comparison of known values
(``config.zero_stage <= 1``), in an ``if`` and in a conditional expression (``a if test else b``
becomes the operand taken). A test they do not decide is left alone (correct, just not shortened).
"""
from __future__ import annotations

import ast
import builtins
import functools
import operator
import re
from dataclasses import dataclass
from typing import AbstractSet, Any

_EXITS = (ast.Return, ast.Raise, ast.Continue, ast.Break)


@dataclass(frozen=True)
class _Edit:
    """Replace source lines ``first``..``last`` (1-based, inclusive) by ``lines``."""

    first: int
    last: int
    lines: list[str]


def fold(source: str, facts: dict[str, Any]) -> str:
    """``source`` with every ``if`` and conditional expression whose test ``facts`` decides
    replaced by the branch taken.

    Args:
        source: a module's source.
        facts: expression source text -> its value for this plan (compared as ``ast.unparse``
            writes it, so quotes and spacing do not matter).

    The sections are the same for every plan and most of a plan's facts decide nothing in a
    given section, so a section folded under the same facts of its own is folded once per
    process (a generate spent 0.6 s folding; compile generates twice, for its check).
    """
    texts = _test_texts(source)
    relevant = {text: value for test, value in facts.items() if (text := _normalised(test)) in texts}
    key = (source, tuple(sorted((text, repr(value)) for text, value in relevant.items())))
    if key not in _FOLDED:
        if len(_FOLDED) >= _FOLDED_KEPT:
            _FOLDED.pop(next(iter(_FOLDED)))
        _FOLDED[key] = _fold(source, relevant)
    return _FOLDED[key]


_FOLDED: dict[tuple[str, tuple], str] = {}
_FOLDED_KEPT = 512


@functools.lru_cache(maxsize=None)
def _normalised(test: str) -> str:
    return ast.unparse(ast.parse(test, mode="eval").body)


@functools.lru_cache(maxsize=64)
def _test_texts(source: str) -> frozenset[str]:
    """The text of every expression inside an ``if``'s or a conditional expression's test: all
    that `truth` may look a fact up by."""
    tests = [node.test for node in ast.walk(ast.parse(source)) if isinstance(node, (ast.If, ast.IfExp))]
    return frozenset(ast.unparse(node) for test in tests for node in ast.walk(test) if isinstance(node, ast.expr))


def _fold(source: str, facts: dict[str, Any]) -> str:
    """`fold` with ``facts`` keyed as ``ast.unparse`` writes them."""
    while True:
        lines = source.splitlines()
        edits = _edits(ast.parse(source), lines, facts)
        if not edits:
            return source
        # Parsing dominates (a generated module is thousands of lines), so each pass applies every
        # edit that overlaps no earlier one, bottom-up so line numbers above stay valid; nested
        # ones wait for the next pass.
        chosen: list[_Edit] = []
        for edit in sorted(edits, key=lambda e: (e.first, -e.last)):
            if not chosen or edit.first > chosen[-1].last:
                chosen.append(edit)
        for edit in reversed(chosen):
            lines[edit.first - 1:edit.last] = edit.lines
        source = "\n".join(lines) + "\n"


_COMPARISONS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
                ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
                ast.NotIn: lambda a, b: a not in b}
_UNKNOWN = object()


def _known(node: ast.expr, facts: dict[str, Any]) -> Any:
    """The value of a constant, or of an expression whose text is a fact; else _UNKNOWN."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List)):
        values = [_known(element, facts) for element in node.elts]
        return _UNKNOWN if any(v is _UNKNOWN for v in values) else tuple(values)
    return facts.get(ast.unparse(node), _UNKNOWN)


def truth(test: ast.expr, facts: dict[str, Any]) -> bool | None:
    """The value of ``test`` under ``facts``, or None when they do not decide it."""
    text = ast.unparse(test)
    if text in facts:
        return bool(facts[text])
    if isinstance(test, ast.Compare):
        values = [_known(test.left, facts), *(_known(c, facts) for c in test.comparators)]
        if any(v is _UNKNOWN for v in values) or not all(type(op) in _COMPARISONS for op in test.ops):
            return None
        try:
            return all(_COMPARISONS[type(op)](a, b) for op, a, b in zip(test.ops, values, values[1:]))
        except TypeError:  # values that do not compare: not decided here
            return None
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = truth(test.operand, facts)
        return None if inner is None else not inner
    if isinstance(test, ast.BoolOp):
        values = [truth(value, facts) for value in test.values]
        decisive = isinstance(test.op, ast.Or)  # True decides an `or`, False an `and`
        if decisive in values:
            return decisive
        if None not in values:
            return not decisive
    return None


def _blocks(tree: ast.AST):
    """Every statement list in the tree with the node that owns it."""
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield node, block
        if isinstance(node, ast.Try):
            for handler in node.handlers:
                yield handler, handler.body


def last_line(node: ast.AST) -> int:
    """The last line of a parsed statement (ast.parse sets it on every one)."""
    return getattr(node, "end_lineno", None) or getattr(node, "lineno")


def _edits(tree: ast.Module, lines: list[str], facts: dict[str, Any]) -> list[_Edit]:
    """At most one edit per block (two removals in one block could leave it empty), and one per
    line for conditional expressions."""
    edits = _conditional_expressions(tree, lines, facts)
    for _, block in _blocks(tree):
        edit = next((_Edit(last_line(statement) + 1, last_line(block[-1]), [])  # the rest never runs
                     for statement in block[:-1] if isinstance(statement, _EXITS)), None)
        for statement in block if edit is None else []:
            if isinstance(statement, ast.If) and statement.body[0].lineno > statement.lineno:
                value = truth(statement.test, facts)
                if value is not None:
                    edit = _fold_if(statement, value, lines, alone=len(block) == 1)
                    break
        if edit is not None:
            edits.append(edit)
    return edits


def _conditional_expressions(tree: ast.Module, lines: list[str], facts: dict[str, Any]) -> list[_Edit]:
    """``body if test else orelse`` written on one line, its test decided: the operand taken (an
    operand binds tighter than a conditional expression, so its text stands in for it)."""
    edits: dict[int, _Edit] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.IfExp) or node.lineno != node.end_lineno or node.lineno in edits:
            continue
        value = truth(node.test, facts)
        if value is None:
            continue
        line = lines[node.lineno - 1].encode()  # ast's columns count UTF-8 bytes
        taken = node.body if value else node.orelse
        folded = line[:node.col_offset] + line[taken.col_offset:taken.end_col_offset] + line[node.end_col_offset:]
        edits[node.lineno] = _Edit(node.lineno, node.lineno, [folded.decode()])
    return list(edits.values())


def _fold_if(node: ast.If, value: bool, lines: list[str], alone: bool) -> _Edit:
    indent = " " * node.col_offset
    if value:
        kept = _dedent(lines[node.test.end_lineno:node.body[-1].end_lineno], node.body[0].col_offset - node.col_offset)
    elif not node.orelse:
        kept = []
    elif lines[node.orelse[0].lineno - 1].lstrip().startswith("elif"):
        kept = lines[node.orelse[0].lineno - 1:node.end_lineno]
        kept[0] = kept[0].replace("elif", "if", 1)
    else:
        else_line = next(n for n in range(node.orelse[0].lineno - 1, node.lineno, -1)
                         if lines[n - 1].strip().startswith("else"))
        kept = _dedent(lines[else_line:node.end_lineno], node.orelse[0].col_offset - node.col_offset)
    first = node.lineno
    if not kept:
        first = comments_above(lines, node.lineno, indent)
        kept = [f"{indent}pass"] if alone else []
    return _Edit(first, last_line(node), kept)


def _dedent(lines: list[str], width: int) -> list[str]:
    prefix = " " * width
    return [line[width:] if line.startswith(prefix) else line.lstrip(" ") if not line.strip() else line
            for line in lines]


def comments_above(lines: list[str], lineno: int, indent: str) -> int:
    """The first line of the comment lines directly above line ``lineno`` at ``indent`` (they
    describe what is dropped with it), or ``lineno`` itself."""
    first = lineno
    while first > 1 and lines[first - 2].startswith(indent + "#"):
        first -= 1
    return first


def defined_names(statement: ast.stmt) -> set[str]:
    """Names a top-level statement binds (imports excluded: they are pruned by use)."""
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {statement.name}
    targets = statement.targets if isinstance(statement, ast.Assign) else \
        [statement.target] if isinstance(statement, ast.AnnAssign) else []
    return {node.id for target in targets for node in ast.walk(target) if isinstance(node, ast.Name)}


def referenced_names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def prune(source: str, roots: AbstractSet[str]) -> str:
    """``source`` without the top-level definitions that nothing reachable from ``roots`` (and
    from the statements that define nothing, such as ``if __name__ == "__main__"``) names."""
    tree = ast.parse(source)
    definitions = [(statement, defined_names(statement)) for statement in tree.body
                   if not isinstance(statement, (ast.Import, ast.ImportFrom))]
    by_name = {name: statement for statement, names in definitions for name in names}
    pending = [statement for statement, names in definitions
               if not names and not _is_docstring(statement)] + [by_name[r] for r in roots if r in by_name]
    live: set[int] = set()
    while pending:
        statement = pending.pop()
        if id(statement) in live:
            continue
        live.add(id(statement))
        pending += [by_name[name] for name in referenced_names(statement) if name in by_name]
    lines = source.splitlines()
    for statement, names in reversed(definitions):
        if names and id(statement) not in live:
            start = min([statement.lineno] + [d.lineno for d in getattr(statement, "decorator_list", [])])
            del lines[comments_above(lines, start, "") - 1:statement.end_lineno]
    return tidy_blank_lines("\n".join(lines) + "\n")


def _is_docstring(statement: ast.stmt) -> bool:
    return isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)


def tidy_blank_lines(source: str) -> str:
    """At most two blank lines in a row, as PEP 8 separates top-level definitions."""
    return re.sub(r"\n{4,}", "\n\n\n", source)


def undefined_globals(source: str) -> set[str]:
    """Names the module reads as globals that it neither defines, imports nor gets from
    builtins: what pruning must never leave behind."""
    import symtable

    table = symtable.symtable(source, "<generated>", "exec")
    defined = set(dir(builtins)) | {"__file__", "__name__"}
    defined |= {symbol.get_name() for symbol in table.get_symbols() if symbol.is_assigned() or symbol.is_imported()}
    missing: set[str] = set()

    def visit(scope: symtable.SymbolTable) -> None:
        for symbol in scope.get_symbols():
            if symbol.is_referenced() and (symbol.is_global() or scope is table) and symbol.get_name() not in defined:
                missing.add(symbol.get_name())
        for child in scope.get_children():
            visit(child)

    visit(table)
    return missing

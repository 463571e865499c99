"""The generated module in reading order: the plan, then how it runs, then what that calls.

A reader opens the file at the top: the plan's constants and ``tp_plan()``, then the functions
that apply and train it (`STORY`: parallelize, setup, train_step, train, main), then the
machinery those functions call, section by section. Sections are written bottom-up (a helper
before its caller), so after they are folded and pruned the story's functions are lifted to just
below ``tp_plan()``. Only function definitions move: their bodies run when called, after the
whole file has executed, and the tests import every generated module (a default value or
decorator naming a later definition would fail there).
"""
from __future__ import annotations

import ast

from autopar.codegen.assemble import banner
from autopar.codegen.specialize import comments_above

STORY = ("parallelize", "setup", "train_step", "train", "command_line", "main")
ANCHOR = "tp_plan"  # the story follows the plan's last definition a reader edits
STORY_TITLE = "How the plan runs: parallelize, setup, train_step, train, main (what they call follows)"


def in_reading_order(source: str) -> str:
    """``source`` with the `STORY` functions it defines moved, in that order, under a banner right
    after `ANCHOR`; unchanged when it defines no anchor."""
    tree = ast.parse(source)
    lines = source.splitlines()
    defined = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    if ANCHOR not in defined:
        return source
    spans = []
    for name in STORY:
        node = defined.get(name)
        if node is None:
            continue
        first = min([node.lineno] + [decorator.lineno for decorator in node.decorator_list])
        spans.append((comments_above(lines, first, ""), node.end_lineno or node.lineno))
    moved = {number for start, end in spans for number in range(start, end + 1)}
    story = "\n\n\n".join("\n".join(lines[start - 1:end]) for start, end in spans)
    anchor_end = defined[ANCHOR].end_lineno or defined[ANCHOR].lineno
    before = [line for number, line in enumerate(lines[:anchor_end], start=1) if number not in moved]
    after = [line for number, line in enumerate(lines[anchor_end:], start=anchor_end + 1) if number not in moved]
    text = "\n".join(before).rstrip("\n") + "\n\n\n" + banner(STORY_TITLE) + "\n" + story + "\n\n\n" \
        + "\n".join(after).lstrip("\n")
    while "\n\n\n\n" in text:
        text = text.replace("\n\n\n\n", "\n\n\n")
    return text.rstrip("\n") + "\n"

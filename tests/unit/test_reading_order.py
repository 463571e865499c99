"""The generated module reads top to bottom (autopar/codegen/reading_order.py) and holds no residue
of the sections it was folded from: for plans of the equivalence suite's kinds, `parallelize`
within the first 150 lines and the story's functions in order after tp_plan(), no branch the
plan decides, no value stored and overwritten unread, and no docstring naming a technique the plan
does not use."""
from __future__ import annotations

import ast

import pytest

from autopar.codegen import generate
from autopar.codegen.generate import derive_layout, plan_facts
from autopar.codegen.model_facts import inspect_model
from autopar.codegen.reading_order import STORY
from autopar.codegen.specialize import fold
from tests.dist.plans import GPT, LLAMA, make_plan
from tests.tiers import tiered

PLANS = {
    "dp2": (GPT, dict(dp=2)),
    "zero1_dp2": (GPT, dict(dp=2, zero=1)),
    "zero2_dp2": (GPT, dict(dp=2, zero=2)),
    "zero3_dp4": (GPT, dict(dp=4, zero=3)),
    "tp2_sp": (GPT, dict(tp=2, sp=True)),
    "pp2_interleaved": (GPT, dict(pp=2, schedule="interleaved_1f1b", chunks=2, num_micro_batches=4)),
    "recompute_dp2": (GPT, dict(dp=2, recompute={f"blocks.{i}": m for i, m in enumerate(["full", "selective"])})),
    "tp2_pp2": (GPT, dict(tp=2, pp=2)),
    "zero3_dp2_tp2_pp2": (GPT, dict(dp=2, tp=2, pp=2, zero=3, sp=True)),
    "cp2_ring": (GPT, dict(cp=2, cp_strategy="ring", zero=2)),
    "dp4_hierarchical": (GPT, dict(dp=4, dp_sync="hierarchical", gpus_per_node=2)),
    "dp4_ps": (GPT, dict(dp=4, dp_sync="ps", gpus_per_node=2)),
    "llama_tp2_pp2": (LLAMA, dict(tp=2, pp=2)),
}
DEFAULT = ["dp2", "zero2_dp2", "tp2_pp2", "zero3_dp2_tp2_pp2", "cp2_ring"]
# A dp-only and a tp x pp module of the GPT example: parallelize in the first 150 lines (a model
# whose tensor-parallel styles are more takes more lines of tp_plan() above it).
READ_WITHIN_150 = {"dp2", "tp2_pp2"}
TECHNIQUE_WORDS = {"tensor parallel": "tp", "pipeline": "pp", "context parallel": "cp", "sequence parallel": "sp",
                   "expert parallel": "ep", "recomput": "recompute"}


def _uses(plan, technique: str) -> bool:
    return {"tp": plan.tp > 1, "pp": plan.pp > 1, "cp": plan.cp > 1, "sp": plan.sequence_parallel,
            "ep": plan.ep > 1, "recompute": any(m != "none" for m in plan.recompute.values())}[technique]


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    cache = {}

    def make(case: str):
        if case not in cache:
            model, pins = PLANS[case]
            pins = dict(pins)
            gpus_per_node = pins.pop("gpus_per_node", None)
            plan = make_plan(model, gpus_per_node=gpus_per_node, **pins) if gpus_per_node else make_plan(model, **pins)
            folder = tmp_path_factory.mktemp(case)
            source = generate(plan, model.path, folder, gpus_per_node=gpus_per_node or 8).script.read_text()
            layout = derive_layout(plan, inspect_model(model.path, model.kwargs), gpus_per_node or 8)
            cache[case] = (plan, source, plan_facts(plan, layout))
        return cache[case]
    return make


def dead_stores(source: str) -> list[str]:
    """Names a function stores and stores again, in the same block, before anything reads them."""
    found = []
    for function in (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)):
        for block in (getattr(n, f) for n in ast.walk(function) for f in ("body", "orelse")
                      if isinstance(getattr(n, f, None), list)):
            pending: dict[str, int] = {}
            for statement in block:
                reads = {n.id for n in ast.walk(statement) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
                for name in reads:
                    pending.pop(name, None)
                if isinstance(statement, (ast.Assign, ast.AnnAssign)):
                    targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                    for target in targets:
                        if isinstance(target, ast.Name):
                            if target.id in pending and statement.value is not None:
                                found.append(f"{function.name}: {target.id} (line {pending[target.id]}, "
                                             f"again at {statement.lineno})")
                            pending[target.id] = statement.lineno
                elif not isinstance(statement, ast.Expr) or reads:
                    pending.clear()  # control flow: a later store may not follow this one
    return found


@pytest.mark.parametrize("case", tiered(list(PLANS), DEFAULT))
def test_the_module_reads_from_the_top_and_holds_no_residue(case, generated):
    plan, source, facts = generated(case)
    lines = source.splitlines()
    nodes = {node.name: node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)}
    defined = {name: node.lineno for name, node in nodes.items()}
    if case in READ_WITHIN_150:
        assert defined["parallelize"] <= 150, f"parallelize at line {defined['parallelize']}"
    story = [defined[name] for name in STORY if name in defined]
    assert story == sorted(story) and nodes["tp_plan"].end_lineno < story[0] <= nodes["tp_plan"].end_lineno + 5
    assert fold(source, facts) == source  # no branch the plan decides is left
    assert dead_stores(source) == []
    docstring = ast.get_docstring(next(n for n in ast.parse(source).body
                                       if isinstance(n, ast.FunctionDef) and n.name == "parallelize"))
    stale = [word for word, technique in TECHNIQUE_WORDS.items()
             if word in docstring.lower() and not _uses(plan, technique)]
    assert not stale, f"parallelize's docstring names {stale}, which the plan does not use"
    head = ast.get_docstring(ast.parse(source)).lower()
    assert ("tensor parallelism" in head.split("read from the top")[1]) == (plan.tp > 1)
    assert len(lines) < 2500


def test_dead_stores_are_found():
    """The check itself: an overwritten unread store is found, a store read in between is not."""
    source = "def f(t):\n    a = {}\n    a = t()\n    b = 1\n    print(b)\n    b = 2\n    return a, b\n"
    assert dead_stores(source) == ["f: a (line 2, again at 3)"]

"""Specialising the runtime sections to a plan: folded branches and pruned definitions."""
from __future__ import annotations

import textwrap

from autopar.codegen.specialize import fold, prune, undefined_globals

SOURCE = textwrap.dedent('''
    def setup(config):
        # Pipelines build their stages elsewhere.
        if config.pp_enabled:
            return setup_pipeline(config)
        if not config.cp_enabled:
            batch = plain()
        else:
            # context parallelism shards the sequence
            batch = shard(config)
        if config.tp_enabled and config.cp_enabled:
            twice()
        return batch


    def setup_pipeline(config):
        return stages()


    # Only the pipeline needs this.
    def stages():
        return 1


    def plain():
        return 2


    def shard(config):
        return 3


    def twice():
        return 4


    if __name__ == "__main__":
        setup(None)
''')


def test_decided_branches_are_folded_and_what_nothing_reaches_is_dropped():
    facts = {"config.pp_enabled": False, "config.cp_enabled": False, "config.tp_enabled": True}
    folded = fold(SOURCE, facts)
    assert "if config" not in folded
    assert "batch = plain()" in folded and "batch = shard(config)" not in folded
    assert "# Pipelines build their stages elsewhere." not in folded  # its comment goes with the branch
    pruned = prune(folded, roots=set())
    names = [line.split("(")[0][4:] for line in pruned.splitlines() if line.startswith("def ")]
    assert names == ["setup", "plain"]
    assert "Only the pipeline" not in pruned and undefined_globals(pruned) == set()


def test_the_branch_taken_keeps_its_body_and_code_after_a_return_goes():
    folded = fold(SOURCE, {"config.pp_enabled": True})
    assert folded.splitlines()[2:4] == ["    # Pipelines build their stages elsewhere.",
                                        "    return setup_pipeline(config)"]
    assert "plain()" not in folded.split("def setup_pipeline")[0]  # after the return: never runs
    assert "if not config.cp_enabled" not in folded


def test_undecided_tests_are_left_alone():
    assert fold(SOURCE, {"config.something_else": True}) == SOURCE
    assert undefined_globals("def f():\n    return g()\n") == {"g"}


def test_comparisons_of_known_values_and_conditional_expressions_fold():
    """config.zero_stage = 2 decides `<= 1` (False) and `in (2, 3)` (True); a conditional
    expression keeps the operand its test takes, even after a non-ASCII character on its line;
    a comparison with an unknown side stays."""
    source = textwrap.dedent('''
        def step(config, model):
            if config.zero_stage <= 1:
                sync(model)
            if config.zero_stage in (2, 3):
                shard(model)
            styles = tp_plan() if config.tp_enabled else {}
            label = "π" + ("tp" if config.tp_enabled else "dp")
            if config.zero_stage < model.depth:
                other()
            return styles, label
    ''')
    folded = fold(source, {"config.zero_stage": 2, "config.tp_enabled": False})
    assert "sync(model)" not in folded and "    shard(model)" in folded and "in (2, 3)" not in folded
    assert "styles = {}" in folded and 'label = "π" + ("dp")' in folded
    assert "if config.zero_stage < model.depth:" in folded
    assert "styles = tp_plan()" in fold(source, {"config.tp_enabled": True})


def test_a_section_folds_the_same_under_its_own_facts_as_under_all(monkeypatch):
    """fold keeps one result per section and the facts its tests can look up (`_test_texts`):
    for every section and the facts of plans of every kind, that result is the one folding under
    all the plan's facts gives, and asking again gives it without folding."""
    from autopar.codegen import specialize
    from autopar.codegen.assemble import SECTIONS, ImportBlock, section_source, split_section
    from autopar.codegen.generate import derive_layout, plan_facts
    from autopar.codegen.model_facts import inspect_model
    from tests.dist.plans import GPT, make_plan

    facts = inspect_model(GPT.path, GPT.kwargs)
    plans = [make_plan(GPT, **pins) for pins in (dict(dp=2), dict(dp=4, zero=3), dict(tp=2, sp=True),
                                                 dict(tp=2, pp=2), dict(cp=2, cp_strategy="ring", zero=2))]
    codes = [split_section(section_source(name), ImportBlock())[1] for name in SECTIONS]
    changed = 0
    for plan in plans:
        plan_fact_values = plan_facts(plan, derive_layout(plan, facts, 8))
        everything = {specialize._normalised(test): value for test, value in plan_fact_values.items()}
        for code in codes:
            expected = specialize._fold(code, everything)
            assert fold(code, plan_fact_values) == expected
            changed += expected != code
    assert changed > len(plans)  # the plans' facts do fold their sections
    folds = []
    unkept = specialize._fold
    monkeypatch.setattr(specialize, "_fold", lambda source, facts: folds.append(source) or unkept(source, facts))
    fold(codes[-1], plan_facts(plans[0], derive_layout(plans[0], facts, 8)))
    assert folds == []

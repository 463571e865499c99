"""Figures in the docs that cannot go stale: a paragraph of README.md or docs/*.md that cites a
generated table (benchmarks/results/<benchmark>.md, written by `python -m benchmarks.run`) states
only numbers that table holds; rerunning the benchmark and not the prose fails here."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.run import GENERATED_BY

REPO = Path(__file__).resolve().parents[2]
CITATION = re.compile(r"benchmarks/results/(bench_\w+)\.md")
# A measured quantity: a number followed by its unit (seconds, milliseconds, percent, GiB).
FIGURE = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)(?:\s?(?:s|ms|GiB)\b|%)")


def _paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks, each list item on its own (a bullet cites for itself)."""
    return [part for block in re.split(r"\n\s*\n", text) for part in re.split(r"\n(?=- )", block)]


def _citing_paragraphs() -> list[tuple[str, str, list[str]]]:
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for paragraph in _paragraphs(path.read_text()):
            cited = sorted(set(CITATION.findall(paragraph)))
            if cited:
                found.append((path.name, paragraph, cited))
    return found


def _value(token: str) -> float:
    return float(token.replace(",", ""))


def _numbers(text: str) -> set[float]:
    """Every number the text holds, by value (a table's 15.0 is the prose's 15)."""
    return {_value(token) for token in re.findall(r"\d[\d,]*(?:\.\d+)?", text)}


def test_the_docs_cite_generated_tables():
    assert _citing_paragraphs(), "no paragraph of the docs cites a generated table"


@pytest.mark.parametrize("doc, paragraph, cited", _citing_paragraphs(),
                         ids=lambda value: value if isinstance(value, str) and len(value) < 40 else "")
def test_a_paragraph_states_only_what_the_tables_it_cites_hold(doc, paragraph, cited):
    held: set[float] = set()
    for name in cited:
        table = REPO / "benchmarks" / "results" / f"{name}.md"
        assert table.is_file(), f"{doc} cites {table.name}, which no benchmark run wrote: python -m benchmarks.run"
        text = table.read_text()
        assert text.startswith(GENERATED_BY), f"{table.name} was not written by benchmarks/run.py"
        held |= _numbers(text)
    stale = [figure for figure in FIGURE.findall(paragraph) if _value(figure) not in held]
    assert not stale, (f"{doc}: figures {stale} are not in {', '.join(cited)} (the benchmark moved on, or the "
                       f"figure was typed by hand):\n{paragraph[:300]}")


def test_the_demo_benchmark_trains_what_make_demo_trains():
    """docs/compiling.md quotes `make demo`'s losses and step time from bench_data's table: the
    benchmark compiles with the Makefile's settings (its corpus is a copy of the same sources)."""
    from benchmarks.bench_data import DEMO, DEMO_STEPS

    makefile = (REPO / "Makefile").read_text().replace("\\\n", " ")
    compile_line = next(line for line in makefile.splitlines() if "cluster=cpu_gloo" in line and "compile" in line)
    words = [word.strip('"') for word in compile_line.split()]
    settings = {word for word in words if "=" in word and not word.startswith("data.path=")}
    assert settings == set(DEMO)
    assert f"--steps {DEMO_STEPS}" in makefile

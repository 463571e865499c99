"""The zoo's counts in docs/model_contract.md are the zoo's (tests/zoo/cases.py), not typed by
hand: adding a model or a pin and not the prose fails here."""
from __future__ import annotations

import re
from pathlib import Path

from tests.zoo.cases import ALL_CASES, CI_CASES
from tests.zoo.harness import HF_ARCHS, PINS

DOC = Path(__file__).resolve().parents[2] / "docs" / "model_contract.md"
# Llama with labels= and with eager attention are two more ways of using one architecture.
LLAMA_VARIANTS = {"llama_labels", "llama_eager"}


def _stated(pattern: str) -> tuple[int, ...]:
    found = re.search(pattern, " ".join(DOC.read_text().split()))
    assert found, f"docs/model_contract.md no longer says {pattern!r}"
    return tuple(int(group) for group in found.groups())


def test_the_architecture_count_is_the_zoos():
    assert _stated(r"\((\d+) Hugging Face architectures") == (len(set(HF_ARCHS) - LLAMA_VARIANTS),)


def test_the_case_counts_are_the_zoos():
    two_ranks = sum(PINS[case.rsplit("-", 1)[1]].world_size == 2 for case in ALL_CASES)
    assert _stated(r"subset \((\d+) cases\)") == (len(CI_CASES),)
    assert _stated(r"runs all (\d+) \((\d+) on 2 ranks[^)]*?, (\d+) on 4") == (
        len(ALL_CASES), two_ranks, len(ALL_CASES) - two_ranks)

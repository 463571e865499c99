"""Bad training data through the command line: `compile ... data.path=` refuses before planning and
`autopar run DIR data.path=` before any rank starts; each case exits 1 with one paragraph naming
the file and the fix, and writes nothing (no output folder, no run record, no cache)."""
from __future__ import annotations

from pathlib import Path

import pytest

from autopar.codegen import generate
from tests.dist.plans import GPT, make_plan
from tests.unit.test_bad_input import TINY_GPT, fails

GPT_FILE = str(Path(__file__).resolve().parents[2] / "examples" / "gpt.py")
BYTES_GPT = [arg.replace("model.vocab=128", "model.vocab=260") for arg in TINY_GPT]


def bad_corpora(folder: Path) -> dict[str, tuple[str, tuple[str, ...]]]:
    """case -> (data.path, words the message must hold)."""
    (folder / "empty.txt").write_text("")
    (folder / "table.csv").write_text("text\nhello\n")
    (folder / "short.txt").write_text("a few bytes, far fewer than one global batch of sequences")
    (folder / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    return {
        "missing": (str(folder / "nowhere.txt"), ("nowhere.txt", "no such file")),
        "empty": (str(folder / "empty.txt"), ("empty.txt", "empty")),
        "other format": (str(folder / "table.csv"), ("table.csv", ".csv")),
        "shorter than a batch": (str(folder / "short.txt"), ("short.txt", "global batch")),
        "bad jsonl line": (str(folder / "bad.jsonl"), ("bad.jsonl", "line 2")),
    }


CASES = ["missing", "empty", "other format", "shorter than a batch", "bad jsonl line"]


@pytest.mark.parametrize("case", CASES)
def test_compile_refuses_bad_data_before_planning(case, tmp_path, capsys):
    path, words = bad_corpora(tmp_path)[case]
    out = tmp_path / "out"
    fails(capsys, ["compile", GPT_FILE, *BYTES_GPT, "cluster=cpu_gloo", "cluster.gpus_per_node=2",
                   f"data.path={path}", "--out-dir", str(out)], *words, unwritten=(out,))


def test_compile_refuses_a_tokenizer_the_embedding_cannot_take(tmp_path, capsys):
    (tmp_path / "text.txt").write_text("plenty of text " * 2000)
    out = tmp_path / "out"
    fails(capsys, ["compile", GPT_FILE, *TINY_GPT, "cluster=cpu_gloo", "cluster.gpus_per_node=2",
                   f"data.path={tmp_path / 'text.txt'}", "--out-dir", str(out)],
          "257 token ids", "128 rows", "model.vocab=257", unwritten=(out,))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("compiled") / "gpt"
    generate(make_plan(GPT, dp=2), GPT.path, folder, model_kwargs={**GPT.kwargs, "vocab": 260})
    return folder


@pytest.mark.parametrize("case", CASES)
def test_run_refuses_bad_data_before_any_rank_starts(case, compiled, tmp_path, capsys):
    path, words = bad_corpora(tmp_path)[case]
    fails(capsys, ["run", str(compiled), "--steps", "1", f"data.path={path}"], *words,
          unwritten=(compiled / "run.jsonl", compiled / "data_cache"))


def test_run_refuses_settings_it_does_not_take(compiled, capsys):
    fails(capsys, ["run", str(compiled), "model.layers=8"], "model.layers", "data.")


def test_run_overrides_become_the_module_options_it_declares(compiled, tmp_path):
    from autopar.runtime.generated import find_script
    from autopar.runtime.run_settings import module_arguments, module_options

    accepted = module_options(find_script(compiled))
    assert {"--lr", "--decay-steps", "--eval-every", "--data", "--init-from"} <= accepted
    corpus = tmp_path / "corpus.txt"
    arguments, data = module_arguments([f"data.path={corpus}", "data.val_fraction=0.1", "optim.lr=1e-3",
                                        "optim.decay_steps=100", "train.eval_every=5"], accepted)
    assert arguments == ["--data", f"path={corpus}", "--data", "val_fraction=0.1", "--lr", "1e-3",
                         "--decay-steps", "100", "--eval-every", "5"]
    assert data == [f"path={corpus}", "val_fraction=0.1"]

"""The exit-code contract of every verb: 0 done, 1 a user or environment error in one paragraph
("error: <problem> Fix: <fix>"), 2 a bug in autopar (traceback), 130 Ctrl-C. A model file that
ends the process, a command line argparse cannot read, a file that waits forever at import: 1."""
from __future__ import annotations

import errno
import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autopar.cli import main
from tests.conftest import REPO, write_model_file

MODEL_BODY = """
import torch

class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        {forward}
        return self.proj(x)

def build_model():
    {build}
    return Tiny()

def example_batch(batch_size):
    return torch.zeros(batch_size, 4)
"""


def model_source(top: str = "", build: str = "pass", forward: str = "pass") -> str:
    return "import os\nimport sys\nimport time\n" + top + "\n" + MODEL_BODY.format(build=build, forward=forward)


def one_paragraph_error(err: str, *words: str) -> None:
    """``err`` is a single 'error: ... Fix: ...' paragraph without a traceback, naming ``words``."""
    err = err.strip()
    assert err.startswith("error:") and "Fix:" in err, err
    assert "Traceback" not in err and "\n" not in err, err
    for word in words:
        assert word in err, f"{word!r} missing from: {err}"


def cli(*argv: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """The CLI in its own process (for exits that would end the test's process on today's code)."""
    environment = {**os.environ, "PYTHONPATH": str(REPO), "AUTOPAR_CHECK": "off", **(env or {})}
    return subprocess.run([sys.executable, "-m", "autopar.cli", *argv], capture_output=True, text=True,
                          env=environment, timeout=timeout, cwd=REPO)


# -- a model file that ends the process -----------------------------------------------------------

@pytest.mark.parametrize("top, line", [("raise SystemExit(0)", 4), ("sys.exit()", 4), ("sys.exit(3)", 4)])
def test_model_file_exiting_at_import_is_a_user_error(tmp_path, capsys, top, line):
    model = write_model_file(tmp_path, model_source(top=top))
    out = tmp_path / "out"
    code = main(["compile", str(model), "--out-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 1, err
    one_paragraph_error(err, "Importing model.py raised SystemExit", f"model.py:{line}", "__name__")
    assert not out.exists()


def test_os_exit_zero_at_import_does_not_end_compile_with_success(tmp_path):
    """os._exit(0) used to end `compile` with exit 0 and nothing written."""
    model = write_model_file(tmp_path, model_source(top="os._exit(0)"))
    out = tmp_path / "out"
    done = cli("compile", str(model), "--out-dir", str(out))
    assert done.returncode == 1, done.stderr
    one_paragraph_error(done.stderr, "Importing model.py called os._exit(0)", "model.py:4")
    assert not out.exists()


def test_sys_exit_in_build_model_exits_1_naming_the_function(tmp_path, capsys):
    model = write_model_file(tmp_path, model_source(build="sys.exit(3)"))
    code = main(["compile", str(model), "--out-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1, err
    one_paragraph_error(err, "build_model() in model.py raised SystemExit(3)", "model.py:18, in build_model")


def test_os_exit_in_forward_is_named_not_obeyed(tmp_path):
    model = write_model_file(tmp_path, model_source(forward="os._exit(0)"))
    done = cli("profile", str(model))
    assert done.returncode == 1, done.stderr
    one_paragraph_error(done.stderr, f"{model}:14 (in forward) called os._exit(0)")


def test_generator_exit_from_the_model_file_is_a_user_error(tmp_path, capsys):
    model = write_model_file(tmp_path, model_source(build="raise GeneratorExit"))
    code = main(["profile", str(model)])
    err = capsys.readouterr().err
    assert code == 1, err
    one_paragraph_error(err, "build_model() in model.py raised GeneratorExit")



def test_a_base_exception_of_the_model_files_own_is_a_user_error(tmp_path, capsys):
    model = write_model_file(tmp_path, model_source(top="class Stop(BaseException):\n    pass",
                                                    forward="raise Stop()"))
    code = main(["profile", str(model)])
    err = capsys.readouterr().err
    assert code == 1, err
    one_paragraph_error(err, f"{model}:15 (in forward) raised Stop")

def test_an_exit_inside_autopar_itself_is_reported_as_a_bug(tmp_path, capsys, monkeypatch, examples_dir):
    """The same exit from autopar's own code is no user error: exit 2 with the traceback."""
    import autopar.driver

    monkeypatch.setattr(autopar.driver, "run_profile", functools.partial(sys.exit, 5))
    code = main(["profile", str(examples_dir / "gpt.py")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "internal error" in err and "Traceback" in err



def test_a_sweep_point_whose_model_exits_is_a_failed_point(tmp_path, capsys):
    """Hydra's launcher would take the point's SystemExit for the sweep's own end."""
    model = write_model_file(tmp_path, model_source(forward="sys.exit(0)"))
    sweep = tmp_path / "sweep"
    assert main(["plan", str(model), "cluster=cpu_gloo", "-m", "train.global_batch_size=8,16",
                 f"hydra.sweep.dir={sweep}", "-q"]) == 0
    rows = (sweep / "sweep.csv").read_text().splitlines()[1:]
    assert len(rows) == 2 and all("raised SystemExit(0)" in row and "model.py:14" in row for row in rows), rows

# -- a model file that never finishes importing ----------------------------------------------------

def test_import_that_sleeps_is_stopped_at_the_bound(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AUTOPAR_IMPORT_TIMEOUT_S", "1")
    # The import would take a minute; stopped at the 1 s bound, the command ends in seconds (the
    # margin is the importing process's start, several seconds on a busy 2-core machine).
    model = write_model_file(tmp_path, model_source(top="time.sleep(60)"))
    start = time.monotonic()
    code = main(["profile", str(model)])
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == 1, err
    one_paragraph_error(err, "Importing model.py did not finish within 1 s", "model.py:4",
                        "AUTOPAR_IMPORT_TIMEOUT_S")
    assert elapsed < 30, elapsed


def test_import_that_waits_on_a_lock_forever_is_stopped(tmp_path):
    """Not only sleeps: a wait that never returns (a lock nobody releases) in its own process."""
    model = write_model_file(tmp_path, model_source(top="import threading\nlock = threading.Lock()\n"
                                                         "lock.acquire()\nlock.acquire()"))
    done = cli("profile", str(model), env={"AUTOPAR_IMPORT_TIMEOUT_S": "2"}, timeout=60)
    assert done.returncode == 1, done.stderr
    one_paragraph_error(done.stderr, "did not finish within 2 s", "model.py:7")


def test_the_bound_itself_must_be_a_positive_number(tmp_path, capsys, monkeypatch, examples_dir):
    monkeypatch.setenv("AUTOPAR_IMPORT_TIMEOUT_S", "nan")
    code = main(["profile", str(examples_dir / "gpt.py")])
    err = capsys.readouterr().err
    assert code == 1, err
    one_paragraph_error(err, "AUTOPAR_IMPORT_TIMEOUT_S=nan")


def test_the_default_bound_is_the_one_the_docs_state():
    from autopar.user_code import DEFAULT_IMPORT_TIMEOUT_S

    safety = (REPO / "docs" / "safety.md").read_text()
    assert "AUTOPAR_IMPORT_TIMEOUT_S" in safety and f"{DEFAULT_IMPORT_TIMEOUT_S:g} s" in safety


# -- command lines argparse cannot read -------------------------------------------------------------

@pytest.mark.parametrize("argv, words", [
    ([], ["autopar:", "VERB"]),
    (["fly"], ["invalid choice: 'fly'"]),
    (["compile"], ["autopar compile:", "--out-dir"]),
    (["run", "out", "--bogus"], ["autopar run: unrecognized arguments: --bogus", "autopar run --help"]),
    (["plan", "model.py", "--top-k", "many"], ["autopar plan:", "--top-k", "'many'"]),
    (["validate", "out", "--steps"], ["--steps", "expected one argument"]),
])
def test_usage_errors_exit_1_in_one_paragraph(capsys, argv, words):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 1, err
    one_paragraph_error(err, *words)
    assert "usage:" not in err


def test_help_still_exits_0(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["run", "--help"])
    assert stop.value.code == 0 and "--checkpoint-every" in capsys.readouterr().out


# -- files autopar reads back: report.json, plan.json, run.jsonl -------------------------------------

TINY_GPT = ["cluster=cpu_gloo", "model.layers=1", "model.hidden=64", "model.heads=4", "model.seq_len=16",
            "model.vocab=128", "train.global_batch_size=8", "train.precision=fp32"]


@pytest.fixture(scope="module")
def planned(examples_dir, tmp_path_factory) -> Path:
    """A folder with plan.json and the report files (report.json) of the tiny GPT."""
    folder = tmp_path_factory.mktemp("planned")
    assert main(["plan", str(examples_dir / "gpt.py"), *TINY_GPT, "--out", str(folder / "plan.json"),
                 "--report", str(folder), "-q"]) == 0
    return folder


def _with(folder: Path, name: str, dotted: str, value, into: Path) -> Path:
    """A copy of ``folder`` whose ``name`` JSON has ``value`` at ``dotted`` (a.b.0.c)."""
    import json
    import shutil

    shutil.copytree(folder, into)
    data = json.loads((into / name).read_text())
    node = data
    keys = [int(k) if k.isdigit() else k for k in dotted.split(".")]
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value
    (into / name).write_text(json.dumps(data))
    return into


@pytest.mark.parametrize("field", ["plan.dp", "model_name", "cluster.links", "estimate.tflops_per_gpu",
                                   "estimate.stage_details", "groups", "cluster.hardware.0.peak_tflops"])
def test_report_json_with_a_null_is_a_user_error_naming_the_field(planned, tmp_path, capsys, field):
    folder = _with(planned, "report.json", field, None, tmp_path / "edited")
    code = main(["report", str(folder), "--out-dir", str(tmp_path / "rendered")])
    err = capsys.readouterr().err
    assert code == 1, err
    one_paragraph_error(err, f"{folder / 'report.json'} is not a readable report", "--model")
    if field != "cluster.hardware.0.peak_tflops":  # a free-form entry: named by the failure, not the field
        assert f"{field}: is null" in err
    assert not (tmp_path / "rendered").exists()


def test_saved_plan_predicting_no_step_time_is_refused_before_the_proof(planned, examples_dir, tmp_path, capsys):
    """It used to pass the proof and then fail with ZeroDivisionError (exit 2) writing the report."""
    folder = _with(planned, "plan.json", "predicted.step_time_s", 0, tmp_path / "zero")
    code = main(["compile", str(examples_dir / "gpt.py"), *TINY_GPT, "--plan", str(folder / "plan.json"),
                 "--out-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1, err
    one_paragraph_error(err, "predicts a step time of 0 s")
    assert not (tmp_path / "out").exists()


def test_report_of_a_plan_predicting_no_step_time_renders(planned, tmp_path):
    """The report's comparison with the prediction is left out rather than dividing by zero."""
    from dataclasses import replace

    from autopar.report.document import load_report
    from autopar.report.render import write_report

    report = load_report(planned / "report.json")
    report.plan = replace(report.plan, predicted=replace(report.plan.predicted, step_time_s=0.0))
    files = write_report(report, tmp_path)
    text = files["report.md"].read_text()
    assert "Simulated step" in text and "against the cost model's 0" in text and "%)" not in text.split(
        "against the cost model's")[1].split("\n")[0]


def test_truncated_last_line_of_run_jsonl_is_skipped_and_the_next_record_starts_a_line(tmp_path):
    """A run killed while writing its record leaves half a line: it is skipped (and named), and the
    next run's records do not join it."""
    from autopar.sections.metrics import MetricsLogger
    from autopar.runtime.local import read_records

    log = tmp_path / "run.jsonl"
    log.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "lo')
    assert read_records(log) == [{"step": 1, "loss": 2.5}]
    from autopar.runtime.local import skipped_lines_note, unreadable_lines

    MetricsLogger(log).log({"step": 3, "loss": 2.25})
    MetricsLogger(log).log({"step": 4, "loss": 2.0})
    assert read_records(log) == [{"step": 1, "loss": 2.5}, {"step": 3, "loss": 2.25}, {"step": 4, "loss": 2.0}]
    assert unreadable_lines(log) == [2]
    assert skipped_lines_note(log) == ("note: run.jsonl line 2 is not a JSON record (a run killed while writing "
                                       "it?); skipped")
    assert log.read_text().endswith('{"step": 2, "lo\n{"step": 3, "loss": 2.25}\n{"step": 4, "loss": 2.0}\n')


def test_a_run_jsonl_without_trouble_gets_no_note_and_no_blank_line(tmp_path):
    from autopar.sections.metrics import MetricsLogger
    from autopar.runtime.local import skipped_lines_note

    log = tmp_path / "run.jsonl"
    MetricsLogger(log).log({"step": 1})
    MetricsLogger(log).log({"step": 2})
    assert log.read_text() == '{"step": 1}\n{"step": 2}\n' and skipped_lines_note(log) is None



@pytest.mark.parametrize("content", ['{"time_breakdown": null, "ranks": []}', '[1, 2]', '{}'])
def test_calibrate_from_a_file_that_is_not_validates_is_a_user_error(tmp_path, capsys, content):
    given = tmp_path / "validate.json"
    given.write_text(content)
    code = main(["calibrate", "--from", str(given), "--out", str(tmp_path / "hw.yaml")])
    err = capsys.readouterr().err
    assert code == 1, err
    one_paragraph_error(err, "do not hold what `autopar validate` writes")
    assert not (tmp_path / "hw.yaml").exists()

# -- messages suggest only options the verb has -------------------------------------------------------

VERB_ARGUMENTS = {"profile": ["m.py"], "estimate": ["m.py"], "plan": ["m.py"], "compile": ["m.py", "--out-dir", "o"],
                  "report": ["o"], "validate": ["o"], "run": ["o"], "calibrate": []}
HANDLERS = {"profile": "_profile", "estimate": "_estimate", "plan": "_plan", "compile": "_compile",
            "report": "_report", "validate": "_validate", "run": "_run", "calibrate": "_calibrate"}


def suggested_options(message: str) -> dict[str, set[str]]:
    """verb -> the --options a message names for it: inside "`autopar VERB ...`" for that verb,
    elsewhere (bare) for the verb that printed it (key '')."""
    import re

    found: dict[str, set[str]] = {}
    for verb, rest in re.findall(r"`autopar (\w+)([^`]*)`", message):
        found.setdefault(verb, set()).update(re.findall(r"(?<![\w-])--[a-z][a-z-]*", rest))
    bare = re.sub(r"`autopar \w+[^`]*`", "", message)
    found.setdefault("", set()).update(re.findall(r"(?<![\w-])--[a-z][a-z-]*", bare))
    return found


def parser_options(verb: str) -> set[str]:
    """Every option string the verb's parser accepts."""
    import argparse

    from autopar.cli import build_parser

    verbs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {option for action in verbs.choices[verb]._actions for option in action.option_strings}


def check_options_exist(message: str, verb: str) -> None:
    for named_verb, options in suggested_options(message).items():
        has = parser_options(named_verb or verb) | {"--help"}
        assert options <= has, f"{named_verb or verb} has no {sorted(options - has)}: {message}"


@pytest.mark.parametrize("verb", sorted(VERB_ARGUMENTS))
@pytest.mark.parametrize("number", [errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EISDIR])
def test_environment_errors_suggest_only_the_verbs_own_options(verb, number, capsys, monkeypatch):
    import autopar.cli

    def fail(args, console):
        raise OSError(number, os.strerror(number), "/somewhere/file")

    monkeypatch.setattr(autopar.cli, HANDLERS[verb], fail)
    assert main([verb, *VERB_ARGUMENTS[verb]]) == 1
    err = capsys.readouterr().err
    one_paragraph_error(err, "/somewhere/file")
    check_options_exist(err, verb)


def test_every_autopar_command_a_message_quotes_has_its_options():
    """Messages that quote a command ("`autopar plan ... --out plan.json`") quote only options that
    verb has, in every module of autopar."""
    import re

    quoted = 0
    for path in sorted((REPO / "autopar").rglob("*.py")):
        if "sections" in path.parts:
            continue  # the generated module's own messages name its options, not autopar's
        for verb, rest in re.findall(r"`autopar (\w+)([^`]*)`", path.read_text()):
            if verb in VERB_ARGUMENTS:
                quoted += 1
                check_options_exist(f"`autopar {verb}{rest}`", verb)
    assert quoted > 10


def test_validate_of_a_folder_without_its_model_copy_does_not_suggest_model(planned, tmp_path, capsys):
    """validate prices the folder's own copy of the model file; it has no --model to suggest."""
    import shutil

    folder = tmp_path / "folder"
    shutil.copytree(planned, folder)
    (folder / "report.json").unlink()
    code = main(["validate", str(folder)])
    err = capsys.readouterr().err
    assert code == 1, err
    one_paragraph_error(err, "gpt.py is not there")
    check_options_exist(err, "validate")


def test_validate_with_a_null_in_report_json_is_a_user_error(planned, tmp_path, capsys):
    folder = _with(planned, "report.json", "estimate.stages", None, tmp_path / "folder")
    code = main(["validate", str(folder)])
    err = capsys.readouterr().err
    assert code == 1, err
    one_paragraph_error(err, "is not a readable report", "estimate.stages: is null")


# -- absurd sizes end in bounded time ----------------------------------------------------------------

def test_divisors_come_from_prime_factors_in_milliseconds():
    from autopar.solver.space import divisors

    for n in range(1, 1500):
        assert divisors(n) == tuple(d for d in range(1, n + 1) if n % d == 0), n
    start = time.monotonic()
    assert len(divisors(10**20)) == 21 * 21  # 2^20 * 5^20
    assert divisors(2**61 - 1) == (1, 2**61 - 1)  # a Mersenne prime
    assert divisors(1000000007 * 998244353) == (1, 998244353, 1000000007, 1000000007 * 998244353)
    assert time.monotonic() - start < 2


def test_a_number_without_findable_factors_is_refused_in_bounded_time():
    from autopar.errors import ConfigError
    from autopar.solver.space import divisors

    start = time.monotonic()
    with pytest.raises(ConfigError, match="too large a number to split into parallel degrees"):
        divisors(1000000000000000003 * 1000000000000000009)  # two primes near 10^18
    assert time.monotonic() - start < 15


def test_plan_of_an_absurd_global_batch_ends(examples_dir, tmp_path):
    """train.global_batch_size=10^20 used to hang the search (divisors by a scan up to 10^10)."""
    overrides = [item for item in TINY_GPT if not item.startswith("train.global_batch_size")]
    done = cli("plan", str(examples_dir / "gpt.py"), *overrides, "train.global_batch_size=100000000000000000000",
               "--out", str(tmp_path / "plan.json"), "-q", timeout=240)
    assert done.returncode in (0, 1), done.stderr
    if done.returncode == 1:
        one_paragraph_error(done.stderr, "train.global_batch_size")

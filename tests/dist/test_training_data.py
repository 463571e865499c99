"""Training on a real corpus, or on the model file's own dataset(): every kind of split reads
the samples one process reads.

A text corpus (the standard library's own json package, copied into the test's folder) goes
through the built-in pipeline (UTF-8 bytes, documents packed with an end-of-document token,
the last tenth held out for validation); each plan's generated module trains on it for a few
steps (warmup, cosine decay and gradient clipping active on every step) with the validation loss
every two, and the losses, validation losses and final
parameters must equal one process reading whole global batches in the same global order
(autopar.runtime.reference.ReferenceData). A model file with a ``dataset(split)`` hook
(tests/dist/models/hooked_lm.py: map-style, or a stream that reverses its order each epoch)
trains past an epoch boundary under dp and pp the same way. Tolerances as in test_equivalence.py.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from autopar.codegen import generate
from autopar.runtime import read_records
from autopar.runtime.generated import import_generated
from autopar.runtime.reference import ReferenceData, run_reference
from tests.dist.equivalence import OPTIMIZER
from tests.dist.harness import run_ranks
from tests.dist.plans import GLOBAL_BATCH, GPT, TinyModel, make_planner

STEPS, EVAL_EVERY, EVAL_BATCHES = 4, 2, 2
# Warmup, cosine decay and clipping active on every step (a norm far above 0.05).
TRAINING = {**OPTIMIZER, "lr": 3e-3, "warmup_steps": 2, "schedule": "cosine", "max_grad_norm": 0.05}
# Bytes need 257 ids (256 byte values and the end-of-document token).
BYTE_GPT = replace(GPT, name="gpt_bytes", kwargs={**GPT.kwargs, "vocab": 260})  # profiled apart from GPT
CASES = {
    "dp2": dict(dp=2),
    "zero3_dp2": dict(dp=2, zero=3),
    "tp2": dict(tp=2),
    "pp2": dict(pp=2),
    "cp2": dict(cp=2, cp_strategy="ring", zero=2),
}


HOOKED = TinyModel(name="hooked_lm", path=Path(__file__).parent / "models" / "hooked_lm.py",
                   kwargs=dict(vocab=64, hidden=32, layers=4, seq_len=16), prologue=["embed"], container="blocks",
                   blocks=4, epilogue=["head"])
HOOK_STEPS = 6  # 40 samples at 8 a step: the sixth step starts the second epoch
HOOK_CASES = {
    "hook_dp2": (dict(dp=2), {}),
    "hook_stream_dp2": (dict(dp=2), {"stream": True}),
    "hook_pp2": (dict(pp=2), {}),
    # Labels of -100 on a quarter of the targets or so, a different count per sample: training
    # and validation losses weigh each rank's and micro-batch's mean by its count (token_loss.py).
    "hook_masked_dp2": (dict(dp=2), {"masked": True}),
    "hook_masked_pp2": (dict(pp=2), {"masked": True}),
}


def corpus(folder: Path) -> Path:
    """A small corpus of real text: the json package's sources, one document per file."""
    source = Path(json.__file__).parent
    target = folder / "corpus"
    target.mkdir()
    for path in sorted(source.glob("*.py")):
        shutil.copyfile(path, target / path.name)
    return target


def _run_cases(rank: int, world_size: int, jobs: list[tuple[str, list[str]]]) -> None:
    torch.set_num_threads(1)
    for script, argv in jobs:
        import_generated(script, f"generated_data_{Path(script).parent.name}").main(argv)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    text = corpus(root)
    data = {"path": str(text), "val_fraction": 0.1, "num_workers": 0}
    jobs = []
    for name, pins in CASES.items():
        plan = make_planner(BYTE_GPT, **pins).run().plan
        assert plan.world_size == 2, name
        out = root / name
        files = generate(plan, BYTE_GPT.path, out, model_kwargs=BYTE_GPT.kwargs, optimizer=TRAINING, data=data,
                         eval_every=EVAL_EVERY, eval_batches=EVAL_BATCHES)
        # The harness's ranks are daemon processes, which read in the rank itself (torchrun's
        # ranks read ahead in a worker: the resume tests).
        jobs.append((str(files.script), ["--steps", str(STEPS), "--seed", "0", "--log-file", str(out / "run.jsonl"),
                                         "--save-final", str(out / "final.pt")]))
    references = {}
    for name, (pins, extra) in HOOK_CASES.items():
        plan = make_planner(HOOKED, **pins).run().plan
        out = root / name
        kwargs = {**HOOKED.kwargs, **extra}
        files = generate(plan, HOOKED.path, out, model_kwargs=kwargs, optimizer=TRAINING,
                         eval_every=EVAL_EVERY, eval_batches=EVAL_BATCHES)
        jobs.append((str(files.script), ["--steps", str(HOOK_STEPS), "--seed", "0", "--log-file",
                                         str(out / "run.jsonl"), "--save-final", str(out / "final.pt")]))
        references[name] = run_reference(HOOKED.path, kwargs, GLOBAL_BATCH, HOOK_STEPS, TRAINING,
                                         data=ReferenceData.of(HOOKED.path, kwargs, None, GLOBAL_BATCH),
                                         eval_every=EVAL_EVERY, eval_batches=EVAL_BATCHES)
    run_ranks(_run_cases, 2, jobs, timeout_s=900)
    text = run_reference(BYTE_GPT.path, BYTE_GPT.kwargs, GLOBAL_BATCH, STEPS, TRAINING,
                         data=ReferenceData.of(BYTE_GPT.path, BYTE_GPT.kwargs, data, GLOBAL_BATCH),
                         eval_every=EVAL_EVERY, eval_batches=EVAL_BATCHES)
    references.update({name: text for name in CASES})
    return root, references


@pytest.mark.parametrize("case", list(CASES) + list(HOOK_CASES))
def test_plan_trains_on_the_data_like_one_process(case, runs):
    root, references = runs
    reference = references[case]
    records = read_records(root / case / "run.jsonl")
    steps = [r for r in records if "loss" in r]
    validation = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    torch.testing.assert_close(torch.tensor([r["loss"] for r in steps], dtype=torch.float64),
                               torch.tensor(reference.losses, dtype=torch.float64), rtol=1e-5, atol=0)
    # The clipping norm is the one process's, and clipping acted on every step.
    assert min(reference.grad_norms) > 4 * TRAINING["max_grad_norm"]
    torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in steps], dtype=torch.float64),
                               torch.tensor(reference.grad_norms, dtype=torch.float64), rtol=1e-5, atol=0)
    assert [r["lr"] for r in steps] == pytest.approx(reference.lrs, rel=1e-12)
    steps_run = len(reference.losses)
    assert sorted(validation) == sorted(reference.val_losses) == list(range(EVAL_EVERY, steps_run + 1, EVAL_EVERY))
    for step, value in reference.val_losses.items():
        assert validation[step] == pytest.approx(value, rel=1e-5)
    # Samples consumed: the data position a checkpoint would save.
    assert [r["samples"] for r in steps] == [GLOBAL_BATCH * (s + 1) for s in range(steps_run)]
    final = torch.load(root / case / "final.pt")
    for name, expected in reference.parameters.items():
        torch.testing.assert_close(final[name], expected, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    # Real data: the model learns something in a few steps (random tokens would not move it).
    assert steps[-1]["loss"] < steps[0]["loss"]

"""Fine-tuning a Hugging Face model: the generated module starts from ``--init-from`` a folder
``save_pretrained`` wrote, and ``--export DIR`` writes one ``from_pretrained`` loads.

Each case saves a tiny Hugging Face Llama (random weights from seed 123, not the module's 0),
runs a generated module on 2 gloo ranks from it for 2 steps, and compares with one process of
`transformers` (`reference`: ``from_pretrained`` on the same folder, AdamW, the module's batches):

- the loss the module reports at step 0 is the loss the pretrained model gives on step 0's batch,
  and step 1's follows the same training (rtol 1e-5: sharding reorders fp32 sums only; see
  tests/dist/test_equivalence.py, whose AdamW eps of 1e-6 is used for the same reason);
- the exported folder loads with no missing or unexpected keys, holds exactly the parameters the
  run saved with ``--save-final``, and gives on step 2's batch the loss the reference reaches
  after 2 steps.

The cases cover a sharded safetensors folder (with its index) under DP (FSDP shards) and ZeRO-1
(whose optimizer keeps a copy of the parameters, taken again after loading), and a tied LM head
(the file holds the embedding alone) under TP and under ZeRO-3 with uneven shards (65 rows).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from autopar.cli import main as autopar_main
from autopar.codegen import generate
from autopar.sections.contract import make_batch
from autopar.model_file import call_model, compute_loss, load_model_file
from autopar.runtime import read_records, run_local
from autopar.runtime.generated import import_generated
from tests.dist.equivalence import OPTIMIZER as TESTED
from tests.dist.harness import run_ranks
from tests.dist.plans import GLOBAL_BATCH, LLAMA, REPO, TinyModel, make_plan
from tests.tiers import EXTENDED

# The reference below is transformers' model under torch's plain AdamW: a constant rate, every
# parameter decayed, no clipping, so the module is compiled with those settings.
OPTIMIZER = {**TESTED, "schedule": "constant", "warmup_steps": 0, "max_grad_norm": 0.0, "decay_all": True}

STEPS = 2
PRETRAINED_SEED = 123
TIED_PATH = REPO / "tests" / "dist" / "models" / "llama_tied.py"
TIED = TinyModel(name="llama_tied", path=TIED_PATH, kwargs={}, prologue=["model.embed_tokens"],
                 container="model.layers", blocks=2, epilogue=["model.norm", "lm_head"])
# TP splits the vocabulary: an even one (the ZeRO-3 case keeps 65 for FSDP's uneven shards).
TIED_EVEN = TinyModel(name="llama_tied_even", path=TIED_PATH, kwargs=dict(vocab=64), prologue=TIED.prologue,
                      container=TIED.container, blocks=2, epilogue=TIED.epilogue)


@dataclass(frozen=True)
class Case:
    name: str
    model: TinyModel
    pins: dict
    shard_size: str | None = None  # save_pretrained's max_shard_size: several files and an index


CASES = [
    Case("dp2_sharded_folder", LLAMA, dict(dp=2), shard_size="20KB"),
    Case("zero1_dp2", LLAMA, dict(dp=2, zero=1)),
    Case("tp2_tied", TIED_EVEN, dict(tp=2)),
    Case("zero3_dp2_tied_uneven", TIED, dict(dp=2, zero=3)),
]


def save_pretrained(model: TinyModel, folder: Path, shard_size: str | None = None) -> Path:
    """The model with seed-123 weights, as save_pretrained writes it."""
    module = load_model_file(model.path)
    torch.manual_seed(PRETRAINED_SEED)
    hf = module.build_model(**model.kwargs)
    hf.save_pretrained(folder, **({"max_shard_size": shard_size} if shard_size else {}))
    return folder


def batch(model: TinyModel, step: int) -> dict:
    """Step ``step``'s global batch, as the module draws it (seed 0 + 1 + step)."""
    return make_batch(load_model_file(model.path), model.kwargs, GLOBAL_BATCH, 1 + step)


def loss_on(hf: torch.nn.Module, model: TinyModel, step: int) -> float:
    module = load_model_file(model.path)
    data = batch(model, step)
    with torch.no_grad():
        return compute_loss(module, call_model(hf, data), data).item()


def reference(model: TinyModel, folder: Path, steps: int) -> list[float]:
    """Losses of ``steps`` + 1 steps of one process from ``from_pretrained(folder)``: the last is
    the loss on step ``steps``'s batch of the weights trained ``steps`` steps."""
    module = load_model_file(model.path)
    hf = AutoModelForCausalLM.from_pretrained(folder)
    hf.train()
    adamw = torch.optim.AdamW(hf.parameters(), lr=OPTIMIZER["lr"], betas=tuple(OPTIMIZER["betas"]),
                              eps=OPTIMIZER["eps"], weight_decay=OPTIMIZER["weight_decay"])
    losses = []
    for step in range(steps + 1):
        data = batch(model, step)
        loss = compute_loss(module, call_model(hf, data), data)
        losses.append(loss.item())
        loss.backward()
        adamw.step()
        adamw.zero_grad()
    return losses


def _run_modules(rank: int, world_size: int, jobs: list[tuple[str, str, list[str]]]) -> None:
    torch.set_num_threads(1)
    for name, script, argv in jobs:
        import_generated(script, f"generated_pretrained_{name}").main(argv)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Every case generated, saved and run (one spawn of 2 ranks runs them in turn)."""
    root = tmp_path_factory.mktemp("pretrained")
    jobs = []
    for case in CASES:
        out = root / case.name
        files = generate(make_plan(case.model, **case.pins), case.model.path, out, model_kwargs=case.model.kwargs,
                         optimizer=OPTIMIZER)
        hf = save_pretrained(case.model, out / "pretrained", case.shard_size)
        jobs.append((case.name, str(files.script),
                     ["--steps", str(STEPS), "--log-file", str(out / "run.jsonl"), "--init-from", str(hf),
                      "--export", str(out / "exported"), "--save-final", str(out / "final.pt")]))
    run_ranks(_run_modules, 2, jobs, timeout_s=900)
    return {case.name: root / case.name for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_run_starts_from_the_pretrained_weights_and_exports_a_folder_transformers_loads(case, runs):
    out = runs[case.name]
    if case.shard_size:
        assert (out / "pretrained" / "model.safetensors.index.json").is_file()
    expected = reference(case.model, out / "pretrained", STEPS)
    losses = [record["loss"] for record in read_records(out / "run.jsonl")]
    assert losses == pytest.approx(expected[:STEPS], rel=1e-5)
    exported, info = AutoModelForCausalLM.from_pretrained(out / "exported", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    final = torch.load(out / "final.pt")
    assert all(torch.equal(parameter, final[name]) for name, parameter in exported.named_parameters())
    assert loss_on(exported, case.model, STEPS) == pytest.approx(expected[STEPS], rel=1e-5)
    if case.model is not LLAMA:  # tied: the head is left out of the file, as save_pretrained leaves it
        assert "lm_head.weight" not in load_file(out / "exported" / "model.safetensors")
        assert exported.lm_head.weight is exported.model.embed_tokens.weight


@pytest.mark.slow
@EXTENDED
def test_autopar_run_init_from_then_a_resume_keeps_the_checkpoint_and_export_consolidates_it(tmp_path, monkeypatch):
    """`autopar run --init-from` (relative paths, from the caller's folder) trains from the
    pretrained weights; a second run resumes its checkpoint instead of loading them again; and
    `python parallel_x.py --export DIR` (no torchrun) writes the latest checkpoint as a folder."""
    folder = tmp_path / "compiled"
    files = generate(make_plan(LLAMA, dp=2), LLAMA.path, folder, optimizer=OPTIMIZER)
    save_pretrained(LLAMA, tmp_path / "hf")
    monkeypatch.chdir(tmp_path)
    assert autopar_main(["run", "compiled", "--steps", "1", "--checkpoint-every", "1", "--init-from", "hf",
                         "--export", "out_run"]) == 0
    expected = reference(LLAMA, tmp_path / "hf", STEPS)
    first = read_records(folder / "run.jsonl")
    assert [r["loss"] for r in first] == pytest.approx(expected[:1], rel=1e-5)
    assert json.loads((tmp_path / "out_run" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]

    resumed = run_local(folder, steps=STEPS, init_from=tmp_path / "hf", extra_args=["--checkpoint-every", "1"],
                        timeout_s=300)
    assert resumed.ok, resumed.error
    assert "not loaded: the checkpoint resumed (1 steps done) wins" in resumed.output
    assert [r["step"] for r in resumed.records] == [1]
    assert resumed.records[0]["loss"] == pytest.approx(expected[1], rel=1e-5)

    monkeypatch.delenv("RANK", raising=False)
    import_generated(files.script, "generated_pretrained_export").main(["--export", str(tmp_path / "out_ckpt")])
    exported, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out_ckpt", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert loss_on(exported, LLAMA, STEPS) == pytest.approx(expected[STEPS], rel=1e-5)

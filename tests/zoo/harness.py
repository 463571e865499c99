"""The zoo: models autopar did not write, compiled under pinned plans and checked against one process.

A *case* is a model (a model.py and its settings) and a pin (the plan's degrees, everything else
the planner's). Each case ends in one of four outcomes:

- ``trains``: the generated module trained `STEPS` steps on gloo ranks with the losses and final
  parameters of the unsharded model on one process (tolerances of tests/dist/test_equivalence.py);
- ``refused``: profile, plan, code generation or compile's proof (autopar/runtime/proof.py: a
  step at full scale on fake tensors, 2 steps on gloo ranks against one process) refused it with
  a user error (the reason kept); the proof moves past plans that fail to the next one honouring
  the pin, so a case trains when any plan under its pin does;
- ``crash``: compile succeeded and the run failed, or compile failed with something other than a
  user error (an autopar bug either way);
- ``different``: it ran but trained something else (loss or parameters differ).

Cases of one model and world size share one spawn of ranks; a case that crashes ends the spawn,
and the cases after it run in a fresh one.
"""
from __future__ import annotations

import re
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autopar.codegen import generate
from autopar.codegen.generate import DEFAULT_OPTIMIZER
from autopar.config import compose_config
from autopar.driver import run_compile
from autopar.errors import UserError
from autopar.model_file import load_model_file
from autopar.profile import profile_model
from autopar.runtime import read_records, run_reference
from autopar.runtime.generated import import_generated
from autopar.runtime.proof import CHECK_EPS
from tests.dist.harness import RankFailure, run_ranks

MODELS_DIR = Path(__file__).resolve().parent / "models"
EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
STEPS = 3
GLOBAL_BATCH = 8
# AdamW's eps of compile's check (autopar/runtime/proof.py says why): the zoo's own run against
# one process holds the plan compile wrote to the same numbers.
OPTIMIZER = {**DEFAULT_OPTIMIZER, "eps": CHECK_EPS}
_FAILED = "zoo case failed: "


@dataclass(frozen=True)
class ZooModel:
    """A model file with the settings it is compiled at."""

    name: str
    path: Path
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Pin:
    """Pinned plan decisions (the rest is searched)."""

    name: str
    pins: dict[str, Any]
    ranks: int = 0  # ranks of a pin that fixes no degree (the planner's first plan); else the degrees'

    @property
    def world_size(self) -> int:
        p = self.pins
        return self.ranks or p.get("dp", 1) * p.get("tp", 1) * p.get("pp", 1) * p.get("cp", 1)


def _hf(arch: str, **kwargs: Any) -> ZooModel:
    return ZooModel(f"hf_{arch}", MODELS_DIR / "hf_zoo.py", {"arch": arch, **kwargs})


HF_ARCHS = ["llama", "qwen2", "qwen3", "mistral", "mixtral", "phi3", "phi", "gemma", "gemma2", "gpt2", "gpt_neox",
            "falcon", "opt", "stablelm", "bloom", "gptj", "olmo", "granite", "qwen2_moe", "deepseek_v3",
            "llama_labels", "llama_eager", "bert", "roberta", "bert_mlm", "t5", "vit", "whisper", "clip",
            "wav2vec2_ctc", "persimmon", "mamba", "modernbert", "convnext", "bart", "swin",
            "dbrx", "codegen", "gpt_bigcode", "qwen3_moe", "deberta_v2", "starcoder2", "cohere", "olmo2", "gemma3",
            "nemotron", "glm4", "granitemoe", "olmoe", "smollm3", "exaone4", "lfm2", "mpt", "gpt_neo", "biogpt",
            "xglm", "diffllama", "deepseek_v2", "jetmoe", "ernie4_5", "cohere2", "gpt_oss", "apertus", "arcee"]
MODELS = {m.name: m for m in [
    *(_hf(arch) for arch in HF_ARCHS),
    ZooModel("nanogpt", MODELS_DIR / "nanogpt.py"),
    ZooModel("encdec", MODELS_DIR / "encdec.py"),
    ZooModel("frozen", MODELS_DIR / "frozen.py"),
    ZooModel("cnn", EXAMPLES_DIR / "cnn.py", {"width": 8, "blocks": 4, "image": 8}),
    ZooModel("gpt", EXAMPLES_DIR / "gpt.py", {"layers": 2, "hidden": 32, "heads": 4, "seq_len": 16, "vocab": 64}),
    # Attention and MLPs written the common ways tensor parallelism must split (fused_layouts.py).
    ZooModel("fused_qkv", MODELS_DIR / "fused_layouts.py", {"layout": "split"}),
    ZooModel("neox_qkv", MODELS_DIR / "fused_layouts.py", {"layout": "interleaved"}),
    ZooModel("global_views", MODELS_DIR / "fused_layouts.py", {"layout": "global_views"}),
    # Shapes and branches that depend on values: nonzero experts, a labels check, a boolean-mask loss.
    ZooModel("value_dependent", MODELS_DIR / "value_dependent.py"),
    # An LSTM given positions: its recurrence must keep context parallelism out at profile.
    ZooModel("recurrent", MODELS_DIR / "recurrent.py"),
    # Forward reads values through NumPy: no fake tensor runs it, so it is traced with real ones.
    ZooModel("untraceable", MODELS_DIR / "untraceable.py"),
]}
PINS = {p.name: p for p in [
    Pin("dp2", dict(dp=2, tp=1, pp=1, cp=1, zero_stage=0)),
    Pin("zero3", dict(dp=2, tp=1, pp=1, cp=1, zero_stage=3)),
    Pin("tp2", dict(dp=1, tp=2, pp=1, cp=1)),
    Pin("tp4", dict(dp=1, tp=4, pp=1, cp=1)),
    Pin("pp2", dict(dp=1, tp=1, pp=2, cp=1)),
    Pin("cp2", dict(dp=1, tp=1, pp=1, cp=2)),
    Pin("zero3_dp4", dict(dp=4, tp=1, pp=1, cp=1, zero_stage=3)),
    Pin("dp2_tp2", dict(dp=2, tp=2, pp=1, cp=1)),
    Pin("dp2_pp2", dict(dp=2, tp=1, pp=2, cp=1)),
    Pin("tp2_pp2", dict(dp=1, tp=2, pp=2, cp=1)),
    Pin("dp2_cp2", dict(dp=2, tp=1, pp=1, cp=2)),
    # Selective recomputation on a rank's heads: written-out attention reruns its products.
    Pin("tp2_selective", dict(dp=1, tp=2, pp=1, cp=1, recompute="selective")),
    # Nothing pinned: the plan `autopar compile` picks first on 2 ranks (moving past plans its
    # proof rejects), as a new user meets it.
    Pin("first", {}, ranks=2),
]}


@dataclass
class Outcome:
    """What happened to one case."""

    case: str
    kind: str  # trains | refused | crash | different
    detail: str = ""


@dataclass
class _Compiled:
    case: str
    script: Path
    log_file: Path
    final: Path


_PROFILES: dict[str, Any] = {}


def zoo_config(model: ZooModel, pin: Pin) -> Any:
    """The configuration `autopar compile` composes for a case: CPU gloo ranks on one node (links
    of this machine's loopback), fp32, the pin as plan.* overrides, compile's check on."""
    overrides = ["cluster=cpu_gloo", "cluster.name=zoo_cpu", f"cluster.gpus_per_node={pin.world_size}",
                 "cluster.intra_node_latency_us=3.0", "cluster.intra_node_bandwidth_GBps=1.5",
                 f"train.global_batch_size={GLOBAL_BATCH}", "train.precision=fp32", "train.optimizer=adam",
                 "solver.time_limit_s=60", "solver.top_k=0", "check=on",
                 *[f"model.{key}={value}" for key, value in model.kwargs.items()],
                 *[f"plan.{key}={value}" for key, value in pin.pins.items()]]
    return compose_config(overrides)


def _honours(plan: Any, key: str, value: Any) -> bool:
    """Whether the plan keeps a pinned decision (a pinned recompute mode is every listed layer's)."""
    if key == "recompute":
        return set(plan.recompute.values()) == {value}
    return getattr(plan, key) == value


def compile_case(model: ZooModel, pin: Pin, out_dir: Path) -> _Compiled | Outcome:
    """`autopar compile` of the case (profile, plan under the pin, generate, and compile's proof,
    which moves to the next plan honouring the pin when one fails); the plan it wrote is then
    generated again with the zoo's optimizer for the zoo's own run against one process."""
    case = f"{model.name}-{pin.name}"
    try:
        if model.name not in _PROFILES:
            _PROFILES[model.name] = profile_model(load_model_file(model.path), dict(model.kwargs), 1, "fp32")
        plan, _, _ = run_compile(model.path, zoo_config(model, pin), out_dir / "compiled",
                                 profile=_PROFILES[model.name])
        wrong = {key: value for key, value in pin.pins.items() if not _honours(plan, key, value)}
        if wrong:
            return Outcome(case, "crash", f"at compile: the plan written does not honour the pin {wrong}")
        files = generate(plan, model.path, out_dir / "run", optimizer=OPTIMIZER)
    except UserError as err:
        return Outcome(case, "refused", " ".join(str(err).split()))
    except Exception:  # noqa: BLE001 - anything but a user error at compile is a bug to tabulate
        return Outcome(case, "crash", "at compile: " + traceback.format_exc(limit=-3))
    run = out_dir / "run"
    return _Compiled(case, files.script, run / "run.jsonl", run / "final.pt")


def _run_cases(rank: int, world_size: int, jobs: list[tuple[str, str, str, str]]) -> list[str]:
    torch.set_num_threads(1)
    for case, script, log_file, final in jobs:
        module = import_generated(script, "zoo_" + re.sub(r"\W", "_", case))
        try:
            module.main(["--steps", str(STEPS), "--seed", "0", "--log-file", log_file, "--save-final", final])
        except BaseException as err:  # noqa: BLE001 - name the case, keep its traceback
            raise RuntimeError(f"{_FAILED}{case}") from err
    return [job[0] for job in jobs]


def run_compiled(compiled: list[_Compiled], world_size: int) -> dict[str, str]:
    """Run the compiled cases of one world size; the error text of each case that crashed."""
    errors: dict[str, str] = {}
    pending = list(compiled)
    while pending:
        jobs = [(c.case, str(c.script), str(c.log_file), str(c.final)) for c in pending]
        try:
            run_ranks(_run_cases, world_size, jobs, timeout_s=300)
            return errors
        except RankFailure as failure:
            text = str(failure)
            named = re.search(re.escape(_FAILED) + r"(\S+)", text)
            failed = named.group(1) if named else pending[0].case
            errors[failed] = _last_error(text)
            index = next(i for i, c in enumerate(pending) if c.case == failed)
            pending = pending[index + 1:]
    return errors


def _last_error(text: str) -> str:
    """The innermost exception line of a rank's traceback."""
    lines = [line for line in text.splitlines()
             if re.match(r"^[\w.]+(Error|Exception|Failure)\b", line) and _FAILED not in line]
    return (lines[-1] if lines else text.strip().splitlines()[-1])[:400]


def compare(case: str, compiled: _Compiled, reference: Any) -> Outcome:
    """Losses and final parameters against the one-process run."""
    if not compiled.final.exists():
        return Outcome(case, "crash", "the run saved no parameters")
    losses = [r["loss"] for r in read_records(compiled.log_file)]
    parameters = torch.load(compiled.final)
    try:
        torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                                   torch.tensor(reference.losses, dtype=torch.float64), rtol=1e-5, atol=0)
        missing = sorted(set(reference.parameters) - set(parameters))
        if missing:
            raise AssertionError(f"parameters not saved: {missing[:3]}")
        for name, expected in reference.parameters.items():
            torch.testing.assert_close(parameters[name], expected, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, name=name: f"{name}: {m}")
    except AssertionError as err:
        return Outcome(case, "different", " ".join(str(err).split())[:300])
    return Outcome(case, "trains")


def run_zoo(cases: list[tuple[str, str]], root: Path) -> dict[str, Outcome]:
    """Compile, run and compare every (model, pin) case; outcomes by case id."""
    outcomes: dict[str, Outcome] = {}
    by_group: dict[tuple[str, int], list[_Compiled]] = {}
    for model_name, pin_name in cases:
        model, pin = MODELS[model_name], PINS[pin_name]
        result = compile_case(model, pin, root / f"{model_name}-{pin_name}")
        if isinstance(result, Outcome):
            outcomes[result.case] = result
        else:
            by_group.setdefault((model_name, pin.world_size), []).append(result)
    references: dict[str, Any] = {}
    for (model_name, world_size), compiled in by_group.items():
        errors = run_compiled(compiled, world_size)
        model = MODELS[model_name]
        if model_name not in references:
            references[model_name] = run_reference(model.path, model.kwargs, GLOBAL_BATCH, STEPS, OPTIMIZER)
        for item in compiled:
            outcomes[item.case] = (Outcome(item.case, "crash", "at run: " + errors[item.case])
                                   if item.case in errors else compare(item.case, item, references[model_name]))
    return outcomes

"""Proof at compile: the generated module trains before `autopar compile` hands it back.

Two checks, each of which rejects the plan when it fails (autopar/driver.py then moves to the
planner's next plan):

1. Full scale, fake tensors: one training step of the generated module at the plan's whole
   world size on torch's ``fake`` process group (`fake_step.train_fake_step`), for the ranks
   that run different code: rank 0 (first pipeline stage) and the first rank of the last
   pipeline stage. Each runs in its own process (forked_ranks.py), so a crash inside torch (a
   segfault, an abort) rejects the plan instead of taking the compiler down. On a GPU rank, a
   second step in the same fake world is tracked (`fake_memory.memory_floor`): what its tensors
   hold, with the CUDA context, is a floor of what the GPU will hold, and a floor past the GPU's
   memory rejects the plan however the cost model priced it.
2. Small scale, real numbers (``check=on``; ``auto`` where every rank of the cluster runs on
   this machine, i.e. CPU gloo ranks): the plan's module trains `CHECK_STEPS` steps on local
   gloo ranks and its losses and final parameters are compared with the unsharded model on one
   process (autopar/runtime/reference.py). The ranks call the module's ``main`` as torchrun's
   workers would, forked from one process that imported torch once (forked_ranks.py: each
   worker importing torch was most of a small check's time); `autopar run` keeps torchrun. The
   module is generated again for this run with AdamW's eps at 1e-5: AdamW turns a gradient's
   float noise (a different reduction order) into steps of up to lr * noise / eps, and a
   gradient that is zero in exact arithmetic (a key projection's bias: softmax ignores one shift
   of every key) is all noise, 3e-9 to 3e-8 in CLIP's text and vision towers. At eps 1e-8 that
   is a step of lr/3; at 1e-6 it still moved CLIP's key bias 1.2e-5 in 2 steps, past the
   tolerance, and refused a correct TP plan; at 1e-5 it stays under 2e-6, while real gradients
   (1e-3 and up) are normalised as AdamW does.

The two run at the same time (`FakeSteps`); where both fail, the full-scale failure is the one
reported, as when they ran one after the other.

What neither sees: behaviour only CUDA has (NCCL, CUDA kernels and their autocast lists, the
caching allocator's rounding and fragmentation: an out-of-memory the floor does not reach), and
at full scale the values themselves (fake tensors carry shapes and dtypes) and the exchange of a
pipeline schedule (its stages run one micro-batch each, as fake_step.py explains).
"""
from __future__ import annotations

import math
import tempfile
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHECK_STEPS = 2
CHECK_EPS = 1e-5  # AdamW's eps for the numerical check (see the module docstring)
# The widest tolerances, those of the zoo and the equivalence tests (tests/dist/test_equivalence.py):
# float reduction order only; a wrong split, a per-rank statistic or a lost gradient is far beyond.
LOSS_RTOL = 1e-5
PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-5
# Within them, the check's tolerances come from the run's own rounding (`RoundingNoise`): the
# one-process run is repeated in float64, and how far fp32's rounding moved it, times
# NOISE_FACTOR, bounds how far another fp32 reduction order (the plan's) may land from it. Never
# below the floors: a split can compute differently, not only sum in another order (ring
# attention merges softmax blocks: GPT-NeoX at cp=2 lands 1.7e-7 from one process where the
# one-process run is 5e-9 from float64), and a model whose fp32 run rounds almost exactly still
# has sharded sums that do not.
NOISE_FACTOR = 20.0
LOSS_RTOL_FLOOR = 1e-6
PARAM_RTOL_FLOOR, PARAM_ATOL_FLOOR = 1e-5, 1e-7
FAKE_TIMEOUT_S = 600.0
CHECK_TIMEOUT_S = 600.0
CHECK_SETTINGS = ("auto", "on", "off")


@dataclass(frozen=True)
class ProofOutcome:
    """What compile's proof found for one plan.

    Attributes:
        failure: one line saying why the plan is rejected ("" when it passed).
        proven: what passed, in words (each check that ran, and any that could not finish).
        differs: the run finished and trained something else than one process (its loss or
            parameters differ): the plan's way of splitting the model is to blame, not a crash.
    """

    failure: str = ""
    proven: str = ""
    differs: bool = False

    @property
    def ok(self) -> bool:
        return not self.failure


def check_wanted(setting: str, gpu_types: set[str], nodes: int) -> bool:
    """Whether the small-scale numerical check runs: ``on``/``off``, or ``auto``: on when every
    rank of the cluster runs on this machine (one node of CPU ranks talking gloo)."""
    if setting not in CHECK_SETTINGS:
        from autopar.errors import ConfigError

        raise ConfigError(f"check={setting} is not a setting of compile's proof.", "use check=auto, on or off.")
    if setting == "auto":
        return gpu_types == {"cpu"} and nodes == 1
    return setting == "on"


def proof_ranks(plan: Any) -> list[int]:
    """Rank 0 and, with a pipeline, the first rank of the last pipeline stage: the ranks whose
    code differs (the embedding and the loss live on different stages; every other axis runs
    the same program on its shard)."""
    from autopar.domain.mesh import Mesh

    if plan.pp == 1:
        return [0]
    mesh = Mesh.of(plan)
    last = next(rank for rank in range(plan.world_size) if mesh.coordinate(rank, "pp") == plan.pp - 1)
    return [0, last]


def prove(plan: Any, model_path: str | Path, folder: str | Path, check: bool) -> ProofOutcome:
    """Prove the module generated into ``folder`` for ``plan``: one fake-tensor step at full
    scale for `proof_ranks`, and (``check``) the small-scale run against one process beside them;
    a full-scale failure is the one reported. A model fake tensors cannot run
    (``plan.real_values``) is proven by the small-scale run alone."""
    if getattr(plan, "real_values", None) and check:  # no fake run of this model: the real one proves it
        failure, note, differs = numerical_check(plan, model_path)
        if failure:
            return ProofOutcome(failure=failure, differs=differs)
        return ProofOutcome(proven=f"not run on fake tensors (they cannot run it: {plan.real_values}); {note}")
    steps = FakeSteps(folder, proof_ranks(plan))
    steps.start()
    try:
        checked = numerical_check(plan, model_path) if check else None
        steps.join()
    finally:
        steps.stop()
    for rank, failure, _ in steps.outcomes:
        if failure:
            return ProofOutcome(failure=f"at full scale on fake tensors, rank {rank}: {failure}")
    fake = f"one step at full scale ({plan.world_size} ranks) on fake tensors: " + \
        "; ".join(note for _, _, note in steps.outcomes)
    if checked is None:
        return ProofOutcome(proven=fake)
    failure, note, differs = checked
    if failure:
        return ProofOutcome(failure=failure, differs=differs)
    return ProofOutcome(proven=f"{fake}; {note}")


class FakeSteps(threading.Thread):
    """The full-scale fake-tensor steps of ``ranks``, each in a process of its own (forked from
    the fork server the small-scale check's ranks come from: forked_ranks.py), one after another
    until one fails, in a thread beside the small-scale check. `stop` kills the one running (the
    compile was interrupted)."""

    def __init__(self, folder: str | Path, ranks: list[int], timeout_s: float = FAKE_TIMEOUT_S):
        super().__init__(name="autopar-fake-steps", daemon=True)
        self.folder = Path(folder).resolve()
        self.ranks = ranks
        self.timeout_s = timeout_s
        self.outcomes: list[tuple[int, str, str]] = []  # (rank, failure, what ran), in rank order
        self._stopped = threading.Event()

    def run(self) -> None:
        for rank in self.ranks:
            try:
                outcome = self._step(rank)
            except Exception as err:  # noqa: BLE001 - a step that could not start proves nothing
                outcome = f"the step could not be started ({type(err).__name__}: {err})", ""
            if outcome is None:
                return
            self.outcomes.append((rank, *outcome))
            if outcome[0]:
                return

    def stop(self) -> None:
        self._stopped.set()
        self.join()

    def _step(self, rank: int) -> tuple[str, str] | None:
        """(failure, what ran) of ``rank``'s step, None once stopped; a step that does not finish in
        time is not a failure (the plan is kept, the note says so)."""
        from autopar.runtime.forked_ranks import Cancelled, RankFailure, run_ranks

        if self._stopped.is_set():
            return None
        with tempfile.TemporaryDirectory(prefix="autopar-fake-step-") as logs:
            try:
                (outcome,) = run_ranks(_full_scale_step_process, 1, str(self.folder), rank, timeout_s=self.timeout_s,
                                       join_group=False, cancel=self._stopped, output=Path(logs))
            except Cancelled:
                return None
            except RankFailure as failure:
                if failure.rank is None:  # not finished in time
                    return "", f"rank {rank}: not finished within {self.timeout_s:.0f} s (not proven at full scale)"
                return f"the process {failure.error}: {_last_line(_read_log(Path(logs)))}", ""
        return outcome


def full_scale_step(folder: str | Path, rank: int) -> tuple[str, str]:
    """(failure, what ran) of one fake-tensor step of ``rank`` of the module in ``folder`` at its
    full world size (and, on a GPU rank, of the memory floor of a second one); the failure is
    the error's first line."""
    from autopar.runtime.fake_memory import memory_floor
    from autopar.runtime.fake_step import train_fake_step

    try:
        return "", train_fake_step(folder, rank, after=memory_floor(folder, rank))
    except BaseException as err:  # noqa: BLE001 - any failure of the generated code rejects the plan
        traceback.print_exc()  # into the step's log
        # The message's first line: torch's C++ errors go on with "Exception raised from ..." and frames.
        message = (str(err).strip().splitlines() or [""])[0]
        line = f"{type(err).__name__}: {message}" if message else type(err).__name__
        return " ".join(line.split())[:300], ""


def _full_scale_step_process(_: int, __: int, folder: str, rank: int) -> tuple[str, str]:
    """`full_scale_step` as the one process of a `run_ranks` call."""
    return full_scale_step(folder, rank)


def _read_log(folder: Path) -> str:
    return "".join(path.read_text(errors="replace") for path in sorted(folder.glob("*.log")))


def numerical_check(plan: Any, model_path: str | Path) -> tuple[str, str, bool]:
    """(failure, what passed, whether the run finished and differs from one process) of
    `CHECK_STEPS` steps of ``plan``'s module on local gloo ranks against the unsharded model on
    one process."""
    import torch

    from autopar.codegen import generate
    from autopar.codegen.generate import DEFAULT_OPTIMIZER
    from autopar.runtime.forked_ranks import RankFailure, run_ranks
    from autopar.runtime.generated import find_script
    from autopar.runtime.local import read_records
    from autopar.runtime.reference import run_reference

    optimizer = {**DEFAULT_OPTIMIZER, "eps": CHECK_EPS}
    with tempfile.TemporaryDirectory(prefix="autopar-check-") as work:
        folder = Path(work)
        generate(plan, model_path, folder, optimizer=optimizer)
        final, log = folder / "final.pt", folder / "run.jsonl"
        argv = ["--steps", str(CHECK_STEPS), "--log-file", str(log), "--seed", "0", "--save-final", str(final),
                "--dropout-off"]
        try:
            run_ranks(_check_rank, plan.world_size, str(find_script(folder)), argv, timeout_s=CHECK_TIMEOUT_S,
                      output=folder)
        except RankFailure as failure:
            if failure.rank is None:
                return f"on {plan.world_size} local gloo ranks: not finished within {CHECK_TIMEOUT_S:.0f} s", "", False
            return f"on {plan.world_size} local gloo ranks, rank {failure.rank}: {_last_line(failure.error)}", "", False
        losses = [record["loss"] for record in read_records(log)]
        parameters = torch.load(final, weights_only=True) if final.is_file() else {}
    kwargs = dict(plan.provenance.model_kwargs)
    # Both runs with dropout off (contract.DropoutOff): a sharded run draws other masks.
    reference = run_reference(model_path, kwargs, plan.global_batch_size, CHECK_STEPS, optimizer, dropout_off=True)
    tolerances = Tolerances.from_rounding(reference, *_float64_run(model_path, kwargs, plan.global_batch_size,
                                                                   optimizer))
    difference = compare_with_reference(losses, parameters, reference, tolerances)
    draws = plan.random_draws
    if difference and draws:
        # No sharded run draws what one process draws: a difference says nothing of the plan.
        return "", (f"{CHECK_STEPS} steps on {plan.world_size} local gloo ranks ran, not compared with one process: "
                    f"the model draws random numbers in forward besides dropout ({'; '.join(draws[:3])}), which a "
                    f"sharded run draws differently ({difference})"), False
    if difference:
        return difference, "", True
    return "", (f"{CHECK_STEPS} steps on {plan.world_size} local gloo ranks equal to one process ({tolerances})"), False


def _check_rank(rank: int, world_size: int, script: str, argv: list[str]) -> None:
    """One rank of the small-scale check: the generated module's ``main`` in the process group the
    rank joined, with one intra-op thread where ranks share the machine (torchrun's default)."""
    import os

    import torch

    from autopar.runtime.generated import import_generated

    if world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    os.chdir(Path(script).parent)  # where torchrun's workers run (`run_local`)
    import_generated(script, "autopar_checked_module").main(argv)


def _float64_run(model_path: str | Path, kwargs: dict[str, Any], global_batch_size: int,
                 optimizer: dict[str, Any]) -> tuple[Any, str]:
    """(the one-process run in float64, ""), or (None, why not) where the model cannot run in it
    (an op without a float64 kernel, code that makes float32 tensors of its own and mixes them
    in): then the widest tolerances hold."""
    import torch

    from autopar.runtime.reference import run_reference

    try:
        run = run_reference(model_path, kwargs, global_batch_size, CHECK_STEPS, optimizer, dtype=torch.float64,
                            dropout_off=True)
    except Exception as err:  # noqa: BLE001 - any failure of the float64 run only leaves the widest tolerances
        return None, _last_line(f"{type(err).__name__}: {err}")
    if not all(math.isfinite(loss) for loss in run.losses):
        return None, "its loss is not finite"
    return run, ""


@dataclass(frozen=True)
class Tolerances:
    """How close the plan's run must land to the one-process run: relative on each loss, and
    rtol + atol on each parameter element."""

    loss_rtol: float = LOSS_RTOL
    param_rtol: float = PARAM_RTOL
    param_atol: float = PARAM_ATOL
    source: str = "the widest tolerances"

    @classmethod
    def from_rounding(cls, fp32: Any, fp64: Any, why_not: str = "") -> "Tolerances":
        """NOISE_FACTOR times how far fp32's rounding moved the one-process run from its float64
        twin (`fp64`; None: the widest tolerances, `why_not` saying why there is none), within the
        floors and the widest tolerances."""
        if fp64 is None:
            return cls(source="the widest tolerances: the model does not run in float64"
                       + (f" ({why_not})" if why_not else ""))
        loss_noise = max((abs(a - b) / max(abs(b), 1e-30) for a, b in zip(fp32.losses, fp64.losses)), default=0.0)
        absolute = relative = 0.0
        for name, twin in fp64.parameters.items():
            mine = fp32.parameters.get(name)
            if mine is None or mine.shape != twin.shape:
                continue
            gap = (mine.double() - twin).abs()
            absolute = max(absolute, float(gap.max()) if gap.numel() else 0.0)
            large = twin.abs() > 1e-3
            if bool(large.any()):
                relative = max(relative, float((gap[large] / twin.abs()[large]).max()))

        def bounded(noise: float, floor: float, widest: float) -> float:
            return min(widest, max(floor, NOISE_FACTOR * noise))

        return cls(bounded(loss_noise, LOSS_RTOL_FLOOR, LOSS_RTOL), bounded(relative, PARAM_RTOL_FLOOR, PARAM_RTOL),
                   bounded(absolute, PARAM_ATOL_FLOOR, PARAM_ATOL),
                   f"{NOISE_FACTOR:g}x the fp32 rounding of the one-process run, measured against float64")

    def __str__(self) -> str:
        return (f"losses within rtol {self.loss_rtol:.2g}, parameters within rtol {self.param_rtol:.2g} + atol "
                f"{self.param_atol:.2g}: {self.source}")


def compare_with_reference(losses: list[float], parameters: dict[str, Any], reference: Any,
                           tolerances: Tolerances = Tolerances()) -> str:
    """"" when the run's losses and final parameters are the one-process run's within
    ``tolerances``, else one line naming the first difference."""

    if len(losses) != len(reference.losses):
        return f"the run logged {len(losses)} losses for {len(reference.losses)} steps"
    for step, (got, expected) in enumerate(zip(losses, reference.losses)):
        if abs(got - expected) > tolerances.loss_rtol * abs(expected):
            return (f"loss differs from one process by {abs(got - expected):.3g} at step {step} (tolerance "
                    f"{tolerances.loss_rtol * abs(expected):.2g}: {tolerances.source})")
    missing = sorted(set(reference.parameters) - set(parameters))
    if missing:
        return f"the run saved no value for parameter {missing[0]}"
    for name, expected in reference.parameters.items():
        got = parameters[name].to(expected.dtype)
        if got.shape != expected.shape:
            return f"parameter {name} has shape {list(got.shape)} after training, {list(expected.shape)} on one process"
        excess = (got - expected).abs() - (tolerances.param_atol + tolerances.param_rtol * expected.abs())
        if bool((excess > 0).any()):
            worst = float((got - expected).abs().max())
            return (f"parameter {name} differs from one process by {worst:.3g} after {len(losses)} steps "
                    f"(tolerance rtol {tolerances.param_rtol:.2g} + atol {tolerances.param_atol:.2g}: "
                    f"{tolerances.source})")
    return ""


def _last_line(text: str) -> str:
    """The exception's last line of an error text (what a user reads first)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if ("Error" in line or "Exception" in line) and ":" in line
              and not line.startswith(("File ", "Traceback", "raise "))]
    return " ".join((errors or lines or ["no error text"])[-1].split())[:300]

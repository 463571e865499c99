"""The in-process API (autopar/api.py) in a user's own loop: examples/own_loop.py, a Hugging Face
Llama trained under torchrun on gloo ranks through autopar.plan and autopar.parallelize, equals one
process (autopar.runtime.reference's unsharded run on the same batches and optimizer) and the
module `autopar compile` writes for the same settings, run by `autopar run`."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autopar.cli import main as autopar_main
from autopar.codegen.generate import DEFAULT_OPTIMIZER
from autopar.plans import Plan
from autopar.runtime import run_local, run_reference
from tests.dist.harness import free_port
from tests.tiers import EXTENDED, tiered

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_loop.py"
STEPS, LR, BATCH = 3, 1e-3, 8
# ranks -> plan.* pins: the default run keeps TP on 2 ranks (Hugging Face attention split by
# heads); the extended tier adds ZeRO-3, a pipeline and dp x tp on 4 ranks.
CASES = {"tp2": (2, ["plan.tp=2"]), "zero3_dp2": (2, ["plan.dp=2", "plan.zero_stage=3"]),
         "pp2": (2, ["plan.pp=2"]), "dp2_tp2": (4, ["plan.dp=2", "plan.tp=2"])}


def run_own_loop(ranks: int, pins: list[str], out: Path, *options: str) -> tuple[str, dict[str, torch.Tensor]]:
    """The example under torchrun: (its output, the parameters it saved after STEPS steps). Its
    temporary directory is out/tmp, which must be empty again when the ranks have ended."""
    saved = out / "final.pt"
    scratch = out / "tmp"
    scratch.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
               f"--master-port={free_port()}", str(EXAMPLE), "--steps", str(STEPS), "--save-final", str(saved),
               *options, *pins]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=out,
                          env={**os.environ, "TMPDIR": str(scratch)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # Each rank's generated module lived in a folder of its own there, removed as the rank ended.
    assert not [path.name for path in scratch.iterdir() if path.name.startswith("autopar-parallel-")]
    return done.stdout, torch.load(saved, weights_only=True)


@pytest.fixture(scope="module")
def reference():
    return run_reference(EXAMPLE, {}, BATCH, STEPS, {**DEFAULT_OPTIMIZER, "lr": LR})


@pytest.fixture(scope="module")
def api_tp2(tmp_path_factory):
    """The tp2 case, checkpointing every step into its folder's checkpoints/."""
    out = tmp_path_factory.mktemp("api_tp2")
    return (*run_own_loop(*CASES["tp2"], out, "--checkpoint-dir", str(out / "checkpoints")), out)


def losses_of(output: str) -> list[float]:
    return [float(line.rsplit("loss", 1)[1]) for line in output.splitlines() if line.startswith("step ")]


def assert_equal_to_one_process(output: str, parameters: dict[str, torch.Tensor], reference) -> None:
    torch.testing.assert_close(torch.tensor(losses_of(output)), torch.tensor(reference.losses), rtol=1e-4, atol=0)
    assert reference.losses[-1] != reference.losses[0]
    assert set(parameters) >= set(reference.parameters)
    for name, expected in reference.parameters.items():
        torch.testing.assert_close(parameters[name], expected, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("case", tiered(list(CASES), default=["tp2"]))
def test_own_loop_trains_like_one_process(case, reference, api_tp2, tmp_path):
    ranks, pins = CASES[case]
    output, parameters = api_tp2[:2] if case == "tp2" else run_own_loop(ranks, pins, tmp_path)
    assert "plan: " in output
    assert_equal_to_one_process(output, parameters, reference)


@EXTENDED  # each equals one process by default: the API's loop here, the compiled module in test_equivalence
def test_the_api_trains_what_the_compiled_module_trains(api_tp2, tmp_path):
    """`autopar compile` of the same file and settings, run by `autopar run`: the same plan and
    the same parameters after the same steps (the API runs the module compile writes)."""
    out = tmp_path / "compiled"
    assert autopar_main(["compile", str(EXAMPLE), "cluster=cpu_gloo", "cluster.gpus_per_node=2",
                         f"train.global_batch_size={BATCH}", "train.precision=fp32", *CASES["tp2"][1],
                         f"optim.lr={LR}", "--out-dir", str(out)]) == 0
    output, api_parameters, _ = api_tp2
    assert output.split("plan: ", 1)[1].splitlines()[0] == Plan.load(out / "plan.json").summary()
    saved = tmp_path / "cli_final.pt"
    result = run_local(out, steps=STEPS, extra_args=["--save-final", str(saved)])
    assert result.ok, result.error
    cli_parameters = torch.load(saved, weights_only=True)
    assert set(cli_parameters) == set(api_parameters)
    for name, tensor in cli_parameters.items():
        torch.testing.assert_close(api_parameters[name], tensor, rtol=0, atol=0, msg=name)


@EXTENDED  # resuming from DCP runs by default through `autopar run` (test_data_resume.py, test_fused_projections.py)
def test_a_loop_resumed_from_its_checkpoint_ends_where_the_whole_run_ended(api_tp2, reference, tmp_path):
    """The run stopped after step 2 (its last checkpoint removed) and started again: it resumes at
    step 2 from DCP, trains the last step, and ends with the uninterrupted run's parameters."""
    import shutil

    _, whole, out = api_tp2
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(out / "checkpoints", checkpoints)
    assert sorted(path.name for path in checkpoints.iterdir()) == [f"step_{n}" for n in range(1, STEPS + 1)]
    shutil.rmtree(checkpoints / f"step_{STEPS}")
    output, resumed = run_own_loop(*CASES["tp2"], tmp_path, "--checkpoint-dir", str(checkpoints))
    assert f"({STEPS - 1} steps done)" in output
    assert losses_of(output) == pytest.approx(reference.losses[STEPS - 1:], rel=1e-4)
    for name, tensor in whole.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=0, msg=name)


def _weights_and_answers(rank: int, world_size: int) -> tuple[str, str, object]:
    """On each rank: check_same_weights of a model seeded by rank (then by 0), and what
    on_rank_zero hands every rank when rank 0's work fails with a UserError."""
    from autopar.api import check_same_weights, on_rank_zero
    from autopar.errors import UserError

    torch.manual_seed(rank)
    try:
        check_same_weights(torch.nn.Linear(4, 4), torch.device("cpu"))
        differing = "accepted"
    except UserError as err:
        differing = err.problem
    torch.manual_seed(0)
    check_same_weights(torch.nn.Linear(4, 4), torch.device("cpu"))

    def fails() -> None:
        raise UserError("no plan fits", "add nodes")

    try:
        on_rank_zero(fails)
        answer = "returned"
    except UserError as err:
        answer = f"{err.problem} / {err.fix}"
    return differing, answer, on_rank_zero(lambda: {"rank": rank})


def test_ranks_with_different_weights_are_refused_and_rank_zeros_answer_reaches_every_rank():
    from tests.dist.harness import run_ranks

    results = run_ranks(_weights_and_answers, 2, timeout_s=120)
    for differing, answer, shared in results:
        assert "ranks built different weights" in differing
        assert answer == "no plan fits / add nodes"
        assert shared == {"rank": 0}

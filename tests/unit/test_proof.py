"""The parts of compile's proof that need no ranks (autopar/runtime/proof.py): when the numerical
check runs, which ranks the full-scale step proves, how a run is compared with one process, and
which plans a rejection excludes (autopar/solver/planner.py split_of). The proof end to end:
tests/dist/test_proof.py."""
from __future__ import annotations

import pytest
import torch

from autopar.errors import ConfigError
from autopar.runtime.proof import (LOSS_RTOL, LOSS_RTOL_FLOOR, PARAM_ATOL, PARAM_ATOL_FLOOR, PARAM_RTOL,
                                   PARAM_RTOL_FLOOR, Tolerances, check_wanted, compare_with_reference, proof_ranks)
from autopar.runtime.reference import ReferenceRun
from autopar.solver.planner import split_of
from autopar.domain.layout import ParallelLayout


def test_the_check_is_on_by_default_only_where_every_rank_runs_on_this_machine():
    assert check_wanted("auto", {"cpu"}, nodes=1)
    assert not check_wanted("auto", {"cpu"}, nodes=2)  # ranks on another machine
    assert not check_wanted("auto", {"H100-SXM-80GB"}, nodes=1)
    assert not check_wanted("auto", {"cpu", "H100-SXM-80GB"}, nodes=1)
    assert check_wanted("on", {"H100-SXM-80GB"}, nodes=4) and not check_wanted("off", {"cpu"}, nodes=1)
    with pytest.raises(ConfigError, match="check=auto, on or off"):
        check_wanted("yes", {"cpu"}, nodes=1)


def test_the_full_scale_step_proves_the_first_and_the_last_pipeline_stage():
    assert proof_ranks(ParallelLayout(dp=8, tp=4)) == [0]
    # mesh tp -> cp -> pp -> dp (innermost first): tp 2 x pp 4 x dp 2; pipeline rank 3 starts
    # at rank 3 x tp = 6
    assert proof_ranks(ParallelLayout(dp=2, tp=2, pp=4, num_micro_batches=4)) == [0, 6]
    outer_pp = ParallelLayout(dp=2, tp=2, pp=2, num_micro_batches=2, mesh_order=("tp", "cp", "dp", "pp"))
    assert proof_ranks(outer_pp) == [0, 4]


def _reference() -> ReferenceRun:
    return ReferenceRun(losses=[2.0, 1.5], parameters={"w": torch.tensor([1.0, -2.0]), "b": torch.tensor([0.5])})


def test_a_run_equal_to_one_process_up_to_float_reduction_order_passes():
    close = {"w": torch.tensor([1.0 + 5e-6, -2.0]), "b": torch.tensor([0.5 - 1e-5])}
    assert compare_with_reference([2.0, 1.5 * (1 + 5e-6)], close, _reference()) == ""


def test_the_first_difference_is_named_in_one_line():
    parameters = _reference().parameters
    assert compare_with_reference([2.0, 1.51], parameters, _reference()) == \
        "loss differs from one process by 0.01 at step 1 (tolerance 1.5e-05: the widest tolerances)"
    assert compare_with_reference([2.0], parameters, _reference()) == "the run logged 1 losses for 2 steps"
    # w[1] is 2e-3 away: beyond 1e-5 + 1e-4 x 2
    moved = {"w": torch.tensor([1.0, -2.002]), "b": torch.tensor([0.5])}
    assert compare_with_reference([2.0, 1.5], moved, _reference()) == \
        ("parameter w differs from one process by 0.002 after 2 steps (tolerance rtol 0.0001 + atol 1e-05: the "
         "widest tolerances)")
    assert compare_with_reference([2.0, 1.5], {"w": parameters["w"]}, _reference()) == \
        "the run saved no value for parameter b"


def _twin(loss_gap: float, parameter_gap: float) -> ReferenceRun:
    """The reference's float64 twin, `loss_gap` (relative) and `parameter_gap` (absolute) away."""
    reference = _reference()
    return ReferenceRun(losses=[loss * (1 + loss_gap) for loss in reference.losses],
                        parameters={n: p.double() + parameter_gap for n, p in reference.parameters.items()})


def test_tolerances_are_the_runs_own_rounding_times_the_factor_within_floor_and_ceiling():
    tolerances = Tolerances.from_rounding(_reference(), _twin(1e-7, 1e-6))
    # 20 x 1e-7 relative on the loss, 20 x 1e-6 absolute, 20 x 1e-6 / 0.5 relative on the parameters
    assert tolerances.loss_rtol == pytest.approx(2e-6, rel=1e-3)
    assert tolerances.param_atol == PARAM_ATOL  # 2e-5, capped at the widest
    assert tolerances.param_rtol == pytest.approx(4e-5, rel=1e-2)
    exact = Tolerances.from_rounding(_reference(), _twin(0.0, 0.0))
    assert (exact.loss_rtol, exact.param_rtol, exact.param_atol) \
        == (LOSS_RTOL_FLOOR, PARAM_RTOL_FLOOR, PARAM_ATOL_FLOOR)
    noisy = Tolerances.from_rounding(_reference(), _twin(1e-3, 1e-2))
    assert (noisy.loss_rtol, noisy.param_rtol, noisy.param_atol) == (LOSS_RTOL, PARAM_RTOL, PARAM_ATOL)
    assert Tolerances.from_rounding(_reference(), None) == Tolerances(source=Tolerances.from_rounding(
        _reference(), None).source)


def test_a_difference_inside_the_widest_tolerance_but_beyond_the_rounding_is_refused():
    """A relative 5e-6 on a loss (the widest tolerance is 1e-5) where fp32 moved the run by 1e-8."""
    tolerances = Tolerances.from_rounding(_reference(), _twin(1e-8, 1e-9))
    losses = [2.0, 1.5 * (1 + 5e-6)]
    assert compare_with_reference(losses, _reference().parameters, _reference()) == ""
    assert compare_with_reference(losses, _reference().parameters, _reference(), tolerances).startswith(
        "loss differs from one process by 7.5e-06 at step 1 (tolerance 1.5e-06: 20x the fp32 rounding")


def test_a_rejection_excludes_the_plans_that_run_the_same_parallel_code():
    tp2 = ParallelLayout(tp=2, micro_batch_size=4, num_micro_batches=1)
    assert split_of(tp2) == split_of(ParallelLayout(tp=2, micro_batch_size=2, num_micro_batches=2,
                                                    recompute="full", mesh_order=("cp", "tp", "pp", "dp")))
    assert split_of(tp2) != split_of(ParallelLayout(tp=2, sequence_parallel=True))
    assert split_of(ParallelLayout(pp=2, schedule="gpipe")) != split_of(ParallelLayout(pp=2, schedule="1f1b"))
    assert split_of(ParallelLayout(dp=2, zero_stage=0)) != split_of(ParallelLayout(dp=2, zero_stage=3))


def test_a_compile_none_proven_lists_each_reason_once():
    from autopar.driver import _none_proven
    from autopar.report.document import RejectedPlan

    same = "at full scale on fake tensors, rank 0: RuntimeError: out of memory"
    rejected = [RejectedPlan("plan A", same), RejectedPlan("plan B", "loss differs from one process by 0.01"),
                RejectedPlan("plan C", same)]
    problem = _none_proven(rejected, "3 plans tried").problem
    assert problem.count("out of memory") == 1 and problem.count("differs") == 1
    assert "(3) plan C: as (1)" in problem
    assert max(len(line) for line in problem.splitlines()) < 200


def test_a_failed_full_scale_step_reports_the_first_line_of_a_torch_error(tmp_path, monkeypatch):
    """torch's C++ errors go on with "Exception raised from ..." and a page of frames."""
    import autopar.runtime.fake_step as fake_step
    from autopar.runtime import proof

    def fails(folder, rank, after=None):
        raise RuntimeError("Cannot call numel() on tensor with symbolic sizes/strides\nException raised from "
                           "throw_cannot_call_with_symbolic at c10/core/TensorImpl.cpp:340\nframe #0: c10::Error")
    monkeypatch.setattr(fake_step, "train_fake_step", fails)
    assert proof.full_scale_step(tmp_path, 0) == (
        "RuntimeError: Cannot call numel() on tensor with symbolic sizes/strides", "")


def test_a_full_scale_failure_is_reported_over_the_check_run_beside_it(tmp_path, monkeypatch):
    """The fake steps run beside the small-scale check: a folder with no module fails its step
    (the process reports it), and that, not the check's own failure, rejects the plan; a step
    that cannot even start is a failure too, never a pass."""
    import autopar.runtime.forked_ranks as forked_ranks
    import autopar.runtime.proof as proof

    checked = []
    monkeypatch.setattr(proof, "numerical_check",
                        lambda plan, model_path: checked.append(plan) or ("losses differ", "", True))
    plan = ParallelLayout(dp=2)
    outcome = proof.prove(plan, tmp_path / "model.py", tmp_path, check=True)
    assert checked == [plan]  # the check ran, beside the step
    assert outcome.failure.startswith("at full scale on fake tensors, rank 0:"), outcome.failure
    assert "losses differ" not in outcome.failure

    def no_process(*args, **kwargs):
        raise OSError("no more processes")

    monkeypatch.setattr(forked_ranks, "run_ranks", no_process)
    outcome = proof.prove(plan, tmp_path / "model.py", tmp_path, check=False)
    assert outcome.failure == ("at full scale on fake tensors, rank 0: the step could not be started "
                               "(OSError: no more processes)")


def test_the_memory_floor_is_measured_on_gpu_ranks_only():
    """A CPU rank's memory is the host's (the small-scale check runs it for real), and a plan
    made before plans recorded their cluster names no GPU: neither is measured; a rank of a mixed
    cluster is measured against its own GPU."""
    import dataclasses

    from autopar.plans import Plan, Provenance
    from autopar.runtime.fake_memory import rank_gpu

    def plan(cluster_config: dict) -> Plan:
        return Plan(dp=2, provenance=dataclasses.replace(Provenance(), cluster_config=cluster_config))

    assert rank_gpu(plan({"name": "cpu_gloo", "gpu": "cpu", "nodes": 1, "gpus_per_node": 2}), 1) is None
    assert rank_gpu(plan({}), 0) is None
    mixed = plan({"name": "mixed", "gpu": "cpu", "nodes": 2, "gpus_per_node": 1,
                  "node_groups": [{"gpu": "cpu", "nodes": 1}, {"gpu": "H100-SXM", "nodes": 1}]})
    assert rank_gpu(mixed, 0) is None and rank_gpu(mixed, 1).name == "H100-SXM"

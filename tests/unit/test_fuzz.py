"""Fuzz the planner's inputs: whatever the model size, cluster, pins and batch, `autopar plan`
ends with a plan or a UserError that says what to change, never with another exception.

Random small GPTs and MLPs from examples/, random clusters (cpu_gloo, dgx_h100; 1-8 GPUs per
node, 1-4 nodes), random pins (some illegal) and global batches of 1-32. Examples are
derandomized, so CI sees the same ones every run; each model's trace is reused across examples.
"""
from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.config import compose_config
from autopar.specs import model_kwargs
from autopar.driver import run_plan, run_profile
from autopar.errors import UserError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

_profiles: dict[tuple, object] = {}  # (model file, kwargs) -> ModelProfile or the UserError tracing raised


def gpt_kwargs() -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({"layers": st.integers(1, 3), "hidden": st.sampled_from([32, 48, 64]),
                                  "heads": st.sampled_from([1, 2, 3, 4]), "seq_len": st.sampled_from([8, 16, 32]),
                                  "vocab": st.just(64)})


def mlp_kwargs() -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({"layers": st.integers(1, 3), "width": st.sampled_from([32, 48, 64])})


models = st.one_of(st.tuples(st.just("gpt.py"), gpt_kwargs()), st.tuples(st.just("mlp.py"), mlp_kwargs()))
clusters = st.fixed_dictionaries({"cluster": st.sampled_from(["cpu_gloo", "dgx_h100"]),
                                  "cluster.gpus_per_node": st.integers(1, 8), "cluster.nodes": st.integers(1, 4)})
pins = st.fixed_dictionaries({}, optional={
    "plan.tp": st.sampled_from([1, 2, 3, 4, 8]), "plan.pp": st.sampled_from([1, 2, 3, 4]),
    "plan.dp": st.sampled_from([1, 2, 3, 4, 8]), "plan.zero_stage": st.sampled_from([0, 1, 2, 3, 4]),
    "plan.micro_batch_size": st.sampled_from([1, 2, 3, 4]),
    "plan.schedule": st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b", "zigzag"]),
    "plan.recompute": st.sampled_from(["none", "selective", "full", "most"])})


def overrides(model: tuple[str, dict], cluster: dict, pinned: dict, batch: int) -> list[str]:
    kwargs = {f"model.{key}": value for key, value in model[1].items()}
    return [f"{key}={value}" for key, value in {**kwargs, **cluster, **pinned}.items()] + [
        f"train.global_batch_size={batch}", "train.precision=fp32", "solver.time_limit_s=10", "solver.top_k=2"]


def profile_of(path: Path, cfg):
    """The model's profile, traced once per model file and settings (tracing dominates)."""
    key = (path.name, tuple(sorted(model_kwargs(cfg).items())))
    if key not in _profiles:
        try:
            _profiles[key] = run_profile(path, cfg)
        except UserError as err:
            _profiles[key] = err
    if isinstance(_profiles[key], UserError):
        raise _profiles[key]
    return _profiles[key]


@settings(max_examples=36, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(model=models, cluster=clusters, pinned=pins, batch=st.integers(1, 32))
def test_every_input_gives_a_plan_or_a_user_error(model, cluster, pinned, batch):
    path = EXAMPLES / model[0]
    try:
        cfg = compose_config(overrides(model, cluster, pinned, batch))
        result = run_plan(path, cfg, profile=profile_of(path, cfg))
    except UserError as err:
        assert str(err).strip() and err.problem.strip()
        return
    plan = result.plan
    assert plan.problems() == []
    assert plan.world_size == cluster["cluster.gpus_per_node"] * cluster["cluster.nodes"]
    assert plan.global_batch_size == batch
    for axis in ("dp", "tp", "pp", "micro_batch_size", "zero_stage"):
        assert pinned.get(f"plan.{axis}", getattr(plan, axis)) == getattr(plan, axis)
    if plan.pp > 1:  # without a pipeline the schedule means nothing (plain gradient accumulation)
        assert pinned.get("plan.schedule", plan.schedule) == plan.schedule
    if "plan.recompute" in pinned:
        assert set(plan.recompute.values()) == {pinned["plan.recompute"]}

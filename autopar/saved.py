"""Plans written earlier, read back: refused when edited, damaged or made for another model file or
cluster, and priced again from their provenance with the model file the user names (never the
path a plan records)."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autopar.errors import ConfigError
from autopar.plans import PRICED_WITH, priced_with

if TYPE_CHECKING:
    from cost_models.step import Estimate, PlanPricer, TrainSpec
    from cost_models.topology import ClusterSpec

# Reading a plan back is also what `autopar run` does before it starts torchrun, in a process that
# trains nothing: the model file, profiling and pricing (torch, the cost models: seconds of
# imports) are imported by the functions that price or check a model, not by the module.


def check_prediction(plan: Any, plan_path: str | Path) -> None:
    """Refuse, before any work, a saved plan whose predicted step time is no time at all (0,
    negative, nan, inf): the planner never writes one, and the report compares against it."""
    step = plan.predicted.step_time_s
    number = isinstance(step, (int, float)) and not isinstance(step, bool)
    if not number or not math.isfinite(step) or step <= 0:
        shown = f"{step:g}" if number else repr(step)
        raise ConfigError(f"{plan_path} predicts a step time of {shown} s, which the planner never writes (it was "
                          "edited or damaged).", "plan again: `autopar compile MODEL.py ...` without --plan, or "
                          "`autopar plan MODEL.py ... --out plan.json`.")


def load_saved_plan(plan_path: str | Path, model_path: str | Path, cfg: Any):
    """A plan from `autopar plan --out`, refused when it was made for another model file,
    other model settings or another cluster (replaying it would train something unplanned)."""
    from autopar.model_file import file_sha256, load_model_file
    from autopar.specs import build_cluster, model_kwargs

    plan = read_plan(plan_path)
    check_prediction(plan, plan_path)
    made_for = plan.provenance
    if not Path(model_path).is_file():
        load_model_file(model_path)  # its own clear error for a missing file
    sha = file_sha256(model_path)  # before importing: a mismatch is refused without running the file
    if made_for.model_sha256 and made_for.model_sha256 != sha:
        raise ConfigError(f"{plan_path} was planned for a different model file ({made_for.model_path or 'unknown'}, "
                          f"sha256 {made_for.model_sha256[:12]}…); {model_path} has sha256 {sha[:12]}….",
                          "plan again: `autopar compile MODEL.py ...` without --plan.")
    given = model_kwargs(cfg)
    changed = {k: (made_for.model_kwargs[k], v) for k, v in given.items()
               if k in made_for.model_kwargs and made_for.model_kwargs[k] != v}
    if changed:
        listed = ", ".join(f"model.{k}={new} (plan: {old})" for k, (old, new) in sorted(changed.items()))
        raise ConfigError(f"{plan_path} was planned for other model settings: {listed}.",
                          "drop those overrides or plan again without --plan.")
    cluster = build_cluster(cfg)
    if made_for.cluster and made_for.cluster != cluster.name or plan.world_size != cluster.world_size:
        raise ConfigError(f"{plan_path} was planned for cluster {made_for.cluster or '?'} with {plan.world_size} GPUs; "
                          f"this run asks for {cluster.name} with {cluster.world_size} GPUs.",
                          f"pass cluster={made_for.cluster or '<preset>'} with the same nodes, or plan again.")
    return plan


def check_model_sha256(path: Path, expected: str, made_for: str, model_option: str | None = "--model") -> None:
    """Refuse, before importing it, a model file whose bytes are not the ones ``expected``
    (``model_option``: the verb's option that named it, or None)."""
    from autopar.model_file import file_sha256

    sha = file_sha256(path)
    if expected and sha != expected:
        fix = (f"pass {model_option} with the original model.py, or plan again." if model_option else
               "put the original model.py back at that path, or compile again.")
        raise ConfigError(f"{path} is not the model file {made_for} (sha256 {sha[:12]}…, plan: {expected[:12]}…); "
                          "it was not imported.", fix)


def read_plan(plan_path: str | Path):
    """Plan.load with a clear error for a missing or corrupted file."""
    from autopar.plans import Plan
    from autopar.serialize import FieldError

    path = Path(plan_path)
    if not path.is_file():
        raise ConfigError(f"No plan file at {path}.", "pass the plan.json that `autopar plan --out` wrote.")
    fix = "re-create it with `autopar plan MODEL.py ... --out plan.json` (or `autopar compile` for a folder)."
    try:
        plan = Plan.load(path)
    except FieldError as err:  # a value of the wrong kind (2.5 degrees, "4", true): the field is named
        raise ConfigError(f"{path} is not a valid plan: {err.path}: {err.why}.", fix) from None
    except Exception as err:  # noqa: BLE001 - any parse failure means the same thing to the user
        text = " ".join(f"{type(err).__name__}: {err}".split())
        raise ConfigError(f"{path} is not a readable plan ({text[:200]}).", fix) from None
    problems = plan.problems()
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise ConfigError(f"{path} is not a valid plan: {problems[0]}{more}.", fix)
    return plan


def priced_as_generated(plan: Any, estimate: Estimate, train: TrainSpec) -> Any:
    """``plan`` with its prediction replaced by ``estimate`` (`price_saved_plan`'s: the plan priced
    as the generated module runs it) where they differ: a plan made with plan.engine (or another
    engine's train.* runtime) was priced as that engine runs it, and compile writes autopar's
    module. The interval keeps its width relative to the prediction; what it extrapolates stays; the
    settings it records are ``train``'s, the ones it was priced with now."""
    old = plan.predicted
    plan = dataclasses.replace(plan, **priced_with(train))  # and says so
    if old.step_time_s == estimate.step_time_s and old.peak_memory_bytes == estimate.peak_memory_bytes:
        return plan
    ratio = estimate.step_time_s / old.step_time_s if old.step_time_s > 0 else 1.0
    predicted = dataclasses.replace(old, step_time_s=estimate.step_time_s, tokens_per_s=estimate.tokens_per_s,
                                    samples_per_s=estimate.samples_per_s, mfu=estimate.mfu,
                                    peak_memory_bytes=estimate.peak_memory_bytes,
                                    time_breakdown=estimate.time_breakdown,
                                    memory_breakdown=estimate.memory_breakdown,
                                    step_time_low_s=old.step_time_low_s * ratio,
                                    step_time_high_s=old.step_time_high_s * ratio)
    return dataclasses.replace(plan, predicted=predicted)


def price_saved_plan(plan: Any, model_path: str | Path, model_option: str | None = "--model",
                     train: TrainSpec | None = None) -> tuple[PlanPricer, Estimate]:
    """The pricer and estimate of a saved plan, priced again from its provenance (its model
    settings, the cluster) with the model file ``model_path``: what the report shows and what a
    measurement is compared with.

    The model file is always one the user named (or the copy inside a compiled folder they
    named), never the path recorded in the plan: a plan can come from anywhere, and importing
    the file it names would run whatever that file does. Its sha256 is checked against the plan
    before it is imported."""
    from autopar.model_file import load_model_file
    from autopar.profile import profile_model
    from autopar.solver.tp_split import ILPSplitter
    from cost_models.step import PlanPricer, TrainSpec

    made_for = plan.provenance
    path = Path(model_path)
    if not path.is_file():
        raise ConfigError(f"The model file {path} is not there (the plan is priced again from it).",
                          f"pass {model_option} PATH to the model.py the plan was made for." if model_option else
                          "put the model.py the plan was made for back at that path (a compiled folder keeps its "
                          "copy there), or compile again.")
    if not made_for.cluster_config:
        raise ConfigError("This plan does not record its cluster settings (made by an older autopar).",
                          "plan again with `autopar plan ... --out plan.json`.")
    check_model_sha256(path, made_for.model_sha256, "the plan was made for", model_option)
    model_file = load_model_file(path)
    profile = profile_model(model_file, dict(made_for.model_kwargs), micro_batch_size=made_for.traced_micro_batch_size,
                            precision=plan.precision, blocks=list(plan.block_containers) or None)
    cluster = recorded_cluster(made_for.cluster_config)
    # What the plan fixes, over ``train``'s other settings (compile's own: whether each step clips
    # gradients, the generated runtimes), else over those the plan was priced with.
    recorded = TrainSpec(global_batch_size=plan.global_batch_size,
                         **{name: getattr(plan, name) for name in PRICED_WITH})
    train = dataclasses.replace(train or recorded,
                                global_batch_size=plan.global_batch_size, precision=plan.precision,
                                optimizer=plan.optimizer, moe_imbalance=plan.moe_imbalance,
                                expert_load=tuple((fqn, tuple(counts))
                                                  for fqn, counts in sorted(plan.expert_load.items())))
    pricer = PlanPricer(profile, cluster, train, ILPSplitter.for_training(profile, train))
    try:
        return pricer, pricer.estimate(plan.layout())
    except ValueError as err:
        raise ConfigError(f"The plan cannot be priced on its cluster: {err}.", "plan again.") from None


def recorded_cluster(cluster_config: dict[str, Any]) -> ClusterSpec:
    """The cluster a plan records (its provenance's cluster settings), checked as cluster.* settings are."""
    from omegaconf import OmegaConf

    from autopar.specs import build_cluster
    from cost_models.topology import ClusterConfig

    schema = OmegaConf.structured(ClusterConfig)
    return build_cluster(OmegaConf.create({"cluster": OmegaConf.merge(schema, cluster_config)}))

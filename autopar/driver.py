"""The one place that knows the order of the stages; the CLI verbs call these functions."""
from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from autopar import profile_cache
from autopar.config import optimizer_settings
from autopar.errors import ConfigError, UserError
from autopar.model_file import file_sha256, load_model_file
from autopar.profile import ModelProfile, profile_model
from cost_models.layout import TP_RUNTIMES, ZERO3_RUNTIMES
from cost_models.step import Estimate, ParallelLayout, PlanPricer, TrainSpec
from cost_models.topology import ClusterSpec

if TYPE_CHECKING:
    from autopar.progress import Reporter


def model_kwargs(cfg: Any) -> dict[str, Any]:
    """The ``model.*`` section as plain Python values."""
    return dict(OmegaConf.to_container(cfg.model, resolve=True))


def run_profile(model_path: str | Path, cfg: Any) -> ModelProfile:
    """Stage 1+2: load model.py, trace one training step on fake tensors, profile it."""
    return traced_or_kept(model_path, cfg)[0]


def traced_or_kept(model_path: str | Path, cfg: Any) -> tuple[ModelProfile, bool]:
    """(profile, whether it was kept from an earlier run of the same model and settings:
    autopar.profile_cache) for `run_profile`."""
    model_file = load_model_file(model_path)
    blocks = OmegaConf.select(cfg, "plan.blocks", default=None)
    settings = dict(model=model_kwargs(cfg), micro_batch_size=cfg.train.micro_batch_size,
                    precision=cfg.train.precision, blocks=list(blocks) if blocks else None,
                    trace_every_block=bool(OmegaConf.select(cfg, "plan.trace_every_block", default=False)))
    key = None
    if OmegaConf.select(cfg, "plan.reuse_profile", default=True):
        source = model_file.path.read_bytes()
        if hashlib.sha256(source).hexdigest() == model_file.sha256:  # not edited since it was imported
            key = profile_cache.profile_key(model_file.path, source, model_file.sha256, settings)
            kept = profile_cache.load(key, model_file.path, model_file.sha256)
            if kept is not None:
                return kept, True
    profile = profile_model(model_file, settings["model"], micro_batch_size=settings["micro_batch_size"],
                            precision=settings["precision"], blocks=settings["blocks"],
                            trace_every_block=settings["trace_every_block"])
    if key is not None:
        profile_cache.store(key, profile)
    return profile, False


def build_cluster(cfg: Any) -> ClusterSpec:
    """The cluster of the cluster.* settings, refused at once beyond the supported size."""
    from autopar.config import check_cluster
    from autopar.solver.space import MAX_WORLD_SIZE

    check_cluster(cfg.cluster)  # every number in range (a cluster recorded in a plan comes here too)
    # Counted from the settings, before the per-node list of a billion-node cluster is built.
    groups = list(cfg.cluster.get("node_groups") or []) or [cfg.cluster]
    nodes, per_node = sum(max(0, int(g.nodes)) for g in groups), int(cfg.cluster.gpus_per_node)
    if nodes * per_node > MAX_WORLD_SIZE:
        raise ConfigError(f"The cluster has {nodes * per_node:,} GPUs ({nodes:,} nodes); autopar plans clusters of "
                          f"up to {MAX_WORLD_SIZE:,} GPUs (larger ones would not finish in bounded time).",
                          f"use at most {MAX_WORLD_SIZE // max(1, per_node):,} nodes of {per_node} GPUs "
                          "(cluster.nodes).")
    try:
        return ClusterSpec.from_config(cfg.cluster)
    except (ValueError, OSError) as err:
        raise ConfigError(f"Invalid cluster: {err}",
                          "`autopar plan --help` lists the cluster presets and fields.") from None


def train_spec(cfg: Any, model_path: str | Path | None = None) -> TrainSpec:
    """The training settings the cost model reads; with train.router_checkpoint, the tokens per
    expert measured from it (once per model, checkpoint and settings)."""
    load: tuple = ()
    tp_runtime = OmegaConf.select(cfg, "train.tp_runtime", default="dtensor")
    if tp_runtime not in TP_RUNTIMES:
        raise ConfigError(f"Unknown train.tp_runtime '{tp_runtime}'.",
                          "use dtensor (the generated module's tensor parallelism) or plain (Megatron-style, on "
                          "plain tensors: for pricing runs of such engines).")
    zero3_runtime = OmegaConf.select(cfg, "train.zero3_runtime", default="fsdp2")
    if zero3_runtime not in ZERO3_RUNTIMES:
        raise ConfigError(f"Unknown train.zero3_runtime '{zero3_runtime}'.",
                          "use fsdp2 (the generated module's ZeRO-3) or deepspeed_2021 (DeepSpeed's stage 3 of "
                          "2021: for pricing runs of that engine).")
    checkpoint = OmegaConf.select(cfg, "train.router_checkpoint", default=None)
    if checkpoint and model_path is not None:
        load = measured_expert_load(str(model_path), str(checkpoint), tuple(sorted(model_kwargs(cfg).items())),
                                    cfg.train.micro_batch_size, cfg.train.router_batches)
    return TrainSpec(global_batch_size=cfg.train.global_batch_size, precision=cfg.train.precision,
                     optimizer=cfg.train.optimizer, moe_imbalance=cfg.train.moe_imbalance, expert_load=load,
                     clip_grad_norm=float(OmegaConf.select(cfg, "optim.max_grad_norm", default=1.0)) > 0,
                     tp_runtime=tp_runtime, zero3_runtime=zero3_runtime)


@functools.lru_cache(maxsize=4)
def measured_expert_load(model_path: str, checkpoint: str, kwargs: tuple, batch_size: int,
                         batches: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(experts module FQN, tokens each expert received) from the router checkpoint
    (autopar/trace/routing.py), as TrainSpec keeps them."""
    from autopar.trace.routing import measure_expert_load

    load = measure_expert_load(load_model_file(model_path), dict(kwargs), Path(checkpoint), batch_size, batches)
    return tuple((fqn, tuple(counts)) for fqn, counts in sorted(load.items()))


def pinned_layout(cfg: Any, cluster: ClusterSpec) -> ParallelLayout:
    """A fully specified layout from plan.* overrides; unset degrees default to 1, dp fills the rest."""
    pins = cfg.plan
    tp, pp, cp = pins.tp or 1, pins.pp or 1, pins.cp or 1
    if cluster.world_size % (tp * pp * cp):
        raise ConfigError(f"tp×pp×cp = {tp * pp * cp} does not divide the cluster's {cluster.world_size} GPUs.",
                          "change plan.tp/pp/cp or cluster.nodes.")
    dp = pins.dp or cluster.world_size // (tp * pp * cp)
    micro = pins.micro_batch_size or 1
    if cfg.train.global_batch_size % (dp * micro):
        raise ConfigError(f"train.global_batch_size={cfg.train.global_batch_size} is not a multiple of "
                          f"dp×micro_batch_size = {dp}×{micro}.", "change the batch or plan.micro_batch_size.")
    schedule = pins.schedule or ("interleaved_1f1b" if (pins.chunks or 1) > 1 else "1f1b")
    return ParallelLayout(dp=dp, tp=tp, pp=pp, cp=cp, ep=pins.ep or 1, expert_tp=bool(pins.expert_tp),
                          zero_stage=pins.zero_stage or 0,
                          hybrid_shard=bool(pins.hybrid_shard), micro_batch_size=micro,
                          num_micro_batches=cfg.train.global_batch_size // (dp * micro), schedule=schedule,
                          chunks=pins.chunks or 1, sequence_parallel=bool(pins.sequence_parallel),
                          cp_strategy=pins.cp_strategy or "ulysses", dp_sync=pins.dp_sync or "auto",
                          recompute=pins.recompute or "none")


def run_estimate(model_path: str | Path, cfg: Any,
                 profile: ModelProfile | None = None) -> tuple[ModelProfile, ParallelLayout, Estimate]:
    """Price the layout the plan.* overrides describe (`autopar estimate`); ``profile``: the
    model's profile when the caller traced it already for these settings (as `run_plan` takes)."""
    from autopar.solver.tp_split import ILPSplitter

    cluster = build_cluster(cfg)  # before tracing: a bad cluster is reported at once
    layout = pinned_layout(cfg, cluster)  # and pins that do not divide the cluster or the batch
    if profile is None:
        profile = run_profile(model_path, cfg)
    pricer = PlanPricer(profile, cluster, train_spec(cfg, model_path), ILPSplitter(profile))
    try:
        return profile, layout, pricer.estimate(layout)
    except ValueError as err:
        raise ConfigError(f"This plan cannot run: {err}.", "change the plan.* overrides.") from None


def run_plan(model_path: str | Path, cfg: Any, progress: "Reporter | None" = None,
             profile: ModelProfile | None = None, excluded_splits: frozenset[tuple] = frozenset()):
    """Stages 1-4: profile (unless given), then search for the fastest plan that fits (`autopar plan`);
    ``progress`` hears of each phase and search step; ``excluded_splits`` are never planned
    (compile's proof rejected them)."""
    from autopar.config import PlanPins, SolverConfig
    from autopar.solver.planner import Planner

    cluster = build_cluster(cfg)  # before tracing: a bad cluster is reported at once
    kept = False
    if profile is None:
        if progress:
            progress.phase(f"tracing one training step of {model_path} on fake tensors")
        profile, kept = traced_or_kept(model_path, cfg)
    if progress:
        again = " (reused: traced before from the same files and settings; plan.reuse_profile=false traces again)"
        progress.phase(f"traced {profile.traced_words()}{again if kept else ''}; building the search space")
    solver = OmegaConf.to_object(cfg.solver) if not isinstance(cfg.solver, SolverConfig) else cfg.solver
    pins = OmegaConf.to_object(cfg.plan) if not isinstance(cfg.plan, PlanPins) else cfg.plan
    planner = Planner(profile, cluster, train_spec(cfg, model_path), solver, pins,
                      progress=progress.search if progress else None,
                      excluded_splits=excluded_splits)
    result = planner.run()
    result.plan = with_cluster_config(result.plan, cfg)
    return result


def precision_note(cfg: Any) -> str | None:
    """What to tell when the requested precision is not what will run: the generated module
    computes in fp32 on CPU ranks (gloo), whatever train.precision says."""
    gpus = {cfg.cluster.gpu, *(group.gpu for group in cfg.cluster.node_groups)}
    if cfg.train.precision != "fp32" and "cpu" in gpus:
        return (f"train.precision={cfg.train.precision}: CPU ranks compute in fp32, so the generated module trains "
                f"in fp32 there (the plan is priced in {cfg.train.precision}); set train.precision=fp32 to price "
                "what runs.")
    return None


def cluster_config(cfg: Any) -> dict[str, Any]:
    return dict(OmegaConf.to_container(cfg.cluster, resolve=True))


def with_cluster_config(plan: Any, cfg: Any) -> Any:
    """Record every cluster.* setting in the plan, so it can be priced again and a replay on
    another cluster is caught."""
    from dataclasses import replace

    return plan.with_updates(provenance=replace(plan.provenance, cluster_config=cluster_config(cfg)))


def report_of(result: Any) -> Any:
    """The full report of a planning result (runners-up and binding limits included)."""
    from autopar.report.document import build_report, replication_notes

    return build_report(result.plan, result.estimate, result.pricer, result.alternatives, result.binding,
                        notes=replication_notes(result.replicated_ops, result.plan.tp) + list(result.illegal_splits))


def rebuild_report(plan: Any, model_path: str | Path, model_option: str | None = "--model") -> Any:
    """Price a saved plan again from its provenance (its model settings, the cluster) with the
    model file ``model_path`` and build its report; runners-up are not part of a plan file, so
    the report has none. ``model_option``: the verb's option that named the model file (None:
    the file is a compiled folder's copy, or the verb's argument), for the messages' fixes."""
    from autopar.report.document import build_report, replication_notes
    from autopar.solver.tp_split import replicated_ops

    from dataclasses import replace

    pricer, estimate = price_saved_plan(plan, model_path, model_option)
    report = build_report(plan, estimate, pricer,
                          notes=["Rebuilt from plan.json alone: the runners-up, binding limits and the search's "
                                 "wall time are recorded only when the report is written by `autopar compile` or "
                                 "`autopar plan --report`."]
                          + replication_notes(replicated_ops(pricer.tp_splitter, plan.tp), plan.tp))
    return replace(report, solver_seconds=None)


def price_saved_plan(plan: Any, model_path: str | Path,
                     model_option: str | None = "--model") -> tuple[PlanPricer, Estimate]:
    """The pricer and estimate of a saved plan, priced again from its provenance (its model
    settings, the cluster) with the model file ``model_path``: what the report shows and what a
    measurement is compared with.

    The model file is always one the user named (or the copy inside a compiled folder they
    named), never the path recorded in the plan: a plan can come from anywhere, and importing
    the file it names would run whatever that file does. Its sha256 is checked against the plan
    before it is imported."""
    from autopar.report.document import layout_of_plan
    from autopar.solver.tp_split import ILPSplitter
    from cost_models.topology import ClusterConfig

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
    schema = OmegaConf.structured(ClusterConfig)
    cluster = build_cluster(OmegaConf.create({"cluster": OmegaConf.merge(schema, made_for.cluster_config)}))
    train = TrainSpec(global_batch_size=plan.global_batch_size, precision=plan.precision, optimizer=plan.optimizer,
                      moe_imbalance=plan.moe_imbalance,
                      expert_load=tuple((fqn, tuple(counts)) for fqn, counts in sorted(plan.expert_load.items())))
    splitter = ILPSplitter(profile)
    pricer = PlanPricer(profile, cluster, train, splitter)
    try:
        return pricer, pricer.estimate(layout_of_plan(plan))
    except ValueError as err:
        raise ConfigError(f"The plan cannot be priced on its cluster: {err}.", "plan again.") from None


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
    sha = file_sha256(path)
    if expected and sha != expected:
        fix = (f"pass {model_option} with the original model.py, or plan again." if model_option else
               "put the original model.py back at that path, or compile again.")
        raise ConfigError(f"{path} is not the model file {made_for} (sha256 {sha[:12]}…, plan: {expected[:12]}…); "
                          "it was not imported.", fix)


def read_plan(plan_path: str | Path):
    """Plan.load with a clear error for a missing or corrupted file."""
    from autopar.plan import Plan
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


def read_report(report_path: str | Path, plan_file: str | Path | None = None):
    """load_report with one paragraph for a report.json that cannot be read (edited, damaged):
    it names the value that does not fit and how to get the report back."""
    from autopar.report.document import load_report

    path = Path(report_path)
    try:
        return load_report(path)
    except Exception as err:  # noqa: BLE001 - any parse failure means the same thing to the user
        raise unreadable_report(path, Path(plan_file) if plan_file else path.parent / "plan.json", err) from None


def unreadable_report(saved: Path, plan_file: Path, err: Exception) -> ConfigError:
    """The one paragraph for a report.json that cannot be read or rendered."""
    text = " ".join(f"{type(err).__name__}: {err}".split())[:200]
    return ConfigError(f"{saved} is not a readable report ({text}); autopar did not write it as it is now.",
                       f"delete it and run `autopar report {plan_file} --model MODEL.py` to price the plan again, or "
                       "compile again.")


def compiled_file_names(model_path: str | Path) -> list[str]:
    """The files `autopar compile` writes for a model file (known before planning, so an output
    folder that cannot take them is refused before any work)."""
    from autopar.codegen.assemble import BESIDE
    from autopar.report.render import REPORT_FILES

    name = Path(model_path).name
    return [f"parallel_{Path(name).stem}.py", *BESIDE.values(), name, "plan.json", "launch.sh", "sbatch.sh",
            *REPORT_FILES]


# Plans compile's proof may run: the chosen one and two more (each rejection re-solves without the
# rejected split; proving a small model on gloo ranks takes 10-30 s on 2 cores). Plans code
# generation refuses cost no run and count only towards the larger bound.
MAX_PLANS_PROVEN = 3
MAX_PLANS_TRIED = 8


def run_compile(model_path: str | Path, cfg: Any, out_dir: str | Path, plan_path: str | Path | None = None,
                progress: "Reporter | None" = None, force: bool = False,
                provenance: dict[str, str] | None = None, profile: ModelProfile | None = None,
                emit: tuple[str, ...] = ()):
    """Stages 1-5: plan (or reuse a saved plan), prove the generated module (autopar/runtime/proof.py)
    and write it with its launch scripts and report into ``out_dir``, all or nothing and without
    losing anything autopar did not write there (see autopar/output_dir.py): the folder is
    checked before planning, files are built in a staging folder and moved in once all are
    written and the module passed its proof.

    A plan the proof rejects (or code generation refuses) is never written: the planner plans
    again without its split (`split_of`), up to MAX_PLANS_PROVEN plans, and the report lists each
    rejected plan with its reason. A saved plan (``plan_path``) that fails is refused.

    ``profile``: the model's profile when the caller traced it already (for these settings).
    ``emit``: engines whose settings file is written beside plan.json (autopar/emit/); a plan an
    engine cannot run is rejected like one that fails the proof.

    Returns:
        (plan, planning result or None for a saved plan, written files); the result's
        ``rejected`` lists the plans the proof rejected.
    """
    from autopar.output_dir import check_out_dir, writing_lock

    out_dir = Path(out_dir)
    provenance = dict(provenance or {})
    from autopar.emit import writer

    engine_names = [writer(engine).file_name for engine in emit]
    check_out_dir(out_dir, [*compiled_file_names(model_path), *provenance, *engine_names], force=force)
    with writing_lock(out_dir):  # a second compile into the folder meanwhile is refused
        return _compile_held(model_path, cfg, out_dir, plan_path, progress, force, provenance, profile, emit)


def _compile_held(model_path: str | Path, cfg: Any, out_dir: Path, plan_path: str | Path | None,
                  progress: "Reporter | None", force: bool, provenance: dict[str, str],
                  profile: ModelProfile | None, emit: tuple[str, ...]):
    """`run_compile` once the folder is checked and held."""
    from autopar.runtime.proof import check_wanted

    defaults = {**run_defaults(cfg, model_path), "optimizer": optimizer_settings(cfg.optim)}
    cluster = build_cluster(cfg)
    check = check_wanted(str(OmegaConf.select(cfg, "check", default="auto")),
                         {gpu.name for gpu in cluster.node_gpus}, cluster.nodes)
    if plan_path is not None:
        plan = with_cluster_config(load_saved_plan(plan_path, model_path, cfg), cfg)
        files, rejection = _compile_one(plan, None, model_path, out_dir, cluster, check, [], progress, force,
                                        defaults, provenance, emit)
        if rejection is not None:
            raise UserError(f"The saved plan {plan_path} ({plan.summary()}) fails compile's proof: {rejection.reason}.",
                            "plan again without --plan (the planner moves past plans that fail), or pass check=off "
                            "if only the small-scale check fails and you accept that.")
        result = None
    else:
        from autopar.runtime.blame import blame
        from autopar.solver.planner import split_of

        rejected: list[Any] = []
        excluded: set[tuple] = set()
        files = None
        while len(rejected) < MAX_PLANS_TRIED and sum(r.ran for r in rejected) < MAX_PLANS_PROVEN:
            try:
                result = run_plan(model_path, cfg, progress=progress, profile=profile,
                                  excluded_splits=frozenset(excluded))
            except UserError:
                if not rejected:
                    raise
                raise _none_proven(rejected, "no other plan fits these pins and this cluster") from None
            profile = result.pricer.profile
            plan = result.plan
            files, rejection = _compile_one(plan, result, model_path, out_dir, cluster, check, rejected, progress,
                                            force, defaults, provenance, emit)
            if rejection is None:
                break
            blamed = None
            if rejection.differs:
                blamed = blame(plan, rejection.reason) or _diagnose(plan, cfg, model_path, profile, progress)
            if blamed is None:
                excluded.add(split_of(plan))
            else:
                # The next plan goes without the way of splitting that trained another model.
                profile = blamed.excluded_from(profile)
                rejection = dataclasses.replace(rejection, reason=f"{rejection.reason}; to blame: {blamed.technique}, "
                                                                  "which no further plan uses", blamed=blamed.cause)
                if progress:
                    progress.phase(f"not splitting that way again: {blamed.technique}")
            rejected.append(rejection)
        if files is None:
            raise _none_proven(rejected, f"compile runs at most {MAX_PLANS_PROVEN} plans (and tries at most "
                                         f"{MAX_PLANS_TRIED})")
    written = {name: out_dir / path.name for name, path in vars(files).items()}
    written["report"] = out_dir / "report.html"
    from autopar.emit import writer

    written.update({engine: out_dir / writer(engine).file_name for engine in emit})
    if result is not None:
        result.rejected = list(rejected)
    return plan, result, written


def run_defaults(cfg: Any, model_path: str | Path) -> dict[str, Any]:
    """What the compiled module trains on and how it is evaluated, from ``data.*`` and
    ``train.eval_*``: generate()'s keyword arguments. A corpus named in ``data.path`` is read
    here, before planning, so a file that cannot be trained on is refused with nothing written."""
    eval_every, eval_batches = int(cfg.train.eval_every), int(cfg.train.eval_batches)
    if eval_every < 0 or eval_batches < 1:
        raise ConfigError(f"train.eval_every={eval_every} / train.eval_batches={eval_batches} is out of range.",
                          "pass train.eval_every >= 0 (0: no validation) and train.eval_batches >= 1.")
    data = {}
    if OmegaConf.select(cfg, "data") is not None:
        data = {k: v for k, v in OmegaConf.to_container(cfg.data, resolve=True).items() if v is not None}
    if data.get("path"):
        data = {**data, "path": str(Path(data["path"]).resolve())}
        if data.get("val_path"):
            data["val_path"] = str(Path(data["val_path"]).resolve())
        check_corpus(data, cfg, model_path)
    return {"data": data, "eval_every": eval_every, "eval_batches": eval_batches}


def check_corpus(data: dict[str, Any], cfg: Any, model_path: str | Path) -> None:
    """Read the corpus once (no cache is written) and refuse what the model cannot train on."""
    from autopar.codegen.model_facts import inspect_model
    from autopar.codegen.sections import data as training_data
    from autopar.codegen.sections.batches import corpus, data_settings
    from autopar.codegen.sections.loader import DataLayoutError, batch_layout
    from autopar.model_file import accepted_kwargs

    kwargs = model_kwargs(cfg)
    facts = inspect_model(model_path, kwargs, batch_size=1)
    model_file = load_model_file(model_path)
    example = model_file.example_batch(2, **accepted_kwargs(model_file.example_batch, kwargs))
    try:
        batch_layout(example, facts.seq_len)
        settings = data_settings({**data, "cache_dir": None}, facts.seq_len)
        corpus(settings, int(cfg.train.global_batch_size), facts.vocab_rows)
    except training_data.DataError as error:
        raise ConfigError(f"{error.problem} Nothing was written.", error.fix) from None
    except DataLayoutError as error:
        raise ConfigError(f"{error} Nothing was written.") from None


def _compile_one(plan: Any, result: Any, model_path: str | Path, out_dir: Path, cluster: ClusterSpec, check: bool,
                 rejected: list[Any], progress: "Reporter | None", force: bool, defaults: dict[str, Any],
                 provenance: dict[str, str], emit: tuple[str, ...] = ()):
    """Generate ``plan`` into a staging folder, prove it and, when it passes, write its report
    and install everything into ``out_dir``: (files, None), or (None, the rejection);
    ``defaults``: generate()'s run defaults (optimizer, data, validation); ``provenance``:
    Hydra's record of the settings (``.hydra/config.yaml``, ...), installed and listed in the
    manifest like every other file."""
    from autopar.codegen import generate
    from autopar.codegen.errors import CodegenError
    from autopar.emit import EngineRefusal, engine_files
    from autopar.output_dir import install, staging_dir, write_atomically
    from autopar.report.document import RejectedPlan
    from autopar.report.render import write_report
    from autopar.runtime.proof import prove

    if plan.real_values and not check:
        raise UserError(f"Fake tensors cannot run this model ({plan.real_values}), so compile can prove a plan only "
                        "by running it, and the small-scale check is off for this cluster.",
                        f"pass check=on (the plan's {plan.world_size} ranks then run here on gloo against one "
                        "process), or make the model run on fake tensors (a fake kernel for a custom op: "
                        "torch.library.register_fake; torch ops instead of NumPy in forward()).")
    try:
        engine_texts = engine_files(plan, emit)
    except EngineRefusal as err:
        return None, RejectedPlan(plan.summary(), f"{err.engine} cannot run it: {err.why}", ran=False)
    with staging_dir(out_dir) as staging:
        try:
            files = generate(plan, model_path, staging, gpus_per_node=cluster.gpus_per_node, **defaults)
        except CodegenError as err:
            return None, RejectedPlan(plan.summary(), "code generation refused it: " + " ".join(err.problem.split()),
                                      ran=False)
        if progress:
            progress.phase(f"proving {plan.summary()}: "
                           + ("2 steps on local gloo ranks against one process (fake tensors cannot run it)"
                              if plan.real_values else "one step at full scale on fake tensors"
                              + (", then 2 steps on local gloo ranks against one process" if check else "")))
        outcome = prove(plan, model_path, staging, check)
        if not outcome.ok:
            if progress:
                progress.phase(f"rejected {plan.summary()}: {outcome.failure}")
            return None, RejectedPlan(plan.summary(), outcome.failure, differs=outcome.differs)
        if progress:
            progress.phase(f"writing the module, launch scripts and report into {out_dir}")
        report = report_of(result) if result is not None else rebuild_report(plan, model_path, None)
        report.proof = outcome.proven
        report.rejected = list(rejected)
        write_report(report, staging)
        for relative, text in {**provenance, **engine_texts}.items():
            write_atomically(staging / relative, text)
        install(staging, out_dir, force=force)
    return files, None


def _diagnose(plan: Any, cfg: Any, model_path: str | Path, profile: ModelProfile,
              progress: "Reporter | None") -> Any:
    """For ``plan``, which splits several ways and trained something else: compile's check of
    each of its batch and sequence splits alone on 2 ranks (autopar.runtime.blame's
    `diagnostic_pins`); the Blame of the first that trains something else too, else None."""
    from autopar.runtime.blame import batch_blame, diagnostic_pins, sequence_blame
    from autopar.runtime.proof import numerical_check

    for splits_sequence, pins in diagnostic_pins(plan):
        single = copy.deepcopy(cfg)  # the structured config, with the single split pinned on 2 ranks
        for key, value in {**{f"plan.{k}": v for k, v in pins.items()}, "cluster.nodes": 1,
                           "cluster.gpus_per_node": 2}.items():
            OmegaConf.update(single, key, value)
        try:
            alone = run_plan(model_path, single, profile=profile).plan
        except UserError:
            continue  # no plan splits that way alone on 2 ranks: nothing to measure
        if progress:
            progress.phase(f"checking {alone.summary()} alone: {plan.summary()} split several ways")
        difference, _, differs = numerical_check(alone, model_path)
        if differs:
            how = (f"with its {'sequence' if splits_sequence else 'batch'} split alone ({alone.summary()}, checked "
                   f"because {plan.summary()} split several ways)")
            return (sequence_blame if splits_sequence else batch_blame)(how, difference)
    return None


def _none_proven(rejected: list[Any], why_stopped: str) -> UserError:
    """The one paragraph for a compile whose every plan failed its proof (nothing written): each
    plan and its reason, then each cause the check measured once, in words."""
    first_with: dict[str, int] = {}
    listed = ""
    for i, r in enumerate(rejected, 1):  # each reason once: a plan failing as an earlier one did points to it
        listed += f"\n  ({i}) {r.summary}: " + (f"as ({first_with[r.reason]})" if r.reason in first_with else r.reason)
        first_with.setdefault(r.reason, i)
    causes = list(dict.fromkeys(r.blamed for r in rejected if r.blamed))
    problem = f"No plan passed compile's proof, so nothing was written ({why_stopped}):{listed}"
    problem += "".join(f"\nCause: {cause}." for cause in causes) + "\n"  # one line each, the fix on its own
    unexplained = any(not r.blamed for r in rejected if r.ran)
    return UserError(problem, ("fix what the first reason names in the model" + (" (or report it as an autopar bug)"
                                                                                   if unexplained else "")
                               + ", pin another split (plan.tp/pp/cp/zero_stage), or pass check=off if only the "
                               "small-scale check fails."))

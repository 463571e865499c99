"""The one place that knows the order of the stages; the CLI verbs call these functions.

It orchestrates and serves no one below it: what a configuration asks for is autopar.specs, saved
plans are autopar.saved, reports priced again autopar.report.rebuild.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from omegaconf import OmegaConf

from autopar import profile_cache
from autopar.config import optimizer_settings
from autopar.errors import ConfigError, UserError
from autopar.model_profile import ModelProfile
from autopar.report.rebuild import rebuild_report, report_of
from autopar.saved import load_saved_plan, price_saved_plan, priced_as_generated
from autopar.serialize import compact_json
from autopar.specs import (build_cluster, generated_module_settings, model_kwargs, pinned_layout, section_as,
                           section_values, train_spec, with_cluster_config)
from cost_models.step import Estimate, ParallelLayout, PlanPricer
from cost_models.topology import ClusterSpec

if TYPE_CHECKING:
    from autopar.progress import Reporter


def run_profile(model_path: str | Path, cfg: Any) -> ModelProfile:
    """Stage 1+2: load model.py, trace one training step on fake tensors, profile it."""
    return traced_or_kept(model_path, cfg)[0]


def traced_or_kept(model_path: str | Path, cfg: Any) -> tuple[ModelProfile, bool]:
    """(profile, whether it was kept from an earlier run of the same model and settings:
    autopar.profile_cache) for `run_profile`. A kept profile is looked up by the file's bytes
    before the file is imported: its key already holds what the import could change (the bytes,
    the neighbours' and packages' versions), and importing the model's library (transformers:
    about a second) is what reusing a profile saves besides tracing."""
    blocks = OmegaConf.select(cfg, "plan.blocks", default=None)
    settings = dict(model=model_kwargs(cfg), micro_batch_size=cfg.train.micro_batch_size,
                    precision=cfg.train.precision, blocks=list(blocks) if blocks else None,
                    trace_every_block=bool(OmegaConf.select(cfg, "plan.trace_every_block", default=False)))
    reuse = bool(OmegaConf.select(cfg, "plan.reuse_profile", default=True))
    path = Path(model_path).resolve()
    key, digest = None, None
    if reuse and path.is_file():
        source = path.read_bytes()
        digest = hashlib.sha256(source).hexdigest()
        key = profile_cache.profile_key(path, source, digest, settings, imported=False)
        kept = profile_cache.load(key, path, digest) if key is not None else None
        if kept is not None:
            return kept, True
    from autopar.model_file import load_model_file  # torch, and the model's own library: only to trace
    from autopar.profile import profile_model

    model_file = load_model_file(model_path)
    if model_file.sha256 != digest:
        key = None  # edited between reading and importing: not kept under the older bytes' key
    elif reuse and key is None:
        # A module only the import could find (on a path the file adds) keys the profile now.
        key = profile_cache.profile_key(model_file.path, source, model_file.sha256, settings)
        kept = profile_cache.load(key, model_file.path, model_file.sha256) if key is not None else None
        if kept is not None:
            return kept, True
    profile = profile_model(model_file, settings["model"], micro_batch_size=settings["micro_batch_size"],
                            precision=settings["precision"], blocks=settings["blocks"],
                            trace_every_block=settings["trace_every_block"])
    if key is not None:
        kept = dataclasses.replace(profile, kept_as=key)
        if profile_cache.store(key, kept) is not None:
            profile = kept
    return profile, False


def run_estimate(model_path: str | Path, cfg: Any,
                 profile: ModelProfile | None = None) -> tuple[ModelProfile, ParallelLayout, Estimate]:
    """Price the layout the plan.* overrides describe (`autopar estimate`); ``profile``: the
    model's profile when the caller traced it already for these settings (as `run_plan` takes)."""
    from autopar.solver.tp_split import ILPSplitter

    cluster = build_cluster(cfg)  # before tracing: a bad cluster is reported at once
    layout = pinned_layout(cfg, cluster)  # and pins that do not divide the cluster or the batch
    if profile is None:
        profile = run_profile(model_path, cfg)
    train = train_spec(cfg, model_path)
    pricer = PlanPricer(profile, cluster, train, ILPSplitter.for_training(profile, train))
    try:
        return profile, layout, pricer.estimate(layout)
    except ValueError as err:
        raise ConfigError(f"This plan cannot run: {err}.", "change the plan.* overrides.") from None


def run_plan(model_path: str | Path, cfg: Any, progress: "Reporter | None" = None,
             profile: ModelProfile | None = None, excluded_splits: frozenset[tuple] = frozenset(),
             on_traced: Callable[[], None] | None = None):
    """Stages 1-4: profile (unless given), then search for the fastest plan that fits (`autopar plan`);
    ``progress`` hears of each phase and search step; ``excluded_splits`` are never planned
    (compile's proof rejected them); ``on_traced`` is called once the model is profiled."""
    from autopar.config import PlanPins, SolverConfig
    from autopar.solver.planner import Planner

    cluster = build_cluster(cfg)  # before tracing: a bad cluster is reported at once
    kept = False
    if profile is None:
        if progress:
            progress.phase(f"tracing one training step of {model_path} on fake tensors")
        profile, kept = traced_or_kept(model_path, cfg)
    if on_traced is not None:
        on_traced()
    if progress:
        again = " (reused: traced before from the same files and settings; plan.reuse_profile=false traces again)"
        progress.phase(f"traced {profile.traced_words()}{again if kept else ''}; building the search space")
    planner = Planner(profile, cluster, train_spec(cfg, model_path), section_as(cfg.solver, SolverConfig),
                      section_as(cfg.plan, PlanPins),
                      progress=progress.search if progress else None,
                      excluded_splits=excluded_splits)
    known = compact_json(profile.findings)
    result = planner.run()
    if profile.kept_as is not None and compact_json(profile.findings) != known:
        profile_cache.store_findings(profile.kept_as, profile.findings)
    result.plan = with_cluster_config(result.plan, cfg)
    return result


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

    cfg = generated_module_settings(cfg)  # priced as the module it writes runs, before anything is written
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
    from autopar.runtime.forked_ranks import start_server
    from autopar.runtime.proof import check_wanted

    defaults = {**run_defaults(cfg, model_path), "optimizer": optimizer_settings(cfg.optim)}
    cluster = build_cluster(cfg)
    check = check_wanted(str(OmegaConf.select(cfg, "check", default="auto")),
                         {gpu.name for gpu in cluster.node_gpus}, cluster.nodes)
    if plan_path is not None:
        plan = with_cluster_config(load_saved_plan(plan_path, model_path, cfg), cfg)
        start_server()  # the proof's processes fork from it: its imports run beside the pricing
        train = train_spec(cfg)  # compile's own settings
        priced = price_saved_plan(plan, model_path, None, train=train)
        saved_s = plan.predicted.step_time_s
        plan = priced_as_generated(plan, priced[1], train)
        if progress and plan.predicted.step_time_s != saved_s:
            progress.phase(f"priced {plan_path} again as the module compile writes runs it: {saved_s:.4g} s a step "
                           f"in the file (priced with other settings, such as another engine's runtime), "
                           f"{plan.predicted.step_time_s:.4g} s now")
        files, rejection = _compile_one(plan, None, model_path, out_dir, cluster, check, [], progress, force,
                                        defaults, provenance, emit, priced)
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
                # The proof's processes fork from the server: once the model traced (most bad input
                # is refused by then), its imports run beside the search.
                result = run_plan(model_path, cfg, progress=progress, profile=profile,
                                  excluded_splits=frozenset(excluded), on_traced=start_server)
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
    data: dict[str, Any] = {}
    if OmegaConf.select(cfg, "data") is not None:
        data = {k: v for k, v in section_values(cfg.data).items() if v is not None}
    if data.get("path"):
        data = {**data, "path": str(Path(data["path"]).resolve())}
        if data.get("val_path"):
            data["val_path"] = str(Path(data["val_path"]).resolve())
        check_corpus(data, cfg, model_path)
    return {"data": data, "eval_every": eval_every, "eval_batches": eval_batches}


def check_corpus(data: dict[str, Any], cfg: Any, model_path: str | Path) -> None:
    """Read the corpus once (no cache is written) and refuse what the model cannot train on."""
    from autopar.codegen.model_facts import inspect_model
    from autopar.sections import data as training_data
    from autopar.sections.batches import corpus, data_settings
    from autopar.sections.loader import DataLayoutError, batch_layout
    from autopar.model_file import accepted_kwargs, load_model_file

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
                 provenance: dict[str, str], emit: tuple[str, ...] = (), priced: tuple[Any, Any] | None = None):
    """Generate ``plan`` into a staging folder, prove it and, when it passes, write its report
    and install everything into ``out_dir``: (files, None), or (None, the rejection);
    ``defaults``: generate()'s run defaults (optimizer, data, validation); ``provenance``:
    Hydra's record of the settings (``.hydra/config.yaml``, ...), installed and listed in the
    manifest like every other file; ``priced``: a saved plan's (pricer, estimate), its report's."""
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
                              + (" beside 2 steps on local gloo ranks against one process" if check else "")))
        outcome = prove(plan, model_path, staging, check)
        if not outcome.ok:
            if progress:
                progress.phase(f"rejected {plan.summary()}: {outcome.failure}")
            return None, RejectedPlan(plan.summary(), outcome.failure, differs=outcome.differs)
        if progress:
            progress.phase(f"writing the module, launch scripts and report into {out_dir}")
        report = report_of(result) if result is not None else rebuild_report(plan, model_path, None, priced)
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

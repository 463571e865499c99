"""The committed `benchmarks.gpu_plan_check` records priced again by today's cost model.

Each record is a fully pinned plan measured on a GPU, so the cost model prices exactly what ran.
A one-GPU record trained for real and measured whole steps (`measured_step_s`); a multi-GPU
record ran one rank with the other ranks faked (torch's fake process group: collectives return
at once) and measured that rank's compute alone (`measured_compute_s`), which
`rank_compute_s` prices. tests/unit/test_cost_vs_gpu.py holds the cost model to these prices and
benchmarks/bench_gpu_measured.py tabulates them.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MEASURED = REPO / "benchmarks" / "measured"
PLAN_CHECKS = ("h100_plan_check.jsonl", "h200_plan_check.jsonl")
# What a faked rank still runs: its collectives return at once, so only these parts of the step.
RANK_COMPUTE_PARTS = ("compute", "recompute", "optimizer")


def plan_runs() -> list[dict]:
    """Every committed plan-check record, the H100's then the H200's, in the order measured."""
    return [json.loads(line) for name in PLAN_CHECKS for line in (MEASURED / name).read_text().splitlines()]


def faked_rank(run: dict) -> bool:
    """Whether the record is one rank of a multi-GPU plan with the other ranks faked."""
    return "measured_compute_s" in run


def faked_tp_rank(run: dict) -> bool:
    """A faked rank of a tensor-parallel plan: what it measures is the host issuing the step
    (DTensor's dispatch per split module, cost_models.host), the GPU idle much of the time."""
    return faked_rank(run) and "plan.tp=1" not in run["overrides"]


def model_path(run: dict) -> Path:
    """The measured model file: an example, or a test model (written the ways users write them)."""
    example = REPO / "examples" / run["model"]
    return example if example.exists() else REPO / "tests" / "dist" / "models" / run["model"]


# Profiles by what `autopar.driver.run_profile` traces from (model file, its settings, micro-batch,
# precision, pinned blocks): the runs of one model differ only in plan.* pins, which the trace
# does not see, so each 1-8B model is traced once per process instead of once per run.
_PROFILES: dict[tuple, Any] = {}


def traced(run: dict) -> tuple[Path, Any, Any]:
    """(model file, config, profile) of a measured run, each model traced once per process."""
    from omegaconf import OmegaConf

    from autopar.config import compose_config
    from autopar.driver import run_profile
    from autopar.specs import model_kwargs

    path, cfg = model_path(run), compose_config(run["overrides"])
    key = (path, tuple(sorted(model_kwargs(cfg).items())), cfg.train.micro_batch_size, cfg.train.precision,
           str(OmegaConf.select(cfg, "plan.blocks", default=None)))
    if key not in _PROFILES:
        _PROFILES[key] = run_profile(path, cfg)
    return path, cfg, _PROFILES[key]


def priced(run: dict) -> Any:
    """Today's estimate (`cost_models.step.Estimate`) of the record's pinned plan."""
    return priced_with_layout(run)[1]


def priced_with_layout(run: dict) -> tuple[Any, Any]:
    """(pinned layout, today's estimate) of the record's plan."""
    from autopar.driver import run_estimate

    path, cfg, profile = traced(run)
    _, layout, estimate = run_estimate(path, cfg, profile=profile)
    return layout, estimate


def rank_compute_s(estimate: Any) -> float:
    """What the estimate prices for the parts a faked rank still runs (RANK_COMPUTE_PARTS)."""
    return sum(estimate.time_breakdown.get(part, 0.0) for part in RANK_COMPUTE_PARTS)


def predicted_compute_s(run: dict) -> float:
    """Today's price of a faked rank's compute (`measured_compute_s` measures it)."""
    return rank_compute_s(priced(run))


_FAKED_TP: dict[str, tuple[float, float, int]] = {}


def price_faked_tp_rank(run: dict) -> tuple[float, float, int]:
    """(measured seconds, priced optimizer seconds, DTensor module micro-batches) of a faked TP
    rank: what `cost_models.host.fit_per_module_s` fits the host's per-module cost to. Each run
    is priced once per process: the fit and every leave-one-out refit read them all."""
    if run["case"] not in _FAKED_TP:
        _FAKED_TP[run["case"]] = _price_faked_tp_rank(run)
    return _FAKED_TP[run["case"]]


def held_out_host_s(run: dict, tp_runs: list[dict]) -> float:
    """The host's per-module cost fitted on the faked TP ranks other than ``run``: what pricing it
    out of sample sets `cost_models.host.DTENSOR_MODULE_HOST_S` to."""
    from cost_models.host import fit_per_module_s

    return fit_per_module_s(price_faked_tp_rank(other) for other in tp_runs if other is not run)


def _price_faked_tp_rank(run: dict) -> tuple[float, float, int]:
    from autopar.solver.tp_split import ILPSplitter
    from autopar.specs import build_cluster, pinned_layout, train_spec
    from cost_models.step import PlanPricer

    path, cfg, profile = traced(run)
    cluster = build_cluster(cfg)
    train = train_spec(cfg, path)
    pricer = PlanPricer(profile, cluster, train, ILPSplitter.for_training(profile, train))
    layout = pinned_layout(cfg, cluster)
    gpu = cluster.node_gpus[0]
    modules = sum(pricer.split(layer.name, layout, gpu).dtensor_modules(layout.sequence_parallel)
                  for layer in profile.layers)
    optimizer = pricer.estimate(layout).time_breakdown.get("optimizer", 0.0)
    return run["measured_compute_s"], optimizer, modules * layout.num_micro_batches

"""Tensor-parallel coverage of the zoo: the share of each model's block linear parameters that
the plan the planner picks under a pinned ``plan.tp`` splits (planning only, nothing runs), e.g.

    python -m tests.zoo.coverage                          # every model at tp=2 and tp=4
    python -m tests.zoo.coverage --models hf_gpt2 --tps 2
"""
from __future__ import annotations

import argparse
import time

from autopar.driver import run_plan
from autopar.errors import UserError
from autopar.model_file import load_model_file
from autopar.profile import profile_model
from autopar.solver.tp_coverage import TPCoverage, TPCoverageError
from tests.zoo.harness import _PROFILES, MODELS, Pin, zoo_config


def pinned_tp_coverage(model_name: str, tp: int) -> TPCoverage | str:
    """The coverage of the plan chosen under ``plan.tp=tp`` (the zoo's settings, tp ranks), or
    the reason planning refused it when that refusal is not the coverage's own."""
    model = MODELS[model_name]
    if model_name not in _PROFILES:
        _PROFILES[model_name] = profile_model(load_model_file(model.path), dict(model.kwargs), 1, "fp32")
    cfg = zoo_config(model, Pin(f"tp{tp}", dict(dp=1, tp=tp, pp=1, cp=1)))
    try:
        result = run_plan(model.path, cfg, profile=_PROFILES[model_name])
    except TPCoverageError as err:
        return err.coverage
    except UserError as err:
        return "refused: " + " ".join(err.problem.split()).rpartition(": ")[2].rstrip(".")[:80]
    return result.tp_coverage


def cell(result: TPCoverage | str) -> str:
    if isinstance(result, str):
        return result
    if result.param_share is None:
        return "no linear"
    return f"{result.param_share:.0%} ({result.flop_share:.0%} FLOPs)" if result.flop_share is not None \
        else f"{result.param_share:.0%}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--tps", nargs="*", type=int, default=[2, 4])
    args = parser.parse_args(argv)
    lines = ["| model | " + " | ".join(f"tp={tp}" for tp in args.tps) + " |", "|---" * (len(args.tps) + 1) + "|"]
    for model in args.models:
        start = time.perf_counter()
        cells = [cell(pinned_tp_coverage(model, tp)) for tp in args.tps]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
        print(lines[-1], f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()

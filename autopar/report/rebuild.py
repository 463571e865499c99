"""Reports of plans priced now (a planning result) or again (a saved plan.json), and saved reports
read back with one paragraph when they cannot be."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from autopar.errors import ConfigError
from autopar.report.document import build_report, load_report, replication_notes
from autopar.saved import price_saved_plan


def report_of(result: Any) -> Any:
    """The full report of a planning result (runners-up and binding limits included)."""
    return build_report(result.plan, result.estimate, result.pricer, result.alternatives, result.binding,
                        notes=replication_notes(result.replicated_ops, result.plan.tp) + list(result.illegal_splits))


def rebuild_report(plan: Any, model_path: str | Path, model_option: str | None = "--model",
                   priced: tuple[Any, Any] | None = None) -> Any:
    """Price a saved plan again from its provenance (its model settings, the cluster) with the
    model file ``model_path`` and build its report; runners-up are not part of a plan file, so
    the report has none. ``model_option``: the verb's option that named the model file (None:
    the file is a compiled folder's copy, or the verb's argument), for the messages' fixes;
    ``priced``: `price_saved_plan`'s answer where the caller has it already."""
    from autopar.solver.tp_split import replicated_ops

    pricer, estimate = priced or price_saved_plan(plan, model_path, model_option)
    report = build_report(plan, estimate, pricer,
                          notes=["Rebuilt from plan.json alone: the runners-up, binding limits and the search's "
                                 "wall time are recorded only when the report is written by `autopar compile` or "
                                 "`autopar plan --report`."]
                          + replication_notes(replicated_ops(pricer.tp_splitter, plan.tp), plan.tp))
    return replace(report, solver_seconds=None)


def read_report(report_path: str | Path, plan_file: str | Path | None = None):
    """load_report with one paragraph for a report.json that cannot be read (edited, damaged):
    it names the value that does not fit and how to get the report back."""
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

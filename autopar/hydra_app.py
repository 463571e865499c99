"""Runs a verb as a Hydra application, so Hydra's own semantics hold: hydra.run.dir,
hydra.sweep.dir, hydra.job.name, `.hydra/` provenance in each run's output folder, --cfg, --info,
multirun through the configured launcher (basic, joblib, submitit_local, submitit_slurm) and
sweeper (basic, optuna).

The verb's task is handed to `hydra.main`, Hydra's public entry point, with the Hydra part of the
command line (flags and overrides); autopar's own options (--out, --top-k, ...) stay with argparse.
Every configuration is composed and checked by `autopar.config.compose_config` first, so a typo is
reported in autopar's words before Hydra or torch do any work. A task never raises into Hydra
(which would print a traceback and exit 1): what it returns or raises comes back in `TaskOutcome`.
"""
from __future__ import annotations

import contextlib
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from autopar.config import compose_config, normalise_overrides, register_configs
from autopar.errors import UserError

# Hydra's logging would reconfigure the root logger and write <job>.log files; autopar prints
# its own progress, so both are off unless the user picks a logging preset.
QUIET_LOGGING = ("hydra/job_logging=none", "hydra/hydra_logging=none")


@dataclass
class HydraFlags:
    """The Hydra part of a command line: which command and its modifiers."""

    multirun: bool = False
    cfg: str | None = None  # job | hydra | all
    info: str | None = None  # all | config | defaults | defaults-tree | plugins | searchpath
    resolve: bool = False
    package: str | None = None

    def argv(self) -> list[str]:
        out = ["--multirun"] if self.multirun else []
        out += ["--cfg", self.cfg] if self.cfg else []
        out += ["--info", self.info] if self.info else []
        out += ["--resolve"] if self.resolve else []
        out += ["--package", self.package] if self.package else []
        return out


@dataclass
class TaskOutcome:
    """What the in-process task of a single run returned or raised, and where it ran."""

    value: Any = None
    error: BaseException | None = None
    output_dir: str | None = None


def given_keys(overrides: list[str]) -> set[str]:
    """Keys (or group names) the user's overrides set, without +/++/~ prefixes."""
    return {item.split("=", 1)[0].lstrip("+~") for item in overrides}


def with_defaults(verb: str, overrides: list[str], defaults: Mapping[str, str | Path]) -> list[str]:
    """The user's overrides plus autopar's defaults for those Hydra settings the user left alone
    (the job is named after the verb; Hydra's logging is quiet)."""
    keys = given_keys(overrides)
    extra = [setting(key, value) for key, value in {"hydra.job.name": verb, **defaults}.items() if key not in keys]
    extra += [item for item in QUIET_LOGGING if item.split("=", 1)[0] not in keys]
    return normalise_overrides(list(overrides)) + extra


def setting(key: str, value: str | Path) -> str:
    """``key=value`` in Hydra's override grammar, quoting a value (a path with spaces, commas,
    brackets...) that would otherwise be parsed as something else."""
    text = str(value)
    if re.fullmatch(r"[\w./:@+-]+", text):
        return f"{key}={text}"
    return f"{key}='" + text.replace("'", "\\'") + "'"


def resolved_hydra_setting(overrides: list[str], key: str) -> str:
    """The value Hydra would use for a hydra.* setting (e.g. hydra.sweep.dir, with ${now:...}
    resolved once), so the caller can pin it and knows where the output goes."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.utils import setup_globals
    from omegaconf import OmegaConf

    given = [item for item in overrides if item.startswith(f"{key}=")]
    if len(given) == 1:  # a value without interpolations is what it says: no composition to read it
        from hydra.core.override_parser.overrides_parser import OverridesParser

        value = OverridesParser.create().parse_override(given[0]).value()
        if isinstance(value, str) and "${" not in value:
            return value
    setup_globals()  # the ${now:...} resolver
    cfg = compose_config(overrides, hydra=True)
    HydraConfig.instance().set_config(cfg)
    return str(OmegaConf.select(cfg, key))


def show(flags: HydraFlags, overrides: list[str]) -> int:
    """--cfg / --info: Hydra prints the composed configuration or its own diagnostics."""
    return _call_hydra(flags, overrides, lambda cfg: None)


def run(task: Callable[[Any], Any], overrides: list[str]) -> TaskOutcome:
    """One job in this process (Hydra's RUN mode). hydra.run.dir is resolved once and pinned; if
    the job fails, the folders Hydra created for it are removed again while empty, so a failed
    run leaves nothing behind (Hydra itself would leave an empty dated folder)."""
    outcome = TaskOutcome()
    run_dir = Path(resolved_hydra_setting(overrides, "hydra.run.dir"))
    created = [folder for folder in (run_dir, *run_dir.parents) if not folder.exists()]

    def job(cfg: Any) -> Any:
        from hydra.core.hydra_config import HydraConfig

        outcome.output_dir = HydraConfig.get().runtime.output_dir
        try:
            outcome.value = task(cfg)
        except BaseException as err:  # noqa: BLE001 - handed back to the CLI, which reports it
            outcome.error = err
        return outcome.value

    pinned = [item for item in overrides if not item.startswith("hydra.run.dir=")] + [setting("hydra.run.dir", run_dir)]
    code = _call_hydra(HydraFlags(), pinned, job)
    if outcome.error is None and code:
        outcome.error = UserError(f"Hydra stopped the run (exit {code}); its message is above.",
                                  "fix the setting it names.")
    if outcome.error is not None:
        for folder in created:  # deepest first; stops at the first that is not empty
            try:
                folder.rmdir()
            except OSError:
                break
    return outcome


def multirun(task: Callable[[Any], Any], overrides: list[str]) -> int:
    """A sweep through the configured sweeper and launcher; ``task`` must be picklable (a
    launcher may run it in other processes or on other machines) and must not raise."""
    return _call_hydra(HydraFlags(multirun=True), overrides, task)


def _call_hydra(flags: HydraFlags, overrides: list[str], task: Callable[[Any], Any]) -> int:
    import hydra

    register_configs()
    main = hydra.main(config_path="pkg://autopar.conf", config_name="config", version_base="1.3")(task)
    with _argv(["autopar", *flags.argv(), *overrides]), _logging_restored():
        try:
            main()
        except SystemExit as stop:  # Hydra exits 1 after printing an error it could not report otherwise
            return stop.code if isinstance(stop.code, int) else 1
    return 0


@contextlib.contextmanager
def _logging_restored() -> Iterator[None]:
    """Hydra configures the root logger (--info sets it to DEBUG on the stdout of the moment, a
    logging preset adds handlers); main() called in-process, as tests do, gets it back as it was."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


@contextlib.contextmanager
def _argv(argv: list[str]) -> Iterator[None]:
    """hydra.main reads its command line from sys.argv."""
    saved = sys.argv
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = saved


def provenance_files(cfg: Any) -> dict[str, str]:
    """`.hydra/config.yaml` and `.hydra/overrides.yaml` of the running job, for an output folder
    that autopar writes as a whole (compile) rather than one Hydra creates. Interpolations are
    resolved, so the record holds the values this job used (``check`` follows $AUTOPAR_CHECK)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    overrides = OmegaConf.to_yaml(list(HydraConfig.get().overrides.task))
    return {".hydra/config.yaml": OmegaConf.to_yaml(cfg, resolve=True), ".hydra/overrides.yaml": overrides}


def write_provenance(cfg: Any, folder: Path) -> None:
    """Keep the job's configuration and overrides in ``folder``/.hydra, as Hydra does for a run;
    a ``.hydra`` that is a link is refused, and each file replaces (never writes through) what
    had its name."""
    from autopar.output_dir import refuse_link, write_atomically

    refuse_link(folder / ".hydra")
    for relative, text in provenance_files(cfg).items():
        write_atomically(folder / relative, text)


@dataclass
class ConfigHelp:
    """The config groups (presets) and the fields of each schema, for --help."""

    groups: dict[str, list[str]] = field(default_factory=dict)
    fields: dict[str, list[str]] = field(default_factory=dict)

    def text(self) -> str:
        lines = ["configuration (Hydra; key=value overrides, +key=value adds where the schema allows):"]
        for group, options in self.groups.items():
            lines.append(textwrap.fill(f"{group}=  {' | '.join(options)}", 100, initial_indent="  ",
                                       subsequent_indent="      "))
        for section, names in self.fields.items():
            lines.append(textwrap.fill(f"{section}.  {'  '.join(names)}", 100, initial_indent="  ",
                                       subsequent_indent="      ", break_on_hyphens=False))
        lines.append("  hydra.  run.dir=DIR (single runs)  sweep.dir=DIR (sweeps)  job.name=NAME")
        lines.append("  hydra/launcher=basic|joblib|submitit_local|submitit_slurm  hydra/sweeper=basic|optuna")
        lines.append("  --cfg job|hydra|all prints the composed configuration; --info shows Hydra's view\n"
                     "      (defaults, search path, plugins)")
        return "\n".join(lines)


def config_help() -> ConfigHelp:
    """Presets found in the installed autopar.conf package and the fields of the root schema
    (types and defaults), read without composing anything."""
    import dataclasses
    from importlib import resources

    from autopar.config import AutoparConfig

    conf = resources.files("autopar.conf")
    groups = {entry.name: sorted(item.name.removesuffix(".yaml") for item in entry.iterdir()
                                 if item.name.endswith(".yaml"))
              for entry in sorted(conf.iterdir(), key=lambda e: e.name)
              if entry.is_dir() and entry.name != "__pycache__"}
    fields_ = {"model": ["<any build_model()/example_batch() keyword>"]}
    for section in dataclasses.fields(AutoparConfig):
        if dataclasses.is_dataclass(section.default_factory):
            fields_[section.name] = [f"{f.name}:{_type_name(f.type)}"
                                     for f in dataclasses.fields(section.default_factory)]
    return ConfigHelp(groups, fields_)


def _type_name(annotation: Any) -> str:
    text = str(annotation)
    return text.replace("typing.", "").replace(" | None", "?").replace("NodeGroupConfig", "group")

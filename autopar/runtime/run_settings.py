"""`autopar run DIR key=value ...`: the training settings a run overrides, checked before any rank starts.

A compiled module holds its defaults as constants (DATA, SEQ_LEN, VOCAB_ROWS, EVAL_EVERY, ...);
they are read here from its source as literals, never by importing it, so checking a run's data
executes no code. The corpus is read (and tokenized into the folder's cache, which the ranks
then map) once, here: a missing, empty, unreadable or too short file stops the run in one
paragraph before torchrun starts.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from autopar.errors import UserError

# data.* settings naming files: given relative to where `autopar run` is called.
PATH_SETTINGS = ("path", "val_path", "tokenizer", "cache_dir")
# `autopar run` override -> the module's option (data.* go through --data KEY=VALUE).
TRAIN_OPTIONS = {"train.eval_every": "--eval-every", "train.eval_batches": "--eval-batches"}
OPTIM_OPTIONS = {"optim.lr": "--lr", "optim.warmup_steps": "--warmup-steps", "optim.schedule": "--schedule",
                 "optim.min_lr": "--min-lr", "optim.max_grad_norm": "--max-grad-norm",
                 "optim.weight_decay": "--weight-decay", "optim.decay_steps": "--decay-steps"}


def parsed(script: Path) -> ast.Module:
    """The module's syntax tree; an empty one when it does not parse (an edited file: the ranks
    then report the error as it is, with its line)."""
    try:
        return ast.parse(script.read_text())
    except SyntaxError:
        return ast.Module(body=[], type_ignores=[])


def module_constants(script: Path, names: tuple[str, ...]) -> dict[str, Any]:
    """The module-level constants ``names`` of a generated module, read as literals from its
    source (an assignment that is not a literal is left out)."""
    values: dict[str, Any] = {}
    for node in parsed(script).body:
        if not isinstance(node, ast.Assign):
            continue
        targets = node.targets[0].elts if isinstance(node.targets[0], ast.Tuple) else node.targets
        items = node.value.elts if isinstance(node.value, ast.Tuple) and len(targets) > 1 else [node.value]
        for target, value in zip(targets, items):
            if isinstance(target, ast.Name) and target.id in names:
                try:
                    values[target.id] = ast.literal_eval(value)
                except ValueError:
                    continue
    return values


def module_options(script: Path) -> set[str]:
    """The long options a generated module's parse_args declares (read from its source)."""
    options: set[str] = set()
    for node in ast.walk(parsed(script)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            options.update(a.value for a in node.args
                           if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("--"))
    return options


def module_arguments(overrides: list[str], accepted: set[str]) -> tuple[list[str], list[str]]:
    """(the module's arguments for ``overrides``, the data.* ones as KEY=VALUE); an override the
    module does not take is refused naming those it takes."""
    arguments, data = [], []
    known = sorted(set(TRAIN_OPTIONS) | {k for k, option in OPTIM_OPTIONS.items() if option in accepted})
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep:
            raise UserError(f"{override!r} is not a KEY=VALUE override.",
                            f"write e.g. data.path=corpus.txt; run takes data.*, {', '.join(known)}.")
        check_override_number(key, value)
        if key.startswith("data."):
            name = key[len("data."):]
            if name in PATH_SETTINGS and value and value.lower() not in ("null", "none", "bytes"):
                value = str(Path(value).resolve())  # the ranks run inside the folder, not here
            data.append(f"{name}={value}")
            arguments += ["--data", f"{name}={value}"]
        elif key in TRAIN_OPTIONS or (key in OPTIM_OPTIONS and OPTIM_OPTIONS[key] in accepted):
            arguments += [(TRAIN_OPTIONS | OPTIM_OPTIONS)[key], value]
        else:
            raise UserError(f"autopar run does not take {key!r}.",
                            f"pass data.* (the text pipeline's settings) or one of {', '.join(known)}; other "
                            "settings are compiled in: compile again with them.")
    return arguments, data


def override_bound(key: str) -> Any:
    """The declared range of a numeric train.*, optim.* or data.* setting (None for others)."""
    from autopar.config import DATA_BOUNDS, OPTIM_BOUNDS, TRAIN_BOUNDS

    section, _, name = key.partition(".")
    return {"train": TRAIN_BOUNDS, "optim": OPTIM_BOUNDS, "data": DATA_BOUNDS}.get(section, {}).get(name)


def check_override_number(key: str, text: str) -> None:
    """Refuse a run override whose number is outside its field's range (as compile would), before
    any rank starts: the module would otherwise train with a learning rate of nan."""
    from autopar.domain.bounds import within

    bound = override_bound(key)
    if bound is None:
        return
    value = _literal(text)
    if not within(value, bound) and not (bound.integer and isinstance(value, float) and value.is_integer()
                                         and within(int(value), bound)):
        raise UserError(f"{key}={text} is out of range (expected: {bound.describe()}). Nothing was run.",
                        f"give {key} a value in that range, or leave it out to keep the compiled one.")


def _literal(text: str) -> Any:
    """An override's value as a number where it reads as one (null/none: None)."""
    if text.strip().lower() in ("null", "none", "~"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def check_run_data(out_dir: Path, script: Path, data_overrides: list[str], global_batch_size: int) -> str | None:
    """Read the run's corpus (the compiled DATA with ``data_overrides``) into the folder's cache,
    refusing what cannot be trained on; the corpus's path, or None when the run has none."""
    constants = module_constants(script, ("DATA", "SEQ_LEN", "VOCAB_ROWS"))
    if "SEQ_LEN" not in constants:
        if data_overrides:
            raise UserError(f"{script.name} was compiled before runs took data settings.",
                            "compile the model again, then pass data.path=... to autopar run.")
        return None
    compiled = constants.get("DATA", {})
    if not data_overrides and not (isinstance(compiled, dict) and compiled.get("path")):
        return None  # no corpus: its reader (torch, numpy) is not imported into the launching process
    from autopar.sections import data as training_data
    from autopar.sections.batches import corpus, data_overrides as merged, data_settings

    try:
        data = merged({"cache_dir": str(out_dir / "data_cache"), "seq_len": constants["SEQ_LEN"],
                       **compiled}, data_overrides)
        if not data.get("path"):
            return None
        settings = data_settings(data, constants["SEQ_LEN"])
        corpus(settings, global_batch_size, constants.get("VOCAB_ROWS", 0))
    except training_data.DataError as error:
        raise UserError(f"{error.problem} Nothing was run.", error.fix) from None
    return settings.path


# What the generated module compiled in of the plan (its PLAN constant; dp as DP_REPLICATE x
# DP_SHARD) that `autopar run` also reads from plan.json (the ranks torchrun starts, the global
# batch the data is checked for): the two must agree. Keys PLAN omits take these values.
COMPILED_DEFAULTS = {"ep": 1, "dp_shares": []}
COMPILED_KEYS = ("dp", "tp", "pp", "cp", "ep", "zero_stage", "global_batch_size", "micro_batch_size",
                 "num_micro_batches", "dp_shares")


def compiled_plan(script: Path) -> dict[str, Any]:
    """The plan numbers ``script`` was compiled for ({} for a module without a PLAN constant,
    e.g. one that does not parse: its ranks then report what is wrong)."""
    constants = module_constants(script, ("PLAN", "DP_REPLICATE", "DP_SHARD"))
    plan = constants.get("PLAN")
    if not isinstance(plan, dict):
        return {}
    compiled = {key: plan.get(key, COMPILED_DEFAULTS.get(key)) for key in COMPILED_KEYS if key != "dp"}
    replicate, shard = constants.get("DP_REPLICATE"), constants.get("DP_SHARD")
    if isinstance(replicate, int) and isinstance(shard, int):
        compiled["dp"] = replicate * shard
    return {key: value for key, value in compiled.items() if value is not None}


def check_plan_matches_module(plan: Any, plan_file: Path, script: Path) -> None:
    """Refuse a plan.json whose degrees or batch sizes are not the ones ``script`` was compiled
    for (an edited plan.json would start as many ranks as it says, whatever the module runs)."""
    compiled = compiled_plan(script)
    for key in COMPILED_KEYS:
        if key not in compiled:
            continue
        given = getattr(plan, key)
        given = list(given) if isinstance(given, (list, tuple)) else given
        if given != compiled[key]:
            raise UserError(f"{plan_file} says {key}={given} but {script.name}, the module it would launch, was "
                            f"compiled for {key}={compiled[key]}; autopar run starts the ranks plan.json asks for, so "
                            "the two must agree. Nothing was run.",
                            f"restore plan.json as `autopar compile` wrote it (or compile again for other degrees or "
                            f"batch sizes: they are compiled into {script.name}, not read from plan.json).")


def launch_plan(out_dir: Path) -> Any:
    """The plan ``out_dir``'s module is launched with: plan.json read and checked (every number
    in range) and matched against the module's compiled constants, before anything starts."""
    from autopar.saved import read_plan
    from autopar.runtime.generated import find_script

    plan_file = Path(out_dir) / "plan.json"
    plan = read_plan(plan_file)
    check_plan_matches_module(plan, plan_file, find_script(Path(out_dir)))
    return plan

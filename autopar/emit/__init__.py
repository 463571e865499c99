"""Plans written for the engines people already train with (`--emit ENGINE`).

Each engine module turns a `Plan` into that engine's own settings file and says what of the plan
the engine cannot run (`EngineWriter.refusal`): a plan the engine would run differently from how
it was priced is refused by name, never approximated. The files say what the plan chose; the
model, data and optimizer stay the user's (an engine's model config is not ours to write).

    torchtitan   torchtitan_args.txt   overrides of a torchtitan job (--parallelism.*, --training.*;
                                       the activation-checkpointing policy in a comment)
    megatron     megatron_args.txt     Megatron-LM / NeMo arguments (model-parallel sizes, sequence
                                       parallel, distributed optimizer, recomputation, batch sizes)
    deepspeed    deepspeed.json        a DeepSpeed config (ZeRO stage, micro-batch, accumulation,
                                       activation checkpointing, precision, clipping)
    accelerate   accelerate_fsdp.yaml  an accelerate config for FSDP2 (with its tensor/context-
                                       parallel sizes)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from autopar.errors import UserError
from autopar.domain.vocabulary import DPSync, Recompute


@dataclass(frozen=True)
class EngineWriter:
    """One engine: the file it reads, what of a plan it cannot run, and the file's text."""

    name: str
    file_name: str
    refusal: Callable[[Any], str | None]
    render: Callable[[Any], str]
    layout_refusal: Callable[[Any], str | None]  # the part a search candidate already decides
    read: Callable[[str], "EngineSettings"]  # the engine's file back into autopar settings (`--from`)
    # What the engine itself would reject of a file read back, once the world size is known.
    rules: Callable[["EngineSettings", int], list[str]] = lambda settings, world_size: []
    tp_runtime: str = "dtensor"  # how it runs tensor parallelism (cost_models TrainSpec.tp_runtime)
    selective_runtime: str = "autopar"  # what its selective recomputation keeps (TrainSpec.selective_runtime)
    # What it reduces gradients in under fp16 (TrainSpec.grad_reduce_dtype; under bf16 every engine here reduces fp32).
    fp16_grad_reduce_dtype: str = "fp32"


@dataclass
class EngineSettings:
    """What an engine's settings file says in autopar's terms (`autopar estimate --from`).

    Attributes:
        engine: the engine.
        pins: Hydra override -> value (plan.* and train.*).
        ignored: the file's keys that say nothing autopar prices (model, data, logging, ...).
        problems: values autopar cannot price (the file is refused, naming them).
        notes: what the engine changes of the file when it runs it (priced as it runs).
        sizes: what the file says that the engine checks against the world size (`rules`).
    """

    engine: str
    pins: dict[str, Any] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=dict)

    def pin(self, key: str, value: Any) -> None:
        self.pins[key] = value

    def refuse(self, problem: str) -> None:
        self.problems.append(problem)

    def overrides(self) -> list[str]:
        return [f"{key}={str(value).lower() if isinstance(value, bool) else value}" for key, value in self.pins.items()]


FILE_KINDS = {".json": "deepspeed", ".yaml": "accelerate", ".yml": "accelerate"}


def read_engine_file(path: Path) -> EngineSettings:
    """An engine's settings file (deepspeed JSON, accelerate YAML, Megatron-LM or torchtitan
    arguments, told apart by their option names), read; a file autopar cannot price is refused."""
    try:
        text = path.read_text()
    except OSError as err:
        raise UserError(f"Cannot read {path}: {err.strerror}.", "pass an existing settings file to --from.") from None
    engine = FILE_KINDS.get(path.suffix.lower())
    if engine is None:
        engine = "torchtitan" if "--parallelism." in text or "--training." in text else \
            "megatron" if "-model-parallel-size" in text or "--micro-batch-size" in text else None
    if engine is None:
        raise UserError(f"{path} is not a settings file autopar reads.",
                        "pass a DeepSpeed .json, an accelerate .yaml, or Megatron-LM / torchtitan arguments "
                        "(--tensor-model-parallel-size ..., --parallelism.* ...).")
    settings = writers()[engine].read(text)
    settings.pins.setdefault("plan.engine", engine)  # priced as that engine runs it (its tp_runtime)
    if settings.problems:
        raise UserError(f"{path} ({engine}) holds what autopar cannot price: {'; '.join(settings.problems)}.",
                        "change those settings to ones the engine and autopar both run.")
    return settings


def check_engine_file(settings: EngineSettings, world_size: int, path: Path) -> None:
    """Refuse, naming each, the values of a file read back that its engine would reject on a
    cluster of ``world_size`` ranks (degrees that do not divide it, batch sizes that do not add up)."""
    problems = writers()[settings.engine].rules(settings, world_size)
    if problems:
        raise UserError(f"{path} ({settings.engine}) on {world_size} ranks holds what {settings.engine} would reject: "
                        f"{'; '.join(problems)}.", "change those settings (or the cluster) so that the engine runs it.")


def argument_pairs(text: str, separator: str = " ", flags: tuple[str, ...] = ()) -> dict[str, str]:
    """``--name value`` / ``--name=value`` arguments of a file or command line (comments and
    anything before the first option skipped) -> {name: value}; ``flags`` take no value."""
    import shlex

    lines = text.replace("\\\n", " ").splitlines()  # a shell command's continued lines are one
    words = [word for line in lines if not line.lstrip().startswith("#") for word in shlex.split(line)]
    values: dict[str, str] = {}
    index = 0
    while index < len(words):
        word = words[index]
        index += 1
        if not word.startswith("--"):
            continue
        name, has_value, value = word[2:].partition("=")
        if not has_value and name not in flags and index < len(words) and not words[index].startswith("--"):
            value, index = words[index], index + 1
        values[name] = value if (has_value or value) else "true"
    return values


def writer(name: str) -> EngineWriter:
    """The engine named ``name``, or a UserError listing the engines."""
    known = writers()
    if name not in known:
        raise UserError(f"{name!r}: no such engine.", f"use one of {', '.join(ENGINES)}.")
    return known[name]


def writers() -> dict[str, EngineWriter]:
    from autopar.emit import accelerate, deepspeed, megatron, torchtitan

    return {module.WRITER.name: module.WRITER for module in (torchtitan, megatron, deepspeed, accelerate)}


ENGINES = ("torchtitan", "megatron", "deepspeed", "accelerate")


def engine_files(plan: Any, engines: list[str] | tuple[str, ...]) -> dict[str, str]:
    """File name -> text for each engine, or a UserError naming what an engine cannot run."""
    files = {}
    for name in dict.fromkeys(engines):
        engine = writer(name)
        why = engine.refusal(plan)
        if why:
            raise EngineRefusal(name, plan, why)
        files[engine.file_name] = engine.render(plan)
    return files


class EngineRefusal(UserError):
    """A plan that an engine cannot run as it was priced."""

    def __init__(self, engine: str, plan: Any, why: str):
        super().__init__(f"{engine} cannot run the plan {plan.summary()}: {why}.",
                         f"pin plan.* settings that {engine} runs (as the reason says), or emit for another engine.")
        self.engine = engine
        self.why = why


def write_engine_files(plan: Any, engines: list[str] | tuple[str, ...], folder: Path) -> list[Path]:
    """Write each engine's file into ``folder`` (all checked before any is written)."""
    from autopar.output_dir import write_atomically

    files = engine_files(plan, engines)
    written = []
    for name, text in files.items():
        write_atomically(folder / name, text)
        written.append(folder / name)
    return written


def block_recompute(plan: Any) -> dict[str, str]:
    """Recomputation of the repeated blocks (layers named by an index: ``blocks.3``,
    ``model.layers.12``), the only layers an engine's setting checkpoints; embeddings and heads
    are never recomputed by them."""
    return {name: mode for name, mode in plan.recompute.items() if any(part.isdigit() for part in name.split("."))}


def uniform_recompute(plan: Any) -> str:
    """The blocks' recomputation mode when every block has the same ("none" without any), else
    "mixed" (engines set one mode for all blocks: `mixed_recompute` refuses it)."""
    modes = set(block_recompute(plan).values()) or {Recompute.NONE}
    return modes.pop() if len(modes) == 1 else "mixed"


def mixed_recompute(plan: Any) -> str | None:
    """Why an engine cannot say the plan's recomputation, or None."""
    if uniform_recompute(plan) != "mixed":
        return None
    counts: dict[str, int] = {}
    for mode in block_recompute(plan).values():
        counts[mode] = counts.get(mode, 0) + 1
    mix = ", ".join(f"{count} blocks {mode}" for mode, count in sorted(counts.items()))
    return f"recomputation differs by block ({mix}), which its settings cannot say; pin plan.recompute=MODE"


CUSTOM_SYNC = (DPSync.PS, DPSync.HIERARCHICAL, DPSync.HALVING_DOUBLING)


def common_refusal(plan: Any, engine: str, whole_blocks_only: bool = False) -> str | None:
    """What no engine's settings say: autopar's own gradient exchanges, uneven data shares,
    recomputation that differs by block; and, for an engine that checkpoints whole blocks only
    (``whole_blocks_only``), selective recomputation."""
    if whole_blocks_only and uniform_recompute(plan) == Recompute.SELECTIVE:
        return f"{engine} checkpoints whole blocks only; pin plan.recompute=full or none"
    if plan.dp_sync in CUSTOM_SYNC:
        return (f"its gradients are exchanged by autopar's own {plan.dp_sync} all-reduce, {engine} reduces with "
                "NCCL's; pin plan.dp_sync=auto")
    if plan.dp_shares and len(set(plan.dp_shares)) > 1:
        return f"its data-parallel ranks take uneven shares ({plan.dp_shares}), which {engine} does not split"
    return mixed_recompute(plan)


def comment_lines(plan: Any, engine: str) -> list[str]:
    """The header of an arguments file: what made it and how to use it."""
    return [f"# {engine} settings of the autopar plan {plan.summary()}",
            f"# predicted {plan.predicted.step_time_s:.4g} s/step on {plan.world_size} ranks "
            f"(model {plan.provenance.model_path or '?'}); lines starting with # are comments"]

"""What one training step of a model costs, per op and per layer, as data: the profile that
tracing writes (autopar.profile) and everything after it reads. It imports no torch, so that a
plan from a kept profile (autopar.profile_cache) never loads it."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Iterable

from autopar.serialize import from_jsonable, to_jsonable, upgrade_block_containers


def inside(name: str | None, block: str) -> bool:
    """Whether module or layer ``name`` is ``block`` or lies within it."""
    return name is not None and (name == block or name.startswith(block + "."))


def inside_any(name: str | None, blocks: Iterable[str]) -> bool:
    """Whether module or layer ``name`` is one of ``blocks`` or lies within one."""
    return any(inside(name, block) for block in blocks)


def renamed(name: str | None, old: str, new: str) -> str | None:
    """``name`` with the block prefix ``old`` replaced by ``new`` (other names unchanged): a
    copied block's ops are its source block's, renamed."""
    if name is None or not inside(name, old):
        return name
    return new + name[len(old):]


class OpClass(StrEnum):
    """Roofline classes: each gets its own achievable-efficiency factor in the cost model."""

    GEMM = "gemm"
    ATTENTION = "attention"
    ELEMENTWISE = "elementwise"
    NORM = "norm"
    REDUCTION = "reduction"
    MEMORY = "memory"  # copies, gathers, embedding lookups, concatenation: bandwidth-bound
    VIEW = "view"  # aliasing ops: no data moved
    OTHER = "other"  # no formula and no known class: listed in the coverage report



# ATen ops that draw random numbers, by packet name; dropout's (native_dropout) are not among them:
# compile's check runs with dropout off (autopar.sections.contract.DropoutOff).
RANDOM_DRAWS = frozenset({"rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "bernoulli",
                          "normal", "uniform", "exponential", "multinomial", "randperm", "poisson",
                          "cauchy", "geometric", "log_normal", "random"})


@dataclass(frozen=True)
class OpProfile:
    """One ATen op of the training step. Bytes are logical tensor sizes; views move nothing."""

    name: str
    target: str
    op_class: str
    phase: str
    module: str | None
    layer: str
    flops: int
    bytes_read: int
    bytes_written: int
    output_bytes: int
    saved_for_backward_bytes: int
    inputs: list[str]
    input_shapes: list[list[int]]
    output_shapes: list[list[int]]
    causal: bool = False  # attention run with is_causal: its kernel skips the blocks above the diagonal


@dataclass(frozen=True)
class OpClassCost:
    """Aggregate of one op class within a layer and phase (the cost model's roofline input)."""

    flops: int = 0
    bytes: int = 0
    count: int = 0


@dataclass(frozen=True)
class LayerProfile:
    """One pipeline-cuttable unit: a block of the container, an embedding, a norm, a head.

    ``activation_bytes`` is what autograd keeps for backward for the profiled micro-batch;
    ``input_bytes``/``output_bytes`` are the tensors crossing the layer's boundary forward
    (what a pipeline stage sends, and what full recomputation keeps).
    """

    name: str
    index: int
    is_block: bool
    repeat_of: str | None
    param_count: int
    param_bytes: int
    flops_forward: int
    flops_backward: int
    bytes_forward: int
    bytes_backward: int
    activation_bytes: int
    input_bytes: int
    output_bytes: int
    num_ops: int
    forward_by_class: dict[str, OpClassCost]
    backward_by_class: dict[str, OpClassCost]
    param_names: list[str]


@dataclass(frozen=True)
class CoverageEntry:
    """An ATen op met in the trace that has no FLOP formula; `costed_by` says how we price it."""

    op: str
    op_class: str
    count: int
    costed_by: str


@dataclass(frozen=True)
class ModelProfile:
    """Profile of one training step (forward + loss + backward) at `micro_batch_size` samples."""

    model_name: str
    model_path: str
    model_sha256: str
    model_kwargs: dict[str, Any]
    micro_batch_size: int
    tokens_per_sample: int | None
    precision: str
    param_count: int
    param_bytes: int
    buffer_bytes: int
    input_bytes: int
    flops_forward: int
    flops_backward: int
    activation_bytes: int
    num_nodes: int
    seconds: float
    block_containers: list[str]
    """FQNs of the stacks of blocks (containers whose children are layers), in the order their
    blocks run: one for a decoder-only model, two for an encoder-decoder or two towers."""
    torch_version: str
    param_shapes: dict[str, list[int]]
    placeholders: dict[str, str]
    layers: list[LayerProfile]
    coverage: list[CoverageEntry]
    ops: list[OpProfile] = field(default_factory=list)
    """Per-op detail (may be left out of a saved profile with include_ops=False)."""
    sequence_mixers: list[str] = field(default_factory=list)
    """Ops that read other positions of the sequence and that context parallelism does not
    rewrite, described with their module (trace/sequence.py): any makes CP illegal."""
    batch_mixer: str | None = None
    """Why a split of the batch (dp, micro-batches, cp) would train another model, e.g. batch
    normalisation in training mode (trace/batch.py); None: the samples never meet."""
    token_loss: str | None = None
    """The loss's mean over the targets it counts (trace/loss_tokens.py), described: a split of
    the batch weighs each part by its count (None: no such mean, or several)."""
    experts_inputs: dict[str, list[str]] = field(default_factory=dict)
    """FQN -> the required inputs of each ``experts`` module's forward (trace/experts.py):
    expert parallelism exchanges only a module taking one, its tokens grouped by expert."""
    copied_blocks: list[str] = field(default_factory=list)
    """Blocks not traced: each repeats its run's second block, whose ops were copied for it
    (autopar.trace.repeated_blocks); empty when every block was traced."""
    data_dependent: bool = False
    """The step's shapes or branches depend on tensor values, so it was traced with the batch's
    values (autopar.data_dependent), and every later fake run of the model must be too."""
    estimated: list[str] = field(default_factory=list)
    """What of a data-dependent step was read from the example batch or guessed, not traced."""
    real_values: str | None = None
    """Where and why fake tensors could not run the step: it was traced with real tensors at the
    profiled micro-batch (autopar.model_file.build_real), and every later run of the model must be
    real too (no full-scale fake step)."""
    findings: dict[str, Any] = field(default_factory=dict)
    """What planning worked out by running the model (which tensor-parallel splits its code runs:
    autopar/solver/tp_legality.py) and the tensor-parallel splits it proved optimal
    (autopar/solver/tp_split.py), as JSON; kept beside a kept profile (autopar.profile_cache), so
    that planning the same model again asks no question twice."""
    kept_as: str | None = None
    """The key it is kept under between runs (autopar.profile_cache), where its findings are kept
    too; None: not kept."""

    @property
    def flops_total(self) -> int:
        return self.flops_forward + self.flops_backward

    @property
    def blocks(self) -> list[LayerProfile]:
        """Every block of every stack, in layer order."""
        return [layer for layer in self.layers if layer.is_block]

    @staticmethod
    def upgrade_data(data: dict[str, Any]) -> dict[str, Any]:
        """Fields of an older profile file in today's terms (`from_jsonable` calls it)."""
        return upgrade_block_containers(data)

    def params_read(self, op: OpProfile, by_name: dict[str, OpProfile]) -> list[str]:
        """The parameters ``op`` reads, each input followed back through single-input views (a
        linear's transpose) to its placeholder; ``by_name``: the profile's ops by name."""
        found = []
        for source in op.inputs:
            view = by_name.get(source)
            while view is not None and view.op_class == "view" and len(view.inputs) == 1:
                source, view = view.inputs[0], by_name.get(view.inputs[0])
            role = self.placeholders.get(source, "")
            if role.startswith("param:"):
                found.append(role.removeprefix("param:"))
        return found

    @functools.cached_property
    def random_draws(self) -> list[str]:
        """The forward's random draws other than dropout's (a router sampling its experts, noise
        added to its inputs), each as "<op> in <module>" once: a sharded run draws other numbers
        than one process, which compile's check turns only dropout off for."""
        seen: dict[str, None] = {}
        for op in self.ops:
            packet = op.target.split(".")[1] if op.target.startswith("aten.") else ""
            if op.phase == "forward" and packet in RANDOM_DRAWS:
                seen.setdefault(f"{op.target.rsplit('.', 1)[0]} in {op.module or 'the loss'}", None)
        return list(seen)

    def layer(self, name: str) -> LayerProfile:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(name)

    def traced_words(self) -> str:
        """What was traced, in the words `autopar profile` and the planner's progress both print
        (one count of nodes, layers and blocks, whichever command shows it)."""
        stacks = self.block_containers
        named = ", ".join(repr(name) for name in stacks)
        where = (f"block container '{stacks[0]}'" if len(stacks) == 1 else
                 f"{len(stacks)} stacks ({named})" if stacks else "no block container")
        copied = (f", {len(self.copied_blocks)} of them copied from an identical traced block, not traced"
                  if self.copied_blocks else "")
        real = " (traced with real tensors: fake tensors cannot run it)" if self.real_values else ""
        return (f"{self.num_nodes:,} graph nodes in {len(self.layers)} layers; {where} with "
                f"{len(self.blocks)} blocks{copied}{real}")

    def uncosted_ops(self) -> list[CoverageEntry]:
        """Ops we could neither count FLOPs for nor classify: their cost is unknown."""
        return [entry for entry in self.coverage if entry.op_class == OpClass.OTHER]

    def summary(self) -> dict[str, Any]:
        """The CLI's JSON summary keys (everything but the per-op list)."""
        return {
            "model": self.model_name, "param_count": self.param_count, "param_bytes": self.param_bytes,
            "flops_forward": self.flops_forward, "flops_backward": self.flops_backward,
            "activation_bytes": self.activation_bytes, "micro_batch_size": self.micro_batch_size,
            "precision": self.precision, "num_nodes": self.num_nodes, "seconds": self.seconds,
            "layers": [{"name": layer.name, "param_count": layer.param_count,
                        "flops_forward": layer.flops_forward, "flops_backward": layer.flops_backward,
                        "activation_bytes": layer.activation_bytes, "repeat_of": layer.repeat_of}
                       for layer in self.layers],
        }

    def to_json(self, include_ops: bool = True) -> str:
        data = to_jsonable(self)
        if not include_ops:
            data["ops"] = []
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "ModelProfile":
        return from_jsonable(cls, json.loads(text))

    def save(self, path: str | Path, include_ops: bool = True) -> None:
        Path(path).write_text(self.to_json(include_ops))

    @classmethod
    def load(cls, path: str | Path) -> "ModelProfile":
        return cls.from_json(Path(path).read_text())

"""One rank of a compiled plan on fake tensors: its memory as PyTorch tracks it, next to the
cost model's prediction for that rank. No GPU and no cluster needed.

    python -m autopar.runtime.fake_memory out/llama70b              # rank 0, prints JSON
    python -m autopar.runtime.fake_memory out/llama70b --rank 300

How: torch's ``fake`` process-group backend stands in for the other N-1 ranks (collectives
return at once); the generated module's ``setup(..., fake_mode=...)`` builds the model on the
meta device, shards it with the real mesh (DTensor, FSDP2) and gives this rank's shards fake
storage (FakeTensorMode: shapes and dtypes, no bytes), so a 70B model on 512 GPUs is measured
in a few GB of host memory. PyTorch's MemTracker (FSDPMemTracker for an FSDP-wrapped model)
then attributes every tensor of a training step to parameters, gradients, optimizer state,
activations or temporaries. It runs on the CPU, computing in the plan's precision as the GPU
would (bf16 parameters gathered by FSDP, autocast).

What is measured:
  pp = 1  the generated ``train_step`` (every micro-batch, backward, optimizer step), after one
          warm-up step that creates the optimizer state, as on every step but the first;
          the peak is the tracker's, its breakdown the categories at that moment.
  pp > 1  a pipeline schedule cannot run on fake data (its stages first agree on shapes and on
          a static/dynamic vote by exchanging values), so each stage module of this rank runs a
          micro-batch forward and backward under its own tracker, with FSDP set as torch's
          PipelineStage sets it (no resharding after backward, gradients accumulated whole until
          the step's last micro-batch) and gradients already accumulating from an earlier
          micro-batch. Parameters, gradients and optimizer state are read after that backward;
          activations are the bytes each stage's forward left for backward, summed over the
          micro-batches torch's own schedule keeps in flight on this rank at its worst step
          (``pipeline_order``); buffers are FSDP's gathered parameters of every local stage plus
          the rest of the largest micro-batch peak; the total is their sum. The optimizer step
          is not tracked. A stage's input, received from the previous stage in a real run, is a
          fake tensor shaped like the activation this rank's shard of the whole model passes there.

Not seen on the CPU: the CUDA caching allocator's rounding and fragmentation, and CUDA's
autocast op lists, which differ from the CPU's (CUDA runs layer_norm in fp32, so a GPT block's
q, k and v projections each cast and keep their own bf16 copy of its output; the CPU keeps one).

Compile's proof takes the same measurement of every GPU rank it proves, after its own step in the
same fake world (`memory_floor`), and rejects a plan whose measured floor passes the GPU's memory.

The prediction is ``stage_details[pp_rank]["memory_breakdown"]`` of the plan priced again from
plan.json (`autopar.saved.price_saved_plan`). The CUDA context it includes holds no tensors
(nothing to measure on fake tensors) and is left out of both totals.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from autopar.runtime.fake_step import (AfterStep, FakeRank, ShardingPropagation, StepRun, fake_rank, finish_stage_step,
                                       stage_micro_batch, step_on)

if TYPE_CHECKING:
    from autopar.plans import Plan
    from cost_models.hardware import GPUSpec

CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")
# MemTracker's and FSDPMemTracker's reference types -> the cost model's categories; every other
# type (FSDP's gathered parameters and their all-gather / reduce-scatter buffers, backward
# temporaries, inputs, module buffers) is a buffer in the cost model's sense. FSDP's unsharded
# gradients are gradients: a pipeline stage accumulates them there until the step's end.
CATEGORY_OF = {"Parameter": "params", "Sharded Param": "params", "Gradient": "grads", "Sharded Grad": "grads",
               "Unsharded Grad": "grads", "Optstate": "optimizer", "OptState": "optimizer",
               "Activation": "activations"}
FORWARD_ACTIONS = ("F",)
BACKWARD_ACTIONS = ("B", "I")  # full backward, or backward-input (frees the stage's activations)


@dataclass
class RankMemory:
    """Bytes one rank holds, by the cost model's categories.

    Attributes:
        rank, pp_rank: the global rank and its pipeline coordinate.
        measured: per category at the measured peak (see the module docstring for pp > 1), and
            "total".
        predicted: the cost model's per category for that pipeline rank, and "total" (CUDA
            context excluded).
        error_pct: (predicted - measured) / measured x 100 per category and for the total.
        what_was_measured: how the measured numbers were obtained, in words.
        tracker: the tracker's own categories at its peak (bytes), unmapped.
        untracked_bytes: live fake tensors the tracker never saw (set up before it started and
            not owned by the model or optimizer); 0 when everything was accounted.
        cuda_context_bytes: what the prediction adds for the CUDA context (not compared).
        in_flight: micro-batches in flight per local stage at the schedule's worst step (pp > 1).
    """

    plan: str
    world_size: int
    rank: int
    pp_rank: int
    measured: dict[str, int]
    predicted: dict[str, int]
    error_pct: dict[str, float | None]
    what_was_measured: str
    tracker: dict[str, int] = field(default_factory=dict)
    untracked_bytes: int = 0
    cuda_context_bytes: int = 0
    in_flight: list[int] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


# -- measuring ----------------------------------------------------------------------------------


def measure_rank(out_dir: str | Path, rank: int = 0) -> tuple[dict[str, int], dict[str, Any]]:
    """Rank ``rank`` of the compiled folder's plan, measured on fake tensors.

    Returns:
        (bytes per category and "total", details: pp_rank, in_flight, tracker, untracked_bytes,
        what_was_measured).
    """
    propagation = ShardingPropagation()
    with fake_rank(out_dir, rank, propagation) as r:
        run = step_on(r, rank)  # a whole step first: the optimizer state exists after it
        return measure_after(r, run, propagation)


def measure_after(r: FakeRank, run: StepRun, propagation: ShardingPropagation
                  ) -> tuple[dict[str, int], dict[str, Any]]:
    """`measure_rank` of a rank that has run one whole step (`fake_step.step_on`), so that its
    optimizer state exists, as on every step but the first."""
    if r.parallel.schedule is None:
        measured, details = _measure_step(r.generated, r.parallel, r.batch, r.training, r.config,
                                          r.model_module, r.fake_mode, propagation)
    else:
        measured, details = _measure_stages(r.generated, r.parallel, run, r.training, r.config, r.fake_mode,
                                            r.pp_rank, propagation)
    return measured, {"pp_rank": r.pp_rank, **details}


def _measure_step(generated: ModuleType, parallel: Any, batch: Any, training: Any, config: Any,
                  model_module: Any, fake_mode: Any, propagation: ShardingPropagation
                  ) -> tuple[dict[str, int], dict[str, Any]]:
    """The generated train_step, tracked (pp = 1)."""
    model = parallel.modules[0]
    tracker = _tracker(model, parallel.optimizer, propagation)
    with _one_forward_per_root(tracker, model), tracker:
        generated.train_step(parallel, batch, training, config, model_module)
    peak = _snapshot(tracker, "peak")
    measured = _by_category(peak)
    what = (f"train_step measured: {training.num_micro_batches} micro-batch(es) of {training.micro_batch_size}, "
            "backward, optimizer step; breakdown at the tracker's peak")
    return measured, {"tracker": peak, "untracked_bytes": _untracked_bytes(fake_mode, tracker), "in_flight": [],
                      "what_was_measured": what}


def _measure_stages(generated: ModuleType, parallel: Any, run: StepRun, training: Any, config: Any,
                    fake_mode: Any, pp_rank: int, propagation: ShardingPropagation
                    ) -> tuple[dict[str, int], dict[str, Any]]:
    """One micro-batch through each local stage module, its activations scaled by the
    schedule's in-flight micro-batches (pp > 1; see the module docstring)."""
    micro, indices, received = run.micro, run.indices, run.received
    stage_micro_batch(generated, parallel, micro, received, config, indices)  # gradients accumulating
    trackers: dict[int, _StageTracking] = {}

    def watch(index: int, module: nn.Module) -> _StageTracking:
        trackers[index] = _StageTracking(module, _tracker(module, parallel.optimizer, propagation))
        return trackers[index]

    stage_micro_batch(generated, parallel, micro, received, config, indices, watch)
    finish_stage_step(parallel)
    activations = {index: t.activation_bytes for index, t in trackers.items()}
    in_flight = schedule_in_flight(parallel.schedule, pp_rank, indices)
    states = [_by_category(t.after_backward) for t in trackers.values()]
    peaks = [_snapshot(t.tracker, "peak") for t in trackers.values()]
    # Each stage module's tracker sees its own parameters and gradients, and the one optimizer;
    # FSDP's gathered copy of a stage is held while its micro-batches are in flight (all stages
    # at once under interleaving), the other buffers come and go with one stage's work.
    gathered = [peak.get("Unsharded Param", 0) for peak in peaks]
    measured = {"params": sum(s["params"] for s in states), "grads": sum(s["grads"] for s in states),
                "optimizer": max(s["optimizer"] for s in states),
                "activations": max_in_flight_bytes(parallel.schedule, pp_rank, activations),
                "buffers": sum(gathered) + max(_by_category(peak)["buffers"] - copy
                                               for peak, copy in zip(peaks, gathered))}
    measured["total"] = sum(measured[c] for c in CATEGORIES)
    what = (f"pp rank {pp_rank}: a micro-batch of {training.micro_batch_size} through stage(s) {indices}, forward and "
            f"backward with FSDP set as torch's schedule sets it (gradients accumulating from an earlier micro-batch; "
            f"one tracker per stage module); params/grads/optimizer after its backward; activations = measured "
            f"per-micro-batch activations {[activations[i] for i in indices]} bytes x in-flight micro-batches "
            f"{in_flight} of torch's schedule at its worst step; buffers = the rest of the micro-batch's peak, "
            f"FSDP's gathered parameters of every local stage (the optimizer step is not tracked); total = their sum")
    return measured, {"tracker": _sum_snapshots(peaks), "in_flight": in_flight, "what_was_measured": what,
                      "untracked_bytes": _untracked_bytes(fake_mode, *(t.tracker for t in trackers.values()))}


class _StageTracking:
    """One stage module's tracker (a fake_step.StageWatch) and what it saw of one micro-batch:
    the activations its forward left, and the tracker's categories after its backward."""

    def __init__(self, module: nn.Module, tracker: Any):
        self.module, self.tracker = module, tracker
        self.activation_bytes = 0
        self.after_backward: dict[str, int] = {}
        self._before = 0
        _tag_accumulated_grads(tracker, module)

    def __enter__(self) -> "_StageTracking":
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.tracker.__exit__(*exc)
        _tag_accumulated_grads(self.tracker, self.module)
        self.after_backward = _snapshot(self.tracker, "current")

    def forward_begins(self) -> None:
        self._before = _snapshot(self.tracker, "current").get("Activation", 0)

    def forward_ends(self) -> None:
        self.activation_bytes = _snapshot(self.tracker, "current").get("Activation", 0) - self._before


def _tag_accumulated_grads(tracker: Any, module: nn.Module) -> None:
    """FSDPMemTracker names gradients in FSDP's reduction hook; without reduction (a pipeline's
    micro-batches) FSDP accumulates them unsharded in fp32, which the tracker leaves as
    backward temporaries: name them unsharded gradients."""
    from torch.distributed.fsdp import FSDPModule

    if not hasattr(tracker, "_root_mod"):
        return
    reftype = tracker._ref_class.UNSHARDED_GRAD
    for sub in module.modules():
        group = sub._get_fsdp_state()._fsdp_param_group if isinstance(sub, FSDPModule) else None
        for fsdp_param in group.fsdp_params if group is not None else ():
            for grad in (fsdp_param.unsharded_accumulated_grad, fsdp_param._unsharded_param.grad):
                if grad is not None:
                    tracker._update_and_maybe_create_winfos(grad, reftype)


def _sum_snapshots(snapshots: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for snapshot in snapshots:
        for key, value in snapshot.items():
            total[key] = total.get(key, 0) + value
    return total


# -- the tracker --------------------------------------------------------------------------------


def _ignoring_propagation(tracker_class: type, propagation: ShardingPropagation) -> type:
    """``tracker_class`` that lets DTensor's shape propagation run untracked."""

    class Tracker(tracker_class):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
            if propagation.depth:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    Tracker.__name__ = tracker_class.__name__
    return Tracker


def _tracker(model: nn.Module, optimizer: Any, propagation: ShardingPropagation) -> Any:
    """FSDPMemTracker for an FSDP-wrapped root, else MemTracker; the optimizer's state (and, for
    ZeRO-1, the slice of parameters it updates, a copy it owns) as optimizer state."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    inner = _torch_optimizers(optimizer)
    if isinstance(model, FSDPModule) and len(inner) <= 1:
        tracker = _ignoring_propagation(FSDPMemTracker, propagation)(model, inner[0] if inner else None)
    else:
        tracker = _ignoring_propagation(MemTracker, propagation)()
        tracker.track_external(model, *inner)
    parameters = {id(p) for p in model.parameters()}
    owned = [p for o in inner for group in o.param_groups for p in group["params"] if id(p) not in parameters]
    for tensor in owned:
        tracker._update_and_maybe_create_winfos(tensor, tracker._ref_class.OPT)
    return tracker


def _torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind the generated one (ZeRO-1's and the gradient exchanges'
    wrappers hold theirs as an attribute)."""
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    return [value for value in vars(optimizer).values() if isinstance(value, torch.optim.Optimizer)]


@contextlib.contextmanager
def _one_forward_per_root(tracker: Any, model: nn.Module) -> Iterator[None]:
    """MemTracker and FSDPMemTracker refuse a root module's second forward in one tracking (they
    take it for a second iteration); micro-batches are exactly that, so their per-module
    statistics (not the peak, which is global) are reset before each. A global hook registered
    before the tracker's: it runs first."""
    def reset(module: nn.Module, args: tuple) -> None:
        if module is model and model in tracker.memory_tracking:
            tracker.reset_mod_stats()

    handle = nn.modules.module.register_module_forward_pre_hook(reset)
    try:
        yield
    finally:
        handle.remove()


def _snapshot(tracker: Any, which: str) -> dict[str, int]:
    """The tracker's CPU snapshot as {category name: bytes} (one device: this rank's)."""
    snapshot = tracker.get_tracker_snapshot(which)
    merged: dict[str, int] = {}
    for per_device in snapshot.values():
        for key, value in per_device.items():
            name = getattr(key, "value", key)
            merged[name] = merged.get(name, 0) + int(value)
    return merged


def _by_category(snapshot: dict[str, int]) -> dict[str, int]:
    """A tracker snapshot in the cost model's categories, with their total."""
    result = dict.fromkeys(CATEGORIES, 0)
    for name, value in snapshot.items():
        if name != "Total":
            result[CATEGORY_OF.get(name, "buffers")] += value
    result["total"] = sum(result[c] for c in CATEGORIES)
    return result


def _untracked_bytes(fake_mode: Any, *trackers: Any) -> int:
    """Bytes of this rank's live fake tensors (made under ``fake_mode``) no tracker has a record
    of (made before it started and not registered): what the measurement misses."""
    from torch._subclasses.fake_tensor import FakeTensor

    gc.collect()  # what only reference cycles keep (the stage-input probe's model) is not held
    seen: set[int] = set()
    missing = 0
    with warnings.catch_warnings():  # isinstance on every object touches deprecated module attributes
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if isinstance(obj, FakeTensor) and obj.fake_mode is fake_mode]
    for obj in objects:
        storage = obj.untyped_storage()
        if id(storage) in seen or storage.nbytes() == 0:
            continue
        seen.add(id(storage))
        if all(tracker._WINFO.get(storage, (None, None))[0] is None for tracker in trackers):
            missing += storage.nbytes()
    return missing


# -- the schedule -------------------------------------------------------------------------------

def _stage_actions(schedule: Any, pp_rank: int) -> list[tuple[str, int, int]]:
    """(computation, stage, micro-batch) of this rank's compute actions, in torch's order."""
    actions = []
    for action in schedule.pipeline_order.get(pp_rank, []):
        if action is None:
            continue
        kind = getattr(action.computation_type, "value", str(action.computation_type))
        actions.append((str(kind), action.stage_index, action.microbatch_index))
    return actions


def max_in_flight_bytes(schedule: Any, pp_rank: int, per_stage_bytes: dict[int, int]) -> int:
    """Most activation bytes this rank holds at once when torch's schedule plays its actions:
    each forward adds its stage's per-micro-batch bytes, each backward frees them."""
    held = peak = 0
    for kind, stage, _ in _stage_actions(schedule, pp_rank):
        if kind in FORWARD_ACTIONS:
            held += per_stage_bytes.get(stage, 0)
            peak = max(peak, held)
        elif kind in BACKWARD_ACTIONS:
            held -= per_stage_bytes.get(stage, 0)
    return peak


def schedule_in_flight(schedule: Any, pp_rank: int, indices: list[int]) -> list[int]:
    """Micro-batches of each local stage in flight at the step where the most are."""
    counts = dict.fromkeys(indices, 0)
    best = dict(counts)
    for kind, stage, _ in _stage_actions(schedule, pp_rank):
        counts[stage] = counts.get(stage, 0) + (1 if kind in FORWARD_ACTIONS else -1 if kind in BACKWARD_ACTIONS else 0)
        if sum(counts.values()) > sum(best.values()):
            best = dict(counts)
    return [best.get(i, 0) for i in indices]


# -- the prediction and the comparison ----------------------------------------------------------

def pipeline_rank(plan: Any, rank: int) -> int:
    """The pipeline coordinate of ``rank``."""
    from autopar.domain.mesh import Mesh

    return Mesh.of(plan).coordinate(rank, "pp")


def predict_rank(out_dir: str | Path, rank: int = 0) -> tuple[dict[str, int], int]:
    """The cost model's bytes per category for ``rank``'s pipeline rank, priced again from the
    folder's plan.json and model file; "total" leaves out the CUDA context, returned apart."""
    from autopar.saved import price_saved_plan
    from autopar.plans import Plan
    from cost_models.step import CUDA_CONTEXT_BYTES

    out_dir = Path(out_dir)
    plan = Plan.load(out_dir / "plan.json")
    _, estimate = price_saved_plan(plan, out_dir / Path(plan.provenance.model_path).name, None)
    details = estimate.stage_details[pipeline_rank(plan, rank)]
    breakdown = details["memory_breakdown"]
    context = CUDA_CONTEXT_BYTES if any(gpu != "cpu" for gpu in details["gpu"]) else 0
    predicted = {c: int(breakdown[c]) for c in CATEGORIES}
    predicted["buffers"] += int(breakdown.get("optimizer_step", 0)) - context  # the step's transients, if its peak
    predicted["total"] = sum(predicted[c] for c in CATEGORIES)
    return predicted, context


def error_pct(measured: dict[str, int], predicted: dict[str, int]) -> dict[str, float | None]:
    """(predicted - measured) / measured x 100 per key: how far the prediction is off what the
    rank holds (None where nothing was measured)."""
    return {key: (round(100 * (predicted[key] - measured[key]) / measured[key], 1) if measured[key] else None)
            for key in (*CATEGORIES, "total")}


def check_rank(out_dir: str | Path, rank: int = 0) -> RankMemory:
    """Measure ``rank`` of a compiled folder on fake tensors and compare with its prediction."""
    out_dir = Path(out_dir)
    measured, details = measure_rank(out_dir, rank)
    predicted, context = predict_rank(out_dir, rank)
    plan = json.loads((out_dir / "plan.json").read_text())
    return RankMemory(plan=out_dir.name, world_size=plan["dp"] * plan["tp"] * plan["pp"] * plan["cp"], rank=rank,
                      pp_rank=details["pp_rank"], measured=measured, predicted=predicted,
                      error_pct=error_pct(measured, predicted), what_was_measured=details["what_was_measured"],
                      tracker=details["tracker"], untracked_bytes=details["untracked_bytes"],
                      cuda_context_bytes=context, in_flight=details["in_flight"])


class OverMemory(Exception):
    """A rank's tensors alone, measured on fake tensors at full scale, need more than its GPU has."""


def rank_gpu(plan: Plan, rank: int) -> GPUSpec | None:
    """The GPU rank ``rank`` of ``plan`` runs on, from the cluster the plan records; None on a CPU
    rank (its memory is the host's) and for a plan that records no cluster."""
    from autopar.saved import recorded_cluster

    if not plan.provenance.cluster_config:  # a plan of an older autopar
        return None
    gpu = recorded_cluster(plan.provenance.cluster_config).gpu_of_rank(rank)
    return None if gpu.name == "cpu" else gpu


def memory_floor(out_dir: str | Path, rank: int) -> AfterStep:
    """What compile's proof runs after its full-scale step of ``rank`` (fake_step.train_fake_step's
    ``after``): on a GPU rank (`rank_gpu`), the rank's memory, measured as `measure_rank` measures
    it (one more tracked step in the same fake world), against the GPU's whole memory. What fake
    tensors see is a floor of what CUDA holds (its caching allocator's rounding and fragmentation
    and its autocast copies come on top), so a plan whose floor with the CUDA context passes the
    GPU's memory fails there for certain, whatever the cost model said: OverMemory is raised and
    the plan rejected. A measurement that cannot run only says so."""
    from autopar.plans import Plan
    from cost_models.hardware import GiB
    from cost_models.layer_cost import cuda_context_bytes

    def after(r: FakeRank, run: StepRun, propagation: ShardingPropagation) -> str:
        plan = Plan.load(Path(out_dir) / "plan.json")
        gpu = rank_gpu(plan, rank)
        if gpu is None:
            return run.words
        predicted = plan.predicted.peak_memory_bytes  # the plan's busiest rank's
        try:
            measured, _ = measure_after(r, run, propagation)
        except Exception as err:  # noqa: BLE001 - the step passed; only its measurement failed
            first = (str(err).strip().splitlines() or [""])[0][:200]
            return f"{run.words}; its memory not measured ({type(err).__name__}: {first})"
        need = measured["total"] + cuda_context_bytes(gpu)
        gpu_gib = gpu.memory_bytes / GiB
        said = f"; the plan's busiest rank was predicted {predicted / GiB:.1f} GiB" if predicted else ""
        if need > gpu.memory_bytes:
            raise OverMemory(f"its tensors alone need {need / GiB:.1f} GiB on this rank, more than the {gpu_gib:.1f} "
                             f"GiB of its {gpu.name} (measured on fake tensors, CUDA context included{said})")
        return f"{run.words}; memory at least {need / GiB:.1f} of {gpu_gib:.1f} GiB (measured{said})"

    return after


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autopar.runtime.fake_memory",
                                     description="Measure one rank of a compiled plan on fake tensors (no GPU) and "
                                                 "compare with the cost model's prediction; prints JSON.")
    parser.add_argument("out_dir", help="a folder written by `autopar compile`")
    parser.add_argument("--rank", type=int, default=0, help="the global rank to measure (default 0)")
    args = parser.parse_args(argv)
    print(check_rank(args.out_dir, args.rank).to_json())
    return 0


if __name__ == "__main__":
    from autopar.runtime.lifeline import end_process

    end_process(main())

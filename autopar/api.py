"""autopar inside a training script of your own: plan, parallelize, estimate.

    import autopar
    plan = autopar.plan("model.py", cluster="cpu_gloo", train={"global_batch_size": 16})
    training = autopar.parallelize(build_model(), plan)      # under torchrun, on every rank
    for step in range(100):
        loss = training.step(next_global_batch())

The same search as `autopar plan`, and the same code as `autopar compile`: `parallelize` writes
the module compile would write for the plan into a private folder, proves it at full scale on
fake tensors (as compile does) and imports it, then runs that module's own `setup` on the given
model and its `train_step` for each `step`. The API is the generated module used in process, not
a second implementation, so what `autopar run` trains and what a loop of `step` calls trains are
the same numbers (tests/dist/test_api.py).

Under torch.distributed every rank calls the same functions with the same arguments: rank 0
plans (the solver may run several workers, whose ties could fall differently on each rank) and
the others receive its plan. A batch given to `step` is the step's global batch, the same on
every rank; each rank takes its share as the plan splits it (data-parallel samples, context-
parallel sequence shards, micro-batches).
"""
from __future__ import annotations

import atexit
import inspect
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, Callable

from autopar.errors import UserError

ModelSource = str | Path | ModuleType | Callable[..., Any]


def plan(model_file: ModelSource, /, *overrides: str, **settings: Any) -> Any:
    """The fastest plan that fits, as `autopar plan` finds it (an `autopar.plans.Plan`).

    Args:
        model_file: a model.py (the contract: build_model, example_batch, optional loss_fn), as a
            path, the imported module, or any function defined in it.
        overrides: Hydra overrides as on the command line ("cluster=dgx_h100", "plan.tp=2").
        settings: the same as keywords: ``cluster="cpu_gloo"``, ``model={"layers": 4}``,
            ``plan={"tp": 2}``; a dotted key through ``**{"cluster.nodes": 2}``.
    """
    from autopar.plans import Plan

    path = model_path(model_file)
    text = on_rank_zero(lambda: _search(path, overrides_of(overrides, settings)).to_json())
    return Plan.from_json(text)


def estimate(model_file: ModelSource, /, *overrides: str, **settings: Any) -> Any:
    """The price of the plan the plan.* settings pin (`autopar estimate`): a
    `cost_models.step.Estimate` with its step time, memory and breakdown."""
    from autopar.config import compose_config
    from autopar.driver import run_estimate

    cfg = compose_config(overrides_of(overrides, settings))
    return run_estimate(model_path(model_file), cfg)[2]


def parallelize(model: Any, plan: Any, *, model_file: ModelSource | None = None,
                options: dict[str, Any] | None = None, prove: bool = True) -> "ParallelTraining":
    """Apply ``plan`` to ``model`` on this rank: tensor parallelism, recomputation, FSDP/ZeRO,
    and the pipeline stages and schedule where the plan has a pipeline; returns what trains it.

    Args:
        model: the unsharded model, built the same way on every rank (same seed); rank 0's weights
            are compared with every other rank's, and a difference is refused.
        plan: from `plan` (or `autopar.plans.Plan.load("plan.json")`).
        model_file: the model.py the plan was made for (default: the plan's record of it); its
            example_batch and loss_fn are used, its build_model is not.
        options: the generated module's command-line options by name (``lr``, ``steps`` for the
            learning-rate schedule, ``max_grad_norm``, ``warmup_steps``, ``schedule``, ``seed``;
            ``checkpoint_dir`` and ``checkpoint_every``: save every N steps there, as DCP
            checkpoints any plan can load, and resume from the latest complete one now, with
            ``steps_done`` set to its step; a frequency without a folder is refused: the generated
            module lives in a temporary folder, removed when the process ends).
        prove: run compile's proof (one step at full scale on fake tensors) before training.
    """
    import torch.distributed as dist

    from autopar.codegen import generate
    from autopar.runtime.generated import import_generated

    path = model_path(model_file) if model_file is not None else Path(plan.provenance.model_path)
    if (options or {}).get("checkpoint_every") and not (options or {}).get("checkpoint_dir"):
        # The generated module's own folder (its default checkpoint folder) is removed at exit.
        raise UserError("checkpoint_every needs a checkpoint_dir: the module autopar.parallelize generates lives "
                        "in a temporary folder that is removed when the process ends, checkpoints with it.",
                        "pass options={'checkpoint_dir': <a folder of yours>, 'checkpoint_every': N}.")
    if not dist.is_initialized():
        raise UserError("autopar.parallelize needs the process group of the ranks that train.",
                        "call torch.distributed.init_process_group() first (launched with torchrun: "
                        f"--nproc-per-node {plan.world_size}).")
    if dist.get_world_size() != plan.world_size:
        raise UserError(f"The plan is for {plan.world_size} ranks; this job has {dist.get_world_size()}.",
                        f"launch {plan.world_size} ranks, or plan for {dist.get_world_size()}.")
    folder = Path(tempfile.mkdtemp(prefix="autopar-parallel-"))
    # The generated module is imported from this folder and may read the files beside it while it
    # trains (checkpointing.py, training_data.py): the folder goes when the process ends, or at
    # once if this call fails, so no call leaves one behind in the temporary directory.
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    try:
        gpus_per_node = plan.provenance.cluster_config.get("gpus_per_node") or None
        files = generate(plan, path, folder, gpus_per_node=gpus_per_node)
        if prove:
            failure = on_rank_zero(lambda: _proof_failure(plan, path, folder))
            if failure:
                raise UserError(f"The plan {plan.summary()} fails compile's proof: {failure}.",
                                "plan again (autopar.plan moves past nothing by itself: `autopar compile` does), "
                                "or pin other plan.* settings.")
        module = import_generated(files.script, f"autopar_parallel_{folder.name.replace('-', '_')}")
        return ParallelTraining.of(module, model, _argv(options))
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


@dataclass
class ParallelTraining:
    """One rank's part of the model and what trains it, from the generated module.

    Attributes:
        module: the generated module (its functions are what `step` runs).
        parallel: its ParallelModel: ``modules`` (the model, or this rank's pipeline stages),
            ``optimizer``, ``mesh``, ``schedule``.
        steps_done: optimizer steps taken (the learning-rate schedule's position).
    """

    module: ModuleType
    parallel: Any
    training: Any
    config: Any
    model_module: Any
    checkpointer: Any = None  # the generated checkpointing.py's Checkpointer (None without checkpoints)
    steps_done: int = 0
    losses: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, module: ModuleType, model: Any, argv: list[str]) -> "ParallelTraining":
        training = module.train_config(module.PLAN, module.command_line(argv))
        config = module.parallel_config(module.PLAN)
        device, _ = module.pick_device()
        check_same_weights(model, device)
        loaded = module.load_model_file(training.model_file)
        model_module = SimpleNamespace(build_model=lambda **_: model, example_batch=loaded.example_batch,
                                       loss_fn=getattr(loaded, "loss_fn", None))
        parallel = module.setup(training, config, module.tp_plan, model_module, device)
        if not training.checkpoint.enabled:
            return cls(module, parallel, training, config, model_module)
        checkpointer = module.checkpointing.Checkpointer(training.checkpoint, parallel.modules, parallel.optimizer,
                                                         config.dims, config.tied_parameters)
        return cls(module, parallel, training, config, model_module, checkpointer, steps_done=checkpointer.resume())

    @property
    def modules(self) -> list[Any]:
        return self.parallel.modules

    @property
    def optimizer(self) -> Any:
        return self.parallel.optimizer

    def step(self, batch: Any) -> float:
        """One optimizer step on the global ``batch`` (the same on every rank); returns its loss
        as one process computes it, on every rank."""
        module, training, config, parallel = self.module, self.training, self.config, self.parallel
        check_batch_size(batch, training.global_batch_size)
        first, size = training.share(module.dp_rank(parallel.mesh, config.dims))
        mine = module.slice_batch(batch, first, first + size * training.num_micro_batches)
        local = module.to_rank(mine, config, parallel.mesh, parallel.device)
        with module.attention_context(parallel, config, training, self.model_module):
            loss = module.train_step(parallel, local, training, config, self.model_module, self.steps_done)
        self.steps_done += 1
        self.losses.append(module.global_loss(loss, config.dims, parallel.device))
        if self.checkpointer is not None and self.steps_done % training.checkpoint.every == 0:
            self.checkpointer.save(self.steps_done)
        return self.losses[-1]

    def close(self) -> None:
        """Save the last step's state if it was not saved yet, and wait for every checkpoint
        write (nothing without checkpoints); call it on every rank when training ends."""
        if self.checkpointer is not None:
            self.checkpointer.finish(self.steps_done)

    def example_batch(self, step: int | None = None) -> Any:
        """The global batch the compiled module trains on at ``step`` (default: the next one):
        example_batch drawn from the run's seed, as `autopar run` without data draws it."""
        step = self.steps_done if step is None else step
        return self.module.make_batch(self.model_module, self.training.model_kwargs, self.training.global_batch_size,
                                      self.training.seed + 1 + step)

    def full_parameters(self) -> dict[str, Any] | None:
        """Every parameter whole, under its name in the unsharded model, on rank 0 (None on the
        others); every rank must call it."""
        return self.module.full_parameters(self.parallel, self.config)


def model_path(model: ModelSource) -> Path:
    """The model.py behind a path, a module or a function defined in one."""
    if isinstance(model, (str, Path)):
        return Path(model)
    if isinstance(model, ModuleType):
        found = getattr(model, "__file__", None)
    elif callable(model):
        try:
            found = inspect.getsourcefile(model)
        except TypeError:
            found = None
    else:
        found = None
    if not found:
        raise UserError(f"Cannot tell which file defines {model!r}.",
                        "pass the model.py's path (for a script: __file__), its module, or a function defined in it.")
    return Path(found)


def overrides_of(overrides: tuple[str, ...] | list[str], settings: dict[str, Any]) -> list[str]:
    """Command-line overrides from positional ones and keyword settings (nested dicts flattened
    into dotted keys; True/False/None as Hydra spells them)."""
    flat: list[str] = list(overrides)

    def add(key: str, value: Any) -> None:
        if isinstance(value, dict):
            for name, inner in value.items():
                add(f"{key}.{name}", inner)
        else:
            flat.append(f"{key}={_hydra_value(value)}")

    for key, value in settings.items():
        add(key, value)
    return flat


def _hydra_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra_value(item) for item in value) + "]"
    return str(value)


def _argv(options: dict[str, Any] | None) -> list[str]:
    argv: list[str] = []
    for name, value in (options or {}).items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    return argv


def _search(path: Path, overrides: list[str]) -> Any:
    from autopar.config import compose_config
    from autopar.driver import run_plan

    return run_plan(path, compose_config(overrides)).plan


def _proof_failure(plan: Any, path: Path, folder: Path) -> str:
    from autopar.runtime.proof import prove

    outcome = prove(plan, path, folder, check=False)
    return "" if outcome.ok else outcome.failure


def on_rank_zero(compute: Callable[[], Any]) -> Any:
    """``compute()`` on rank 0 alone, its result (or its UserError) given to every rank; without
    a process group, just ``compute()``."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return compute()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", compute())
        except Exception as err:  # noqa: BLE001 - the other ranks wait for an answer either way
            box[0] = (("error", err.problem, err.fix) if isinstance(err, UserError)
                      else ("error", f"rank 0 failed: {type(err).__name__}: {err}", None))
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    if box[0][0] == "error":
        raise UserError(box[0][1], box[0][2])
    return box[0][1]


def check_same_weights(model: Any, device: Any) -> None:
    """Refuse a model whose weights differ between ranks (built without a common seed): FSDP and
    tensor parallelism would shard different models and train neither. One sum per tensor is
    compared, not the weights."""
    import torch
    import torch.distributed as dist

    tensors = [t for t in model.state_dict().values() if t.is_floating_point() and not t.is_meta]
    if not tensors or dist.get_world_size() == 1:
        return
    sums = torch.stack([t.detach().double().sum() for t in tensors]).to(device)
    low, high = sums.clone(), sums.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if not torch.equal(low, high):
        raise UserError("The ranks built different weights: the model passed to autopar.parallelize differs "
                        "between ranks.", "seed before building it (torch.manual_seed(0)) on every rank, or load the "
                        "same weights on each.")


def check_batch_size(batch: Any, global_batch_size: int) -> None:
    """A batch of another size than the plan's global batch is refused: the plan splits that size."""
    from torch.utils._pytree import tree_leaves

    sizes = {leaf.shape[0] for leaf in tree_leaves(batch) if hasattr(leaf, "shape") and leaf.dim() > 0}
    if sizes and sizes != {global_batch_size}:
        raise UserError(f"A batch of {sorted(sizes)} samples was given; the plan trains global batches of "
                        f"{global_batch_size}.", "pass the whole global batch to step() on every rank (each rank "
                        "takes its share), or plan with train.global_batch_size set to your batch.")

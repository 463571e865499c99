"""Batches: each step's samples for this rank (the user's data, or example_batch), and the validation loss.

Where a run's samples come from, in this order: the model file's ``dataset(split, **kw)`` hook
(a map-style or iterable torch dataset of samples that collate into example_batch's structure),
else the built-in text pipeline when ``DATA["path"]`` names a corpus (training_data.py packs it
into token sequences; data_loading.py fills example_batch's structure with them), else
``example_batch`` drawn per step from the seed (what planning traced). Which samples of a step
this rank reads, and how a resumed run continues at the sample, is data_loading.py's.
"""
from __future__ import annotations

import ast
import contextlib
import inspect
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

# In a generated folder these are training_data.py and data_loading.py beside the training module.
from autopar.sections import data as training_data
from autopar.sections import loader as data_loading
from autopar.sections.context_parallel import shard_sequence
from autopar.sections.contract import (accepted_kwargs, compute_loss, make_batch, map_batch, model_inputs,
                                               slice_batch, tokens_per_sample)
from autopar.sections.mesh import MeshAxis, dp_rank
from autopar.sections.pipeline import run_pipeline
from autopar.sections.tensor_parallel import replicated_beside_shards, sharded_logits

# ParallelConfig, ParallelModel and TrainConfig, in annotations here, are train.py's (which imports
# this section, so it cannot import them back; the type checker is told so in pyproject.toml).

# Settings that are text whatever they look like (a file named 2024 is still a path).
TEXT_SETTINGS = ("path", "val_path", "tokenizer", "text_field", "cache_dir", "bin_dtype")
# example_batch's validation batches are drawn from seeds no training step uses.
VALIDATION_STEP_BASE = 1 << 40


@dataclass
class DataSource:
    """The run's samples: datasets of the model's ``dataset()`` hook or of the built-in text
    pipeline; with neither (``train`` None), example_batch drawn per step."""

    train: Any = None
    val: Any = None
    origin: str = "example_batch"


def open_data(training: TrainConfig, model_module: Any, forward_arguments: tuple[str, ...] = ()) -> DataSource:
    """The run's datasets. Rank 0 reads (and tokenizes, into the cache) first and the others
    follow, so a corpus is tokenized once; a problem with the data stops every rank with rank
    0's message."""
    hook = getattr(model_module, "dataset", None)
    if callable(hook):
        kwargs = accepted_kwargs(hook, training.model_kwargs)
        return DataSource(hook("train", **kwargs), hook("val", **kwargs), "dataset()")
    if not training.data.get("path"):
        return DataSource()
    example = make_batch(model_module, training.model_kwargs, 2, training.seed)
    seq_len = tokens_per_sample(example)
    settings = data_settings(training.data, seq_len)
    layout = data_loading.batch_layout(example, seq_len, forward_arguments)
    problem: list[Any] = [None]
    splits = None
    if dist.get_rank() == 0:
        try:
            splits = corpus(settings, training.global_batch_size, training.vocab_rows)
        except training_data.DataError as error:
            problem = [(error.problem, error.fix)]
    dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise training_data.DataError(*problem[0])
    if splits is None:
        splits = corpus(settings, training.global_batch_size, training.vocab_rows)
    train, val = splits
    return DataSource(data_loading.TokenSamples(train, layout),
                      None if val is None else data_loading.TokenSamples(val, layout), settings.path)


def corpus(settings: Any, global_batch_size: int, vocab_rows: int = 0) -> tuple[Any, Any]:
    """The corpus's (train, validation) token sequences, refused when the model cannot take
    its token ids (``vocab_rows``: the model's largest embedding; 0: unknown)."""
    ids = training_data.vocab_size(settings)
    if vocab_rows and ids > vocab_rows:
        raise training_data.DataError(
            f"the tokenizer {settings.tokenizer!r} gives {ids} token ids, but the model's largest embedding has "
            f"{vocab_rows} rows, so ids past {vocab_rows - 1} would index past it.",
            f"compile the model with a vocabulary of at least {ids} (e.g. model.vocab={ids}), or use a tokenizer "
            f"with at most {vocab_rows} ids.")
    return training_data.data_splits(settings, min_samples=global_batch_size)


def data_overrides(data: dict[str, Any], pairs: list[str]) -> dict[str, Any]:
    """``data`` with ``KEY=VALUE`` settings (``--data``; ``data.`` before the key is optional)
    applied; values are read as Python literals where they are one, ``null`` as None."""
    known = {f.name for f in fields(training_data.DataConfig)}
    merged = dict(data)
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip().removeprefix("data.")
        if not sep or key not in known:
            raise training_data.DataError(f"--data {pair!r} is not KEY=VALUE with a key of {sorted(known)}.",
                                          "e.g. --data path=corpus.txt")
        merged[key] = text.strip() if key in TEXT_SETTINGS else literal(text.strip())
    return merged


def literal(text: str) -> Any:
    """A command-line value: None for null/none, a number or a quoted string where it reads as
    one, else the text itself (a path)."""
    if text.lower() in ("null", "none", "~"):
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def data_settings(data: dict[str, Any], seq_len: int) -> Any:
    """The DataConfig of ``DATA`` with the traced sequence length (a different one is refused:
    the plan's memory and time were priced at the traced length)."""
    settings = training_data.DataConfig(**data)
    if settings.seq_len is None:
        return replace(settings, seq_len=seq_len)
    if settings.seq_len != seq_len:
        raise training_data.DataError(
            f"data.seq_len={settings.seq_len} differs from the {seq_len} tokens per sample the plan was made for.",
            f"compile again with the model's sequence length set to {settings.seq_len} (e.g. "
            f"model.seq_len={settings.seq_len}), or leave data.seq_len unset.")
    return settings


def forward_arguments_of(model: nn.Module) -> tuple[str, ...]:
    """The parameter names of a model's forward (a pipeline stage's inner model's)."""
    inner = getattr(model, "model", model)
    return tuple(inspect.signature(inner.forward).parameters)


def rank_share(training: TrainConfig, config: ParallelConfig, mesh: DeviceMesh) -> data_loading.Share:
    """This rank's part of every global batch (its data-parallel rank's samples)."""
    first, size = training.share(dp_rank(mesh, config.dims))
    return data_loading.Share(first, size * training.num_micro_batches)


def to_rank(batch: Any, config: ParallelConfig, mesh: DeviceMesh, device: torch.device) -> Any:
    """This rank's samples as it computes on them: with context parallelism its share of every
    sequence, on the device."""
    if config.dims.cp_enabled:
        batch = shard_sequence(batch, tokens_per_sample(batch), config.dims.cp,
                               mesh[MeshAxis.CP.value].get_local_rank(), config.position_argument, config.mask_argument)
    return map_batch(batch, lambda tensor: tensor.to(device, non_blocking=True))


def local_batch(training: TrainConfig, config: ParallelConfig, model_module: Any, step: int, mesh: DeviceMesh,
                device: torch.device) -> Any:
    """This rank's part of step ``step``'s example_batch: its data-parallel slice of the samples
    and, with context parallelism, its share of every sequence."""
    batch = make_batch(model_module, training.model_kwargs, training.global_batch_size, training.seed + 1 + step)
    first, size = training.share(dp_rank(mesh, config.dims))
    return to_rank(slice_batch(batch, first, first + size * training.num_micro_batches), config, mesh, device)


class Batches:
    """This rank's batch for each step of a run, from position ``start`` (samples of the global
    order already consumed). ``position`` is the samples consumed once the batches taken are
    trained on: what a checkpoint saves."""

    def __init__(self, source: DataSource, training: TrainConfig, config: ParallelConfig, model_module: Any,
                 mesh: DeviceMesh, device: torch.device, first_step: int, start: int):
        self.source, self.training, self.config, self.model_module = source, training, config, model_module
        self.mesh, self.device, self.position = mesh, device, start
        self.iterator = None
        if source.train is not None:
            workers = int(training.data.get("num_workers", 1))
            self.iterator = iter(data_loading.rank_loader(
                source.train, seed=training.seed, start=start, steps=max(0, training.steps - first_step),
                global_batch=training.global_batch_size, share=rank_share(training, config, mesh), workers=workers,
                pin_memory=device.type == "cuda"))

    def next(self, step: int) -> Any:
        if self.iterator is None:
            batch = local_batch(self.training, self.config, self.model_module, step, self.mesh, self.device)
        else:
            batch = to_rank(next(self.iterator), self.config, self.mesh, self.device)
        self.position += self.training.global_batch_size
        return batch


def validation_batches(source: DataSource, training: TrainConfig, config: ParallelConfig, model_module: Any,
                       mesh: DeviceMesh, device: torch.device) -> list[Any]:
    """This rank's part of the fixed validation batches: the first ``eval_batches`` global
    batches of the validation set in its own order, or example batches no step trains on."""
    count = training.eval_batches
    if source.val is None:
        return [local_batch(training, config, model_module, VALIDATION_STEP_BASE + i, mesh, device)
                for i in range(count)]
    loader = data_loading.rank_loader(source.val, seed=training.seed, start=0, steps=count,
                                      global_batch=training.global_batch_size,
                                      share=rank_share(training, config, mesh), shuffle=False, workers=0)
    return [to_rank(batch, config, mesh, device) for batch in loader]


@torch.no_grad()
def eval_step(parallel: ParallelModel, batch: Any, training: TrainConfig, config: ParallelConfig,
              model_module: Any) -> torch.Tensor | None:
    """The loss of one batch without training on it: forward only, the model in eval mode
    (dropout off); the mean micro-batch loss on ranks of the last pipeline stage, else None (with
    a token-level loss, this rank's share of the batch's: token_loss.py)."""
    n = training.num_micro_batches
    for module in parallel.modules:
        module.eval()
    try:
        counting = parallel.token_counts.counting() if parallel.token_counts is not None else contextlib.nullcontext()
        with counting:
            losses = micro_batch_losses(parallel, batch, training, config, model_module)
        if parallel.token_counts is not None:
            share = parallel.token_counts.share_of_mean(n, config.dims.dp * config.dims.cp, config.dims.tp)
            return None if losses is None else parallel.token_counts.summed(losses).sum() * share
        return None if losses is None else losses.mean()
    finally:
        for module in parallel.modules:
            module.train()


@torch.no_grad()
def micro_batch_losses(parallel: ParallelModel, batch: Any, training: TrainConfig, config: ParallelConfig,
                       model_module: Any) -> torch.Tensor | None:
    """Each micro-batch's loss of one batch, forward only (1-D, on ranks of the last pipeline
    stage; None on the others)."""
    loss_context = sharded_logits if config.loss_parallel else contextlib.nullcontext
    dtype = parallel.compute_dtype
    autocast = torch.autocast(parallel.device.type, dtype=dtype or torch.float32, enabled=dtype is not None)
    if config.dims.pp_enabled:
        with loss_context(), autocast:
            return run_pipeline(parallel.schedule, batch, parallel.is_last_stage,
                                traced=config.pipeline_split == "tracer", evaluate=True, per_micro_batch=True)
    model = parallel.modules[0]
    rank_in_dp = dp_rank(parallel.mesh, config.dims)
    _, size = training.share(rank_in_dp)
    losses = []
    for i in range(training.num_micro_batches):
        micro = slice_batch(batch, i * size, (i + 1) * size)
        with loss_context(), autocast:
            args, kwargs = model_inputs(model, micro)
            output = model(*args, **kwargs)
            if config.loss_parallel:
                output = replicated_beside_shards(output, parallel.mesh[MeshAxis.TP.value])
            loss = compute_loss(model_module, output, micro) * training.loss_weight(rank_in_dp)
        losses.append((loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().float())
    return torch.stack(losses)


"""The single-process reference a generated module must reproduce: the original model, unsharded.

Same conventions as the generated code (weights from ``seed``; step s trains on
``example_batch(global_batch_size)`` drawn from seed ``seed + 1 + s``; AdamW with the same
decayed and exempt parameters, learning-rate schedule and gradient clipping), but none of its
machinery: one forward and backward over the whole global batch per step, torch's own
``clip_grad_norm_`` and a plain AdamW with two parameter groups.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map
from torch.utils.data import default_collate

from autopar.sections.contract import DropoutOff, tokens_per_sample
from autopar.sections.optimizer import decays, learning_rate, no_decay_names, set_learning_rate
from autopar.model_file import accepted_kwargs, call_model, compute_loss, default_dtype, load_model_file


@dataclass
class ReferenceRun:
    """Loss, gradient norm (before clipping) and learning rate per step, the parameters after the
    last step (FQN -> tensor; tied names once), and the validation loss after each evaluated step
    (step -> loss)."""

    losses: list[float]
    parameters: dict[str, torch.Tensor]
    grad_norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    val_losses: dict[int, float] = field(default_factory=dict)


@dataclass
class ReferenceData:
    """A run's samples as one process reads them: step s's whole global batch, positions
    s·G .. s·G+G-1 of the global order (data_loading.py), and the fixed validation batches
    (the validation set's first batches in its own order)."""

    train: Any
    val: Any
    global_batch_size: int
    seed: int = 0

    @classmethod
    def of(cls, model_path: str | Path, model_kwargs: dict[str, Any], data: dict[str, Any] | None,
           global_batch_size: int, seed: int = 0) -> "ReferenceData":
        """The model's dataset() hook's datasets, else the built-in text pipeline's for ``data``
        (DATA's settings) in the model's batch structure."""
        from autopar.sections import data as training_data
        from autopar.sections import loader as data_loading
        from autopar.sections.batches import data_settings

        model_file = load_model_file(model_path)
        hook = getattr(model_file, "dataset", None)
        if callable(hook):
            kwargs = accepted_kwargs(hook, model_kwargs)
            return cls(hook("train", **kwargs), hook("val", **kwargs), global_batch_size, seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            example = model_file.example_batch(2, **accepted_kwargs(model_file.example_batch, model_kwargs))
        seq_len = tokens_per_sample(example)
        train, val = training_data.data_splits(data_settings(data or {}, seq_len), min_samples=global_batch_size)
        layout = data_loading.batch_layout(example, seq_len)
        return cls(data_loading.TokenSamples(train, layout),
                   None if val is None else data_loading.TokenSamples(val, layout), global_batch_size, seed)

    def batch(self, step: int) -> Any:
        start = step * self.global_batch_size
        return default_collate(_samples(self.train, self.seed, start, self.global_batch_size, shuffle=True))

    def validation(self, count: int) -> list[Any]:
        size = self.global_batch_size
        samples = _samples(self.val, self.seed, 0, count * size, shuffle=False)
        return [default_collate(samples[i * size:(i + 1) * size]) for i in range(count)]


def _samples(dataset: Any, seed: int, start: int, count: int, shuffle: bool) -> list[Any]:
    """Positions ``start .. start+count-1`` of a dataset's global order: a map-style dataset's
    permutation per epoch, an iterable one's own order epoch after epoch."""
    from torch.utils.data import IterableDataset

    from autopar.sections import loader as data_loading

    if not isinstance(dataset, IterableDataset):
        order = data_loading.GlobalOrder(len(dataset), seed, shuffle)
        return [dataset[order.sample(p)] for p in range(start, start + count)]
    stream = data_loading.stream_of(dataset)
    samples: list[Any] = []
    position, epoch = 0, 0
    while len(samples) < count:
        for sample in stream(epoch):
            if position >= start:
                samples.append(sample)
                if len(samples) == count:
                    break
            position += 1
        epoch += 1
    return samples


def run_reference(model_path: str | Path, model_kwargs: dict[str, Any], global_batch_size: int, steps: int,
                  optimizer: dict[str, Any], seed: int = 0, data: ReferenceData | None = None,
                  eval_every: int = 0, eval_batches: int = 4, dtype: torch.dtype | None = None,
                  dropout_off: bool = False) -> ReferenceRun:
    """Train the unsharded model for ``steps`` steps on one process (CPU, fp32).

    Args:
        model_path: the user's model.py.
        model_kwargs: build_model / example_batch keyword arguments.
        global_batch_size: samples per step.
        steps: optimizer steps.
        optimizer: the generated module's optimizer settings (autopar/codegen/generate.py
            DEFAULT_OPTIMIZER's keys; missing ones: a constant rate, no clipping, embeddings, norms
            and biases exempt from decay).
        seed: seed of the weights; batches use seed + 1 + step.
        data: the run's samples (else example_batch), and its validation batches.
        eval_every, eval_batches: the validation loss every ``eval_every`` steps and after the
            last, over ``eval_batches`` batches (0: never).
        dtype: the same run in another floating dtype (float64: how far fp32's rounding moved
            the fp32 run, what compile's check sets its tolerances from); the weights are
            initialised as in fp32 and converted, floating inputs converted, and tensors the model
            makes itself are made in it.
        dropout_off: train with the model's dropout off (autopar.sections.contract.DropoutOff), as
            compile's check runs the plan.
    """
    model_file = load_model_file(model_path)
    torch.manual_seed(seed)
    model = model_file.build_model(**accepted_kwargs(model_file.build_model, model_kwargs))
    if dtype is not None:
        model.to(dtype)
    adamw = torch.optim.AdamW(decay_groups(model, optimizer), lr=optimizer["lr"], betas=tuple(optimizer["betas"]),
                              eps=optimizer["eps"], weight_decay=optimizer["weight_decay"])
    max_norm = float(optimizer.get("max_grad_norm", 0.0) or 0.0)
    run = ReferenceRun(losses=[], parameters={})
    validation = data.validation(eval_batches) if data is not None and eval_every > 0 else []
    for step in range(steps):
        if data is not None:
            batch = data.batch(step)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + 1 + step)
                batch = model_file.example_batch(global_batch_size,
                                                 **accepted_kwargs(model_file.example_batch, model_kwargs))
        with default_dtype(dtype), DropoutOff() if dropout_off else contextlib.nullcontext():
            batch = floating_as(batch, dtype)
            loss = compute_loss(model_file, call_model(model, batch), batch)
            loss.backward()
            lr = learning_rate(step, steps, optimizer)
            set_learning_rate(adamw, lr)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"))
            adamw.step()
        adamw.zero_grad()
        run.losses.append(loss.item())
        run.grad_norms.append(float(norm))
        run.lrs.append(lr)
        done = step + 1
        if validation and (done % eval_every == 0 or done == steps):
            model.eval()
            with torch.no_grad():
                run.val_losses[done] = sum(compute_loss(model_file, call_model(model, b), b).item()
                                           for b in validation) / len(validation)
            model.train()
    run.parameters = {n: p.detach().clone() for n, p in model.named_parameters()}
    return run


def floating_as(batch: Any, dtype: torch.dtype | None) -> Any:
    """The batch with its floating-point tensors in ``dtype`` (as it is for None)."""
    if dtype is None:
        return batch
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, batch)


def decay_groups(model: torch.nn.Module, optimizer: dict[str, Any]) -> list[dict[str, Any]]:
    """The model's parameters as AdamW's two groups: decayed, and exempt (weight decay 0)."""
    no_decay = no_decay_names(model)
    groups: dict[bool, list[torch.nn.Parameter]] = {True: [], False: []}
    for name, parameter in model.named_parameters():
        groups[decays(name, optimizer, no_decay)].append(parameter)
    return [{"params": groups[True]}, {"params": groups[False], "weight_decay": 0.0}]

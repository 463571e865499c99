"""The single-process reference a generated module must reproduce: the original model, unsharded.

Same conventions as the generated code (weights from ``seed``; step s trains on
``example_batch(global_batch_size)`` drawn from seed ``seed + 1 + s``; AdamW with the same
decayed and exempt parameters, learning-rate schedule and gradient clipping), but none of its
machinery: one forward and backward over the whole global batch per step, torch's own
``clip_grad_norm_`` and a plain AdamW with two parameter groups.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from autopar.codegen.sections.optimizer import decays, learning_rate, no_decay_names, set_learning_rate
from autopar.model_file import accepted_kwargs, call_model, compute_loss, load_model_file


@dataclass
class ReferenceRun:
    """Loss, gradient norm (before clipping) and learning rate per step, and the parameters after
    the last step (FQN -> tensor; tied names once)."""

    losses: list[float]
    parameters: dict[str, torch.Tensor]
    grad_norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)


def run_reference(model_path: str | Path, model_kwargs: dict[str, Any], global_batch_size: int, steps: int,
                  optimizer: dict[str, Any], seed: int = 0) -> ReferenceRun:
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
    """
    model_file = load_model_file(model_path)
    torch.manual_seed(seed)
    model = model_file.build_model(**accepted_kwargs(model_file.build_model, model_kwargs))
    adamw = torch.optim.AdamW(decay_groups(model, optimizer), lr=optimizer["lr"], betas=tuple(optimizer["betas"]),
                              eps=optimizer["eps"], weight_decay=optimizer["weight_decay"])
    max_norm = float(optimizer.get("max_grad_norm", 0.0) or 0.0)
    run = ReferenceRun(losses=[], parameters={})
    for step in range(steps):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1 + step)
            batch = model_file.example_batch(global_batch_size,
                                             **accepted_kwargs(model_file.example_batch, model_kwargs))
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
    run.parameters = {n: p.detach().clone() for n, p in model.named_parameters()}
    return run


def decay_groups(model: torch.nn.Module, optimizer: dict[str, Any]) -> list[dict[str, Any]]:
    """The model's parameters as AdamW's two groups: decayed, and exempt (weight decay 0)."""
    no_decay = no_decay_names(model)
    groups: dict[bool, list[torch.nn.Parameter]] = {True: [], False: []}
    for name, parameter in model.named_parameters():
        groups[decays(name, optimizer, no_decay)].append(parameter)
    return [{"params": groups[True]}, {"params": groups[False], "weight_decay": 0.0}]

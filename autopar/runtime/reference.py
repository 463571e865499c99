"""The single-process reference a generated module must reproduce: the original model, unsharded.

Same conventions as the generated code (weights from ``seed``; step s trains on
``example_batch(global_batch_size)`` drawn from seed ``seed + 1 + s``; AdamW), but none of its
machinery: one forward and backward over the whole global batch per step.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autopar.model_file import accepted_kwargs, call_model, compute_loss, load_model_file


@dataclass
class ReferenceRun:
    """Loss per step and the parameters after the last step (FQN -> tensor; tied names once)."""

    losses: list[float]
    parameters: dict[str, torch.Tensor]


def run_reference(model_path: str | Path, model_kwargs: dict[str, Any], global_batch_size: int, steps: int,
                  optimizer: dict[str, Any], seed: int = 0) -> ReferenceRun:
    """Train the unsharded model for ``steps`` steps on one process (CPU, fp32).

    Args:
        model_path: the user's model.py.
        model_kwargs: build_model / example_batch keyword arguments.
        global_batch_size: samples per step.
        steps: optimizer steps.
        optimizer: AdamW settings (lr, betas, eps, weight_decay).
        seed: seed of the weights; batches use seed + 1 + step.
    """
    model_file = load_model_file(model_path)
    torch.manual_seed(seed)
    model = model_file.build_model(**accepted_kwargs(model_file.build_model, model_kwargs))
    adamw = torch.optim.AdamW(model.parameters(), lr=optimizer["lr"], betas=tuple(optimizer["betas"]),
                              eps=optimizer["eps"], weight_decay=optimizer["weight_decay"])
    losses = []
    for step in range(steps):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1 + step)
            batch = model_file.example_batch(global_batch_size,
                                             **accepted_kwargs(model_file.example_batch, model_kwargs))
        loss = compute_loss(model_file, call_model(model, batch), batch)
        loss.backward()
        adamw.step()
        adamw.zero_grad()
        losses.append(loss.item())
    return ReferenceRun(losses=losses, parameters={n: p.detach().clone() for n, p in model.named_parameters()})

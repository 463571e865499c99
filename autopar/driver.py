"""The one place that knows the order of the stages; the CLI verbs call these functions."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from autopar.model_file import load_model_file
from autopar.profile import ModelProfile, profile_model


def model_kwargs(cfg: Any) -> dict[str, Any]:
    """The ``model.*`` section as plain Python values."""
    return dict(OmegaConf.to_container(cfg.model, resolve=True))


def run_profile(model_path: str | Path, cfg: Any) -> ModelProfile:
    """Stage 1+2: load model.py, trace one training step on fake tensors, profile it."""
    model_file = load_model_file(model_path)
    return profile_model(model_file, model_kwargs(cfg), micro_batch_size=cfg.train.micro_batch_size,
                         precision=cfg.train.precision)

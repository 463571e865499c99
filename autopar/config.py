"""Structured configs: the schema Hydra validates every preset and override against.

Config groups (conf/): ``train/`` and ``cluster/`` hold presets extending these dataclasses.
``model.<name>=<value>`` overrides are free-form: they become keyword arguments of the user's
build_model() / example_batch() and are checked against those signatures instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore


@dataclass
class TrainConfig:
    """How the model is trained: what the planner must fit and what it optimises for."""

    global_batch_size: int = 8
    """Samples per optimizer step across all data-parallel ranks."""
    micro_batch_size: int = 1
    """Samples per micro-batch; `autopar profile` traces a batch of this size."""
    precision: str = "bf16"
    """fp32, or bf16/fp16 mixed precision (the model is traced under autocast to that dtype)."""
    optimizer: str = "adam"
    """adam (two fp32 states per parameter) or sgd (momentum only)."""


@dataclass
class AutoparConfig:
    """Root of the composed configuration."""

    model: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the model file's build_model() and example_batch()."""
    train: TrainConfig = field(default_factory=TrainConfig)


def register_configs() -> None:
    """Put the schemas in Hydra's ConfigStore (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="autopar_schema", node=AutoparConfig)
    store.store(group="train", name="train_schema", node=TrainConfig)


def normalise_overrides(overrides: list[str]) -> list[str]:
    """Let ``model.<name>=<value>`` add keys: the model section has no fixed schema."""
    result = []
    for item in overrides:
        if item.startswith("model.") and "=" in item:
            item = "++" + item
        result.append(item)
    return result


def compose_config(overrides: list[str] | None = None) -> Any:
    """Compose conf/config.yaml with command-line style overrides, as the CLI does.

    Raises ConfigError (one line, exit 1) for unknown keys, bad values or unknown presets.
    """
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from autopar.errors import ConfigError

    register_configs()
    try:
        with initialize_config_module(config_module="autopar.conf", version_base=None):
            return compose(config_name="config", overrides=normalise_overrides(list(overrides or [])))
    except (HydraException, OmegaConfBaseException) as err:
        message = " ".join(str(err).split())
        raise ConfigError(f"Invalid configuration: {message}",
                          "check the override's spelling against `autopar <verb> --help` and the "
                          "presets in conf/.") from None

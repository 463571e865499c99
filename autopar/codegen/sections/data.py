"""Training text: a user's corpus as packed token sequences (minimal reader: UTF-8 bytes of .txt files)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset


@dataclass(frozen=True)
class DataConfig:
    path: str | None = None
    val_path: str | None = None
    val_fraction: float = 0.0
    tokenizer: str = "bytes"
    seq_len: int | None = None
    text_field: str = "text"
    eod_token: int | None = None
    num_workers: int = 1
    cache_dir: str | None = None
    bin_dtype: str = "uint16"


class DataError(ValueError):
    """A corpus that cannot be trained on; the message names the file and the fix."""


class PackedSequences(Dataset):
    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        window = torch.from_numpy(np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64))
        return window[:-1], window[1:]


def tokens_of(path: str, config: DataConfig) -> np.ndarray:
    files = sorted(p for p in Path(path).rglob("*") if p.is_file()) if Path(path).is_dir() else [Path(path)]
    parts = []
    for file in files:
        parts.append(np.frombuffer(file.read_bytes(), dtype=np.uint8).astype(np.uint16))
        parts.append(np.array([256], dtype=np.uint16))
    return np.concatenate(parts)


def data_splits(config: DataConfig, min_samples: int) -> tuple[PackedSequences, PackedSequences | None]:
    if not Path(config.path).exists():
        raise DataError(f"data file {config.path} does not exist. Fix: pass data.path=FILE")
    tokens = tokens_of(config.path, config)
    val = None
    if config.val_path:
        val = PackedSequences(tokens_of(config.val_path, config), config.seq_len)
    elif config.val_fraction > 0:
        cut = int(len(tokens) * (1 - config.val_fraction)) // config.seq_len * config.seq_len
        tokens, val = tokens[:cut + 1], PackedSequences(tokens[cut:], config.seq_len)
    train = PackedSequences(tokens, config.seq_len)
    if len(train) < min_samples:
        raise DataError(f"{config.path} holds {len(train)} sequences, fewer than one global batch ({min_samples})")
    return train, val


def vocab_size(config: DataConfig) -> int:
    return 257

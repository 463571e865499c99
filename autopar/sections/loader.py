"""Training data: which samples each rank reads at each step, read ahead in the background, resumable to the sample.

A run consumes its samples in one global order. For a map-style dataset of n samples, epoch e is
a permutation of 0..n-1 drawn from (seed, e); the k-th sample the run consumes (its *position*
k) is that permutation's entry k mod n of epoch k div n. An iterable dataset is consumed in its
own order (epoch after epoch; ``set_epoch(e)`` is called where it has one). Step s trains on
positions P, P+1, ..., P+G-1 (G the global batch), and each data-parallel rank reads only its
share of them: the positions ``first .. first + count - 1`` of the batch, where (first, count)
is what the plan gives the rank (`TrainConfig.share`: even shares or a heterogeneous cluster's
``dp_shares``). Tensor- and context-parallel ranks of one data-parallel rank read the same
samples (context parallelism then cuts each sequence). The position after the last step is saved
in every checkpoint, so a resumed run, under this plan or any other with the same global batch,
continues the global order at the sample where the saved run stopped.

A DataLoader reads ahead in worker processes (pinned memory on GPUs), so loading overlaps the
step instead of adding to it.

Written beside the training module as data_loading.py (the same for every plan).
"""
from __future__ import annotations

import itertools
import math
import multiprocessing
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, Sized

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, default_collate

# Names the built-in pipeline gives a meaning to in example_batch's structure.
POSITION_NAMES = ("position_ids", "positions", "pos")
TARGET_NAMES = ("labels", "label", "targets", "target", "y")
MASK_NAMES = ("attention_mask", "mask", "padding_mask")


class DataLayoutError(ValueError):
    """example_batch's structure cannot be filled from token sequences."""


@dataclass(frozen=True)
class Share:
    """The part of every global batch one data-parallel rank reads: ``count`` samples from
    offset ``first``."""

    first: int
    count: int


class GlobalOrder:
    """The sample at each position of a run over a map-style dataset of ``size`` samples:
    one permutation per epoch, drawn from (seed, epoch)."""

    def __init__(self, size: int, seed: int, shuffle: bool = True):
        if size <= 0:
            raise ValueError("a dataset with no samples has no order")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self._epoch, self._permutation = -1, torch.arange(size)

    def epoch_permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._permutation = epoch, torch.randperm(self.size, generator=generator)
        return self._permutation

    def sample(self, position: int) -> int:
        """The dataset index consumed at ``position`` (0: the run's first sample)."""
        epoch, offset = divmod(position, self.size)
        if not self.shuffle:
            return offset
        return int(self.epoch_permutation(epoch)[offset])

    def epoch_of(self, position: int) -> int:
        return position // self.size


def rank_positions(start: int, steps: int, global_batch: int, share: Share) -> Iterator[int]:
    """The positions one rank reads for ``steps`` steps from position ``start``, step by step."""
    for step in range(steps):
        base = start + step * global_batch + share.first
        yield from range(base, base + share.count)


class StepSampler(Sampler[int]):
    """Dataset indices of one rank's samples for the steps of a run, in order (for a
    DataLoader whose batch is the rank's share of one step)."""

    def __init__(self, order: GlobalOrder, start: int, steps: int, global_batch: int, share: Share):
        self.order, self.start, self.steps, self.global_batch, self.share = order, start, steps, global_batch, share

    def __iter__(self) -> Iterator[int]:
        return (self.order.sample(p) for p in rank_positions(self.start, self.steps, self.global_batch, self.share))

    def __len__(self) -> int:
        return self.steps * self.share.count


class SharedStream(IterableDataset):
    """An iterable dataset read in its own order from position ``start``, keeping one rank's
    share of each global batch (the others' samples are skipped, not collated). Epochs restart
    the stream."""

    def __init__(self, make_stream: Callable[[int], Any], start: int, steps: int, global_batch: int, share: Share):
        self.make_stream, self.start, self.steps, self.global_batch, self.share = (
            make_stream, start, steps, global_batch, share)

    def __iter__(self) -> Iterator[Any]:
        wanted = rank_positions(self.start, self.steps, self.global_batch, self.share)
        target = next(wanted, None)
        position, epoch = 0, 0
        while target is not None:
            emitted = False
            for sample in self.make_stream(epoch):
                if position == target:
                    yield sample
                    target = next(wanted, None)
                    if target is None:
                        return
                position += 1
                emitted = True
            if not emitted:
                raise ValueError("the model's dataset() yields no samples")
            epoch += 1


def stream_of(dataset: IterableDataset) -> Callable[[int], Any]:
    """Epoch -> a fresh iterator over ``dataset`` (told its epoch where it can be)."""
    def make(epoch: int) -> Any:
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
        return iter(dataset)
    return make


def rank_loader(dataset: Dataset, *, seed: int, start: int, steps: int, global_batch: int, share: Share,
                shuffle: bool = True, workers: int = 1, pin_memory: bool = False) -> DataLoader:
    """A DataLoader yielding this rank's share of each step's global batch, from position
    ``start`` for ``steps`` steps; map-style datasets are read sample by sample in the global
    order, iterable ones in their own order."""
    if multiprocessing.current_process().daemon:
        workers = 0  # a daemon process (some launchers' ranks) may not start worker processes
    options: dict[str, Any] = dict(batch_size=share.count, num_workers=workers, pin_memory=pin_memory,
                                   collate_fn=default_collate)
    if workers > 0:
        options.update(prefetch_factor=2, persistent_workers=False)
    if isinstance(dataset, IterableDataset):
        # One reader keeps the stream's order (several workers would each replay it).
        options["num_workers"] = min(workers, 1)
        if options["num_workers"] == 0:
            options.pop("prefetch_factor", None)
            options.pop("persistent_workers", None)
        return DataLoader(SharedStream(stream_of(dataset), start, steps, global_batch, share), **options)
    if not isinstance(dataset, Sized):
        raise TypeError("the model's dataset() returned a map-style dataset without __len__: give it one, "
                        "or make it a torch IterableDataset")
    order = GlobalOrder(len(dataset), seed, shuffle)
    return DataLoader(dataset, sampler=StepSampler(order, start, steps, global_batch, share), **options)


# ----- filling example_batch's structure from token sequences ---------------------------------


@dataclass(frozen=True)
class BatchLayout:
    """How one sample of example_batch's structure is made from a packed token sequence.

    ``roles`` maps each leaf's path (keys / indices from the root) to what it holds: "inputs"
    (the tokens), "targets" (the tokens shifted by one: the next token at each position),
    "positions" (0..L-1) or "ones" (a mask with nothing padded); ``kind`` is the root's type
    ("dict", "tuple", "list" or "tensor")."""

    kind: str
    roles: tuple[tuple[tuple[Any, ...], str], ...]

    def sample(self, inputs: torch.Tensor, targets: torch.Tensor) -> Any:
        """One sample (no batch dim) in the model's structure."""
        values = {"inputs": inputs, "targets": targets,
                  "positions": torch.arange(inputs.shape[0], dtype=torch.long),
                  "ones": torch.ones(inputs.shape[0], dtype=torch.long)}
        leaves = [(path, values[role]) for path, role in self.roles]
        if self.kind == "tensor":
            return leaves[0][1]
        if self.kind == "dict":
            return {path[0]: value for path, value in leaves}
        items = [value for _, value in leaves]
        return tuple(items) if self.kind == "tuple" else items


def _leaf_name(path: tuple[Any, ...]) -> str:
    return str(path[-1]).lower() if path else ""


def batch_layout(example: Any, seq_len: int, forward_arguments: tuple[str, ...] = ()) -> BatchLayout:
    """Read how example_batch relates its tensors, so token sequences fill the same structure.

    Each integer tensor of shape [batch, seq_len] is the tokens, the targets (equal to the
    tokens shifted by one, as ``example_batch`` draws ``tokens[:, 1:]``), a copy of the tokens
    (Hugging Face's ``labels=input_ids``: the model shifts them itself), positions or an
    all-ones mask; anything else cannot be made from text, so the model needs ``dataset()``.
    ``forward_arguments``: the forward's parameter names (a name it takes is an input, never a
    target, when the example cannot tell).
    """
    leaves: list[tuple[tuple[Any, ...], Any]]
    if isinstance(example, dict):
        kind, leaves = "dict", [((key,), value) for key, value in example.items()]
    elif isinstance(example, (tuple, list)):
        kind, leaves = type(example).__name__, [((index,), value) for index, value in enumerate(example)]
    else:
        kind, leaves = "tensor", [((), example)]
    fix = "define dataset(split, **kw) in model.py returning samples in example_batch's structure"

    def refuse(why: str) -> DataLayoutError:
        return DataLayoutError(f"the built-in text pipeline cannot fill example_batch: {why}. Fix: {fix}.")

    tokens = [(path, value) for path, value in leaves if isinstance(value, torch.Tensor)
              and not value.is_floating_point() and value.dim() == 2 and value.shape[1] == seq_len]
    others = [path for path, value in leaves if all(path != p for p, _ in tokens)]
    if others:
        name = ".".join(str(p) for p in others[0]) or "the batch"
        raise refuse(f"{name} is not a [batch, {seq_len}] tensor of token ids")
    roles: dict[tuple[Any, ...], str] = {}
    for path, value in tokens:
        name = _leaf_name(path)
        if name in POSITION_NAMES:
            if not torch.equal(value, torch.arange(seq_len).expand_as(value)):
                raise refuse(f"{name} holds something other than the positions 0..{seq_len - 1}")
            roles[path] = "positions"
        elif name in MASK_NAMES:
            if not bool((value == 1).all()):
                raise refuse(f"{name} masks tokens out (packed text has no padding)")
            roles[path] = "ones"
    rest = [(path, value) for path, value in tokens if path not in roles]
    if not rest:
        raise refuse("it holds no token ids")
    inputs_path, inputs = next(((p, v) for p, v in rest if _leaf_name(p) not in TARGET_NAMES), rest[0])
    roles[inputs_path] = "inputs"
    for path, value in rest:
        if path == inputs_path:
            continue
        shifted = torch.equal(value[:, :-1], inputs[:, 1:])
        same = torch.equal(value, inputs)
        name = _leaf_name(path)
        if shifted and same:  # a constant example: decide by name
            roles[path] = "inputs" if name in forward_arguments and name not in TARGET_NAMES else "targets"
        elif shifted:
            roles[path] = "targets"
        elif same:
            roles[path] = "inputs"
        else:
            shown = ".".join(str(p) for p in path)
            raise refuse(f"{shown} is neither the tokens, the tokens shifted by one, positions nor a mask")
    ordered = tuple((path, roles[path]) for path, _ in leaves)
    return BatchLayout(kind=kind, roles=ordered)


class MapStyle(Protocol):
    """A map-style dataset: a length and a sample per index."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


class TokenSamples(Dataset):
    """Packed token sequences ((inputs, targets) per index) as samples of the model's structure."""

    def __init__(self, sequences: MapStyle, layout: BatchLayout):
        self.sequences, self.layout = sequences, layout

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> Any:
        inputs, targets = self.sequences[index]
        return self.layout.sample(inputs, targets)


def epochs_of(position: int, dataset: Dataset) -> float:
    """How many passes over a map-style dataset ``position`` samples make (nan for a stream)."""
    if not isinstance(dataset, Sized):
        return math.nan
    try:
        return position / len(dataset)
    except TypeError:
        return math.nan


def take(loader: DataLoader, count: int) -> list[Any]:
    """The first ``count`` batches of a loader (evaluation's fixed batches)."""
    return list(itertools.islice(iter(loader), count))

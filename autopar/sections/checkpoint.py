"""Checkpoints: save with torch.distributed.checkpoint (DCP), resume from the latest complete one, export.

``DIR/step_<n>/`` holds the state after n optimizer steps: every rank writes its own shards and
DCP's coordinator writes the metadata once all of them are written; rank 0 then adds
``COMPLETE``, which lists the sha256 of every file of the folder. A folder without it (a run
killed while saving) is never resumed from; one whose files no longer match it (truncated,
overwritten) is skipped with a message naming the file, and the previous complete one is used.

A checkpoint is data, never code: DCP's ``.metadata`` is a pickle, so it is read by an unpickler
that knows DCP's metadata classes, torch.Size and dtypes and nothing else (`read_metadata`), and
the plain values DCP keeps as bytes (the optimizer's options) are read with
``torch.load(weights_only=True)`` (`SafeLoadPlanner`). A checkpoint whose metadata or values name
anything else (a crafted pickle) is skipped like a corrupt one, naming what it asked for; the
checksums cannot catch it, since whoever wrote the files can write COMPLETE too. The step a
checkpoint holds is the one stored inside it: a folder renamed (``step_6`` to ``step_60``) is
ordered and resumed by that step, and the run says so. Nothing is written through a symbolic
link: a checkpoint folder, or a ``step_<n>`` in it, that is a link is refused, naming it. Keys name
the unsharded model's FQNs, so DCP reshards on load: a checkpoint written under one plan (DP4)
loads under another (TP2 x DP2, ZeRO-3, a pipeline).
    model.<fqn>                          parameters and buffers (DTensor shards, as the plan places them)
    optimizer.state.<fqn>.<name>         AdamW's step and moments (optimizer.param_groups.<fqn>.<option>)
    train.step                           optimizer steps done
    train.samples                        the data position: samples of the run's global order
                                         consumed (data_loading.py), so a resumed run continues at
                                         the sample, under any plan; example_batch runs draw step
                                         s's batch from seed + 1 + s
    rng.rank<r>.cpu, rng.rank<r>.cuda    each rank's random number generator states
Pipeline stages save their parameters under the whole model's FQNs; a parameter tied across
stages (token embedding and LM head) is saved under the name it has on each stage and loaded
from whichever of its names the checkpoint holds.

It depends on no plan (``dims`` is the training module's ParallelDims, read for its pipeline
degree alone), so a generated folder holds it once, as checkpointing.py beside the training
module, rather than inside every plan's file.

    torchrun ... parallel_<model>.py --checkpoint-every 100 [--checkpoint-dir DIR] [--async-checkpoint]
    python parallel_<model>.py --export model.safetensors   (no torchrun: consolidate the latest checkpoint)
"""
from __future__ import annotations

import errno
import hashlib
import importlib
import io
import json
import os
import pickle
import re
import shutil
import signal
import tempfile
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                 TensorStorageMetadata)
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)


COMPLETE = "COMPLETE"
OPTIONAL_KEYS = ("train.samples",)
# Written beside a checkpoint that passed its checksums but still failed to load, so a restarted
# attempt (torchrun --max-restarts) goes to the one before instead of failing on it again.
UNUSABLE = "UNUSABLE"
METADATA = ".metadata"  # DCP's, written by its coordinator
_STEP_FOLDER = re.compile(r"step_(\d+)")
# What a failed save or load raises: DCP's CheckpointException is a BaseException, not an Exception.
_FAILURES = (Exception, CheckpointException)
# Flattened optimizer state ("state.<fqn>.<name>") is what lets DCP reshard it between plans.
_FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often to checkpoint.

    Attributes:
        directory: folder of the ``step_<n>/`` checkpoints.
        every: save after every ``every`` optimizer steps and after the last one, and resume from
            the latest complete checkpoint on start; 0 turns checkpoints off.
        async_save: write in a background thread (``dcp.async_save``) while training goes on.
        export: write the trained weights here as one file of full tensors (safetensors for a
            ``.safetensors`` path, else ``torch.save``), or None.
        allow_fresh_start: when checkpoints exist but none is usable, train from step 0 instead
            of failing.
    """

    directory: str | None = None
    every: int = 0
    async_save: bool = False
    export: str | None = None
    allow_fresh_start: bool = False

    @property
    def enabled(self) -> bool:
        return self.every > 0 and self.directory is not None


def complete_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """(steps, folder) of every checkpoint marked complete, oldest first; the steps are those its
    COMPLETE marker records (its folder's name only when the marker records none), so a renamed
    folder is ordered by what it holds."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [(recorded_step(path, int(match.group(1))), path) for path in root.iterdir()
             if (match := _STEP_FOLDER.fullmatch(path.name)) and (path / COMPLETE).is_file()]
    return sorted(found)


def recorded_step(folder: Path, named: int) -> int:
    """The step ``folder``'s COMPLETE marker records, else ``named`` (the folder's name)."""
    try:
        step = json.loads((folder / COMPLETE).read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return named
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else named


def named_step(folder: Path) -> int | None:
    """The step a checkpoint folder's name says (step_<n>), or None."""
    match = _STEP_FOLDER.fullmatch(Path(folder).name)
    return int(match.group(1)) if match else None


def refuse_link(path: Path, what: str) -> None:
    """Refuse to write ``path`` (or into it) when it is a symbolic link: a folder received from
    someone else could point it at any file or folder of the user's."""
    if Path(path).is_symlink():
        raise RuntimeError(f"{what} {path} is a symbolic link (to {os.readlink(path)}); autopar never writes "
                           "through a link. Fix: remove the link (or replace it by a real folder or file), or pass "
                           "the real path (the link's target) as --checkpoint-dir if that is where you meant to write")


def refuse_links(directory: Path) -> None:
    """Refuse a checkpoint folder that is a link or holds a ``step_<n>`` that is one: a resumed run
    writes into both (UNUSABLE, the step folders it saves again)."""
    refuse_link(directory, "the checkpoint folder")
    for path in sorted(directory.iterdir()) if directory.is_dir() else []:
        if _STEP_FOLDER.fullmatch(path.name):
            refuse_link(path, "checkpoint")


def write_text_no_follow(path: Path, text: str) -> None:
    """Write ``path`` anew, refusing (ELOOP) rather than following a symbolic link there."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)


def latest_checkpoint(directory: str | Path) -> tuple[int, Path] | None:
    """The complete checkpoint with the most steps, or None."""
    found = complete_checkpoints(directory)
    return found[-1] if found else None


def file_digests(folder: Path) -> dict[str, str]:
    """sha256 of every file of a checkpoint folder (DCP's ``.metadata`` included), by name."""
    digests = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name not in (COMPLETE, UNUSABLE) and not path.name.startswith(f".{COMPLETE}."):
            with open(path, "rb") as handle:
                digests[path.name] = hashlib.file_digest(handle, "sha256").hexdigest()
    return digests


def _mark_complete(folder: Path, step: int) -> None:
    """Write the COMPLETE marker with the folder's checksums, atomically (safe to call twice,
    from two threads). Rank 0 hashes the files once every rank has written its own: reading
    them back costs about what writing them did, and only on rank 0."""
    if (folder / COMPLETE).is_file():
        return
    marker = {"step": step, "world_size": dist.get_world_size(), "sha256": file_digests(folder)}
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{COMPLETE}.")
    with os.fdopen(fd, "w") as handle:
        json.dump(marker, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, folder / COMPLETE)


def checkpoint_problem(folder: Path) -> str | None:
    """Why a complete checkpoint cannot be used (a file missing, truncated or changed since it
    was written, or a failed load of an earlier attempt), or None when its files match."""
    if (folder / UNUSABLE).is_file():
        return f"an earlier attempt failed to load it: {(folder / UNUSABLE).read_text().strip()}"
    try:
        expected = json.loads((folder / COMPLETE).read_text()).get("sha256")
    except (OSError, ValueError, AttributeError) as error:
        return f"its {COMPLETE} marker is unreadable ({error})"
    if expected is None:
        return unsafe_problem(folder)  # written before checksums were recorded
    actual = file_digests(folder)
    for name, digest in expected.items():
        if name not in actual:
            return f"{folder / name} is missing"
        if actual[name] != digest:
            return f"{folder / name} does not match its checksum (truncated or overwritten)"
    return unsafe_problem(folder)


def unsafe_problem(folder: Path) -> str | None:
    """Why reading ``folder`` would be more than reading data (its metadata or one of its plain
    values names a class or function beyond plain checkpoint data), or None. Nothing from the
    folder is run to find out."""
    try:
        metadata = read_metadata(folder)
        for index, info in metadata.storage_data.items():
            if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                with open(Path(folder) / info.relative_path, "rb") as handle:
                    handle.seek(info.offset)
                    plain_value(io.BytesIO(handle.read(info.length)), index.fqn)
    except UnsafeCheckpoint as error:
        return str(error)
    except OSError as error:
        return f"it cannot be read ({error})"
    except Exception as error:  # a malformed entry the checks above did not foresee
        return f"its metadata is malformed ({type(error).__name__}: {error})"
    return None


def usable_checkpoint(directory: str | Path, allow_fresh_start: bool = False) -> tuple[int, Path] | None:
    """The newest complete checkpoint whose files match their checksums, printing why each newer
    one was skipped; None when there is none. When complete checkpoints exist but none is usable,
    raises (training from step 0 would silently throw the run away) unless ``allow_fresh_start``."""
    problems = []
    for step, folder in reversed(complete_checkpoints(directory)):
        problem = checkpoint_problem(folder)
        if problem is None:
            return step, folder
        problems.append(f"{folder}: {problem}")
        print(f"skipping checkpoint {folder}: {problem}", flush=True)
    if problems and not allow_fresh_start:
        raise RuntimeError(f"no usable checkpoint in {directory} ({'; '.join(problems)}). Fix: restore the "
                           "files, move the folder away, or pass --allow-fresh-start to train from step 0")
    return None


class UnsafeCheckpoint(ValueError):
    """A checkpoint file asks for more than plain data to be read (a crafted pickle)."""


# What DCP's metadata pickle may name: its own metadata classes, and torch's sizes, dtypes and
# layouts. Any other global (os.system, builtins.eval, ...) is refused before it is looked up.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata and nothing else (see `_METADATA_GLOBALS`)."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()) or (module == "torch" and not name.startswith("_")
                                                          and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"it names {module}.{name}, which is not checkpoint data (a crafted file: "
                               "loading it would run code)")


def _plain_file_name(name: Any) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


def read_metadata(folder: str | Path) -> Metadata:
    """DCP's metadata of ``folder``, unpickled without running anything from it, and checked to
    describe tensors and plain values in files of this folder only (UnsafeCheckpoint otherwise)."""
    path = Path(folder) / METADATA
    with open(path, "rb") as handle:
        try:
            metadata = _MetadataUnpickler(handle).load()
        except UnsafeCheckpoint as error:
            raise UnsafeCheckpoint(f"{path}: {error}") from None
        except Exception as error:  # a truncated or garbled pickle: whatever it breaks with
            raise UnsafeCheckpoint(f"{path} is not DCP metadata ({type(error).__name__}: {error})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict) \
            or not isinstance(metadata.storage_data, dict):
        raise UnsafeCheckpoint(f"{path} is not DCP metadata (it holds a {type(metadata).__name__})")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, (TensorStorageMetadata, BytesStorageMetadata)):
            raise UnsafeCheckpoint(f"{path}: entry {key!r} is a {type(entry).__name__}, not a tensor or a plain value")
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            raise UnsafeCheckpoint(f"{path} is not DCP metadata (a storage entry is keyed by {index!r})")
        if not _plain_file_name(getattr(info, "relative_path", None)) or getattr(info, "transform_descriptors", None):
            raise UnsafeCheckpoint(f"{path} points outside its folder or at an encoded file "
                                   f"({getattr(info, 'relative_path', info)!r})")
    return metadata


def plain_value(data: io.BytesIO, key: str) -> Any:
    """A value DCP saved as bytes (a float, a tuple of them...), read with torch's weights-only
    unpickler: anything more than plain data is refused, not run."""
    try:
        return torch.load(data, weights_only=True)
    except Exception as error:
        # torch's message is a page of advice; "Unsupported global: GLOBAL posix.system" says what was asked.
        named = re.search(r"GLOBAL ([\w.]+)", str(error))
        said = f"it names {named.group(1)}, which loading would run" if named else str(error).splitlines()[0][:300]
        raise UnsafeCheckpoint(f"its value {key!r} is not plain data ({said})") from None


class SafeReader(dcp.FileSystemReader):
    """DCP's file system reader with the metadata read by `read_metadata` (no code run)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self.path))
        storage = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage.load_id = self.load_id
        metadata.storage_meta = storage
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, but a value kept as bytes is first read by `plain_value`; only bytes
    that torch's weights-only unpickler accepted reach DCP's own (full) unpickler."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        plain_value(value, read_item.dest_index.fqn)
        value.seek(0)
        super().load_bytes(read_item, value)


def load_safely(state: dict[str, Any], folder: str | Path, **options: Any) -> None:
    """``dcp.load`` of ``folder`` into ``state`` that runs no code from the folder."""
    dcp.load(state, storage_reader=SafeReader(folder), planner=SafeLoadPlanner(), **options)


def disk_full(error: BaseException) -> bool:
    """Whether ``error``, what caused it, or a rank's failure inside DCP's CheckpointException is ENOSPC."""
    pending, seen = [error], set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno == errno.ENOSPC:
            return True
        failures = [failure[0] for failure in getattr(current, "failures", {}).values()]  # rank -> (error, trace)
        pending += [cause for cause in (current.__cause__, current.__context__, *failures) if cause is not None]
    return "No space left on device" in str(error)


def _save_failed(folder: Path, error: BaseException) -> BaseException:
    """The error to raise for a failed save: ENOSPC said in words, with the folder."""
    if disk_full(error):
        return OSError(errno.ENOSPC, f"no space left on device (ENOSPC) while writing checkpoint {folder}; "
                                     "free space there or pass --checkpoint-dir on another disk")
    return error


def checkpoint_key(section: str, key: str, dims: Any) -> str:
    """``key`` of torch's state dict under the unsharded model's FQN, as the checkpoint names it."""
    if dims.pp_enabled:
        # This rank's pipeline stages sit in a ModuleList, each holding its model copy under
        # ``model``: "0.model.wte.weight", and "state.0.model.wte.weight.exp_avg" for the optimizer.
        key = re.sub(r"^((?:state|param_groups)\.)?\d+\.model\.", r"\1", key)
    return f"{section}.{key}"


def fused_row_order(parts: list[int], tp: int) -> list[int]:
    """Rows of a fused projection of ``parts`` (global sizes, in order) as tensor parallelism holds
    them: rank 0's share of every part, then rank 1's, ... (the generated module's fused section)."""
    starts = [sum(parts[:index]) for index in range(len(parts))]
    return [start + rank * (size // tp) + row for rank in range(tp)
            for start, size in zip(starts, parts) for row in range(size // tp)]


class RowOrders:
    """Parameters held with their rows permuted (fused projections split as their parts), put
    back in the model's own order wherever they leave the run (checkpoints, gathered weights) and
    permuted again on the way in, so files keep the model's layout under any plan.

    Args:
        fused: parameter FQN -> (the dim its rows run along, the parts' global sizes).
        tp: the tensor-parallel degree they were permuted for.
    """

    def __init__(self, fused: dict[str, tuple[int, list[int]]], tp: int) -> None:
        self.orders = {name: (dim, torch.tensor(fused_row_order(parts, tp))) for name, (dim, parts) in fused.items()}
        self.inverses = {name: torch.argsort(order) for name, (_, order) in self.orders.items()}

    def public(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """A whole tensor of parameter ``name`` (or its optimizer moment) in the model's row order."""
        if name not in self.orders:
            return full
        return full.index_select(self.orders[name][0], self.inverses[name].to(full.device))

    def private(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """A whole tensor in the model's row order, in the order the run holds it."""
        if name not in self.orders:
            return full
        dim, order = self.orders[name]
        return full.index_select(dim, order.to(full.device))

    def convert(self, state: dict[str, Any], to_public: bool) -> dict[str, Any]:
        """Checkpoint ``state`` (model.<fqn>, optimizer.state.<fqn>.<moment>) with the permuted
        parameters' entries converted (whole tensors gathered for it, one at a time)."""
        if not self.orders:
            return state
        converted = dict(state)
        for key in sorted(state):
            name = self._parameter_of(key, state[key])
            if name is not None:
                converted[key] = self._redistributed(name, state[key], to_public)
        return converted

    def _parameter_of(self, key: str, value: Any) -> str | None:
        for prefix in ("model.", "optimizer.state."):
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix):]
            for name, (dim, order) in self.orders.items():
                if (rest == name or rest.startswith(name + ".")) and isinstance(value, torch.Tensor) \
                        and value.dim() > dim and value.shape[dim] == len(order):
                    return name
        return None

    def _redistributed(self, name: str, value: torch.Tensor, to_public: bool) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate

        convert = self.public if to_public else self.private
        if not isinstance(value, DTensor):
            return convert(name, value.detach())
        full = convert(name, value.full_tensor().detach())
        whole = DTensor.from_local(full, value.device_mesh, [Replicate()] * value.device_mesh.ndim, run_check=False)
        return whole.redistribute(value.device_mesh, value.placements)  # a local cut: no communication


def _tied_alias(key: str, available: set[str], tied_parameters: list[list[str]]) -> str | None:
    """``key`` with its parameter named by another of its tied names, one the checkpoint holds, or
    None. (A pipeline's last stage asks for the state of ``lm_head.weight``; a run without
    pipeline saved the optimizer state of the one tensor under ``wte.weight`` only.)"""
    for section in ("model.", "optimizer.state.", "optimizer.param_groups."):
        if not key.startswith(section):
            continue
        rest = key[len(section):]
        for group in tied_parameters:
            for name in (n for n in group if rest == n or rest.startswith(n + ".")):
                suffix = rest[len(name):]
                alias = next((f"{section}{other}{suffix}" for other in group
                              if f"{section}{other}{suffix}" in available), None)
                if alias is not None:
                    return alias
    return None


def _rng_state() -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    state = {f"rank{rank}.cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state[f"rank{rank}.cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    rank = dist.get_rank()
    if f"rank{rank}.cpu" in state:
        torch.set_rng_state(state[f"rank{rank}.cpu"])
    if torch.cuda.is_available() and f"rank{rank}.cuda" in state:
        torch.cuda.set_rng_state(state[f"rank{rank}.cuda"])


def inject_failure(step: int, fail_at_step: int | None) -> None:
    """Fault injection (``--fail-at-step``): the last rank kills itself with SIGKILL when it
    starts step ``fail_at_step`` in torchrun's first attempt, to exercise restarts and resuming
    (later attempts pass the step, so a restarted run can finish)."""
    if fail_at_step is None or step != fail_at_step:
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0 and dist.get_rank() == dist.get_world_size() - 1:
        os.kill(os.getpid(), signal.SIGKILL)


class Checkpointer:
    """Saves this rank's part of the training state and loads it back, under any plan.

    Args:
        options: directory, frequency, async saving.
        modules: the model, or this rank's pipeline stages.
        optimizer: torch's AdamW, or one of the runtime's own (ZeRO-1's `ShardedAdamW`, the
            gradient exchanges of gradient_sync.py), which give their state in AdamW's
            per-parameter form, so their checkpoints load under any plan too.
        dims: the plan's degrees (pipeline stages are saved under the whole model's FQNs).
        tied_parameters: parameter FQNs sharing one tensor.
        rows: parameters held with permuted rows (fused projections), saved in the model's order.
    """

    def __init__(self, options: CheckpointConfig, modules: list[nn.Module], optimizer: Any, dims: Any,
                 tied_parameters: list[list[str]], rows: RowOrders | None = None):
        self.options = options
        self.rows = rows or RowOrders({}, 1)
        self.dims = dims
        self.model = modules[0]
        if dims.pp_enabled:
            self.model = nn.ModuleList(modules)
        self.optimizer = optimizer
        self.tied_parameters = tied_parameters
        self.pending: tuple[Future, Path, int] | None = None  # the save in flight: its future, folder, step
        self.last_saved: int | None = None
        self.samples: int | None = None  # the data position of the checkpoint resumed from
        # Async saves plan over their own gloo group from a background thread, so their
        # collectives never interleave with training's (and NCCL runs need a CPU group anyway).
        self.group = dist.new_group(backend="gloo") if options.enabled and options.async_save else None

    @property
    def directory(self) -> Path:
        """The checkpoint folder (saving and resuming are asked for only when one is set)."""
        if self.options.directory is None:
            raise ValueError("checkpointing needs a checkpoint directory, and none was set")
        return Path(self.options.directory)

    def _state(self, step: int, samples: int = 0) -> tuple[dict[str, Any], dict[str, tuple[str, str]]]:
        """This rank's state under checkpoint keys, and where each key came from: (section, its
        key in torch's state dict), the sections being model, optimizer, train and rng."""
        train = {"step": torch.tensor(step, dtype=torch.int64), "samples": torch.tensor(samples, dtype=torch.int64)}
        sections = {"model": get_model_state_dict(self.model), "optimizer": self._optimizer_state(),
                    "train": train, "rng": _rng_state()}
        state: dict[str, Any] = {}
        origin: dict[str, tuple[str, str]] = {}
        for section, values in sections.items():
            for key, value in values.items():
                name = checkpoint_key(section, key, self.dims)
                state[name], origin[name] = value, (section, key)
        return self.rows.convert(state, to_public=True), origin

    def _parameter_fqns(self) -> list[str]:
        names = {id(p): n for n, p in self.model.named_parameters()}
        return [names[id(p)] for p in self.optimizer.parameters]

    def _optimizer_state(self) -> dict[str, Any]:
        if isinstance(self.optimizer, torch.optim.Optimizer):
            return get_optimizer_state_dict(self.model, self.optimizer, options=_FLAT_OPTIMIZER)
        return self.optimizer.flat_state_dict(self._parameter_fqns())

    def save(self, step: int, samples: int | None = None) -> None:
        """Write ``DIR/step_<step>/`` and mark it complete once every rank's part is on disk;
        ``samples``: the data position after the step (None: not recorded)."""
        self.wait()  # one save in flight at a time
        folder = self.directory / f"step_{step}"
        if dist.get_rank() == 0:
            refuse_link(self.directory, "the checkpoint folder")
            refuse_link(folder, "checkpoint")
            # Leftovers of an attempt killed while writing this step: marker first, so a crash
            # half-way through the removal never leaves a marked, partial folder.
            (folder / COMPLETE).unlink(missing_ok=True)
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
        dist.barrier()
        state, _ = self._state(step, samples if samples is not None else 0)
        self.last_saved = step
        if not self.options.async_save:
            try:
                dcp.save(state, checkpoint_id=folder)
                dist.barrier()
                if dist.get_rank() == 0:
                    _mark_complete(folder, step)
            except _FAILURES as error:
                raise _save_failed(folder, error) from error
            return
        # The copy to CPU happens now; writing goes on in a thread. DCP's coordinator (rank 0)
        # finishes a save only after gathering every rank's write results and writing the
        # metadata, so rank 0's save being done means the whole checkpoint is on disk.
        saving = dcp.async_save(state, checkpoint_id=folder, process_group=self.group)
        # A Future, or (with an asynchronous stager) a response holding the upload's Future.
        pending = saving if isinstance(saving, Future) else saving.upload_completion
        self.pending = pending, folder, step
        if dist.get_rank() == 0:
            def mark_when_written(done: Future) -> None:
                if done.exception() is None:
                    _mark_complete(folder, step)

            pending.add_done_callback(mark_when_written)

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and marked."""
        if self.pending is None:
            return
        pending, folder, step = self.pending
        try:
            pending.result()
            self.pending = None
            if dist.get_rank() == 0:
                _mark_complete(folder, step)  # its callback may still be on its way
        except _FAILURES as error:
            raise _save_failed(folder, error) from error

    def resume(self) -> int:
        """Load the latest usable checkpoint (complete, checksums matching), if any; returns the
        optimizer steps it holds (0 without one). Rank 0 picks the folder so every rank loads the
        same one, and sends its error instead when there is none to use, so all ranks stop."""
        choice: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                refuse_links(self.directory)
                choice = [usable_checkpoint(self.directory, self.options.allow_fresh_start)]
            except RuntimeError as error:
                choice = [str(error)]
        dist.broadcast_object_list(choice, src=0)
        if isinstance(choice[0], str):
            raise RuntimeError(choice[0])
        if choice[0] is None:
            return 0
        _, folder = choice[0]
        try:
            step, self.samples = self.load(Path(folder))
        except _FAILURES as error:
            if dist.get_rank() == 0:  # the next attempt goes to the checkpoint before this one
                write_text_no_follow(Path(folder) / UNUSABLE, f"{type(error).__name__}: {str(error)[:2000]}\n")
            raise RuntimeError(f"checkpoint {folder} failed to load ({type(error).__name__}: {error}); "
                               f"it is marked {UNUSABLE}, a restart resumes from the one before") from error
        named = named_step(Path(folder))
        if dist.get_rank() == 0:
            renamed = f", not the {named} its name says (renamed?): resuming at step {step}" if named != step else ""
            print(f"resumed from {folder} ({step} steps done{renamed})", flush=True)
        # A renamed folder does not count as this run's save of its step: the step is saved again
        # under its own name when the run gets there (or ends there).
        self.last_saved = step if named == step else None
        return step

    def load(self, folder: Path) -> tuple[int, int | None]:
        """Load ``folder`` into the model, optimizer and RNGs (resharding as needed); returns its
        step and data position (None when it recorded none)."""
        state, origin = self._state(0)  # the shapes and shardings to load into
        loaded: dict[str, dict[str, Any]] = {"model": {}, "optimizer": {}, "train": {}, "rng": {}}
        read = self.rows.convert(read_checkpoint(folder, state, self.dims, self.tied_parameters), to_public=False)
        for key, value in read.items():
            section, name = origin[key]
            loaded[section][name] = value
        set_model_state_dict(self.model, loaded["model"])  # first: ZeRO-1 copies its slice from the parameters
        if isinstance(self.optimizer, torch.optim.Optimizer):
            set_optimizer_state_dict(self.model, self.optimizer, loaded["optimizer"], options=_FLAT_OPTIMIZER)
        else:
            self.optimizer.load_flat_state_dict(loaded["optimizer"], self._parameter_fqns())
        _set_rng_state(loaded["rng"])
        samples = loaded["train"].get("samples")
        return int(loaded["train"]["step"]), int(samples) if samples is not None and int(samples) > 0 else None

    def finish(self, step: int, samples: int | None = None) -> None:
        """Save the state after the last step (unless saved or resumed at or past it) and wait for
        every save to be written."""
        if self.last_saved is None or self.last_saved < step:
            self.save(step, samples)
        self.wait()


@torch.no_grad()
def read_checkpoint(folder: Path, state: dict[str, Any], dims: Any,
                    tied_parameters: list[list[str]]) -> dict[str, Any]:
    """``state``'s values read from ``folder``, tensors in place. RNG states of ranks the saving
    run did not have are left out (such a rank keeps its seeded RNG)."""
    available = set(read_metadata(folder).state_dict_metadata)
    # Optional keys: RNG states of ranks the saving run did not have; the data position of a
    # checkpoint written before it was saved.
    sources = {key: key for key in state if key in available or not (key.startswith("rng.") or key in OPTIONAL_KEYS)}
    if dims.pp_enabled:
        # A pipeline's last stage asks for the state of lm_head.weight; a run without pipeline
        # saved the optimizer state of the one tied tensor under wte.weight only.
        sources = {key: key if key in available else _tied_alias(key, available, tied_parameters) or key
                   for key in sources}
    missing = [key for key, source in sources.items() if source not in available]
    if missing:
        raise RuntimeError(f"checkpoint {folder} has no {missing[0]!r}: it was written for another model "
                           "(or with another optimizer)")
    request: dict[str, Any] = {}
    for key, source in sources.items():
        request.setdefault(source, state[key])
    load_safely(request, folder)
    values = {key: request[source] for key, source in sources.items()}
    if dims.pp_enabled:
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and value is not state[key]:
                # Two copies of a tied tensor on this rank (the traced pipeline split keeps
                # them): the second gets its own copy of what was read for the first.
                values[key] = state[key].copy_(value)
    return values


def consolidated_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """The model entries of a checkpoint as full tensors, read in this process alone."""
    metadata = read_metadata(folder)
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the point here
        warnings.simplefilter("ignore", UserWarning)
        load_safely(state, folder, no_dist=True)
    return {key[len("model."):]: tensor for key, tensor in state.items()}


def write_weights(state: dict[str, torch.Tensor], path: str | Path) -> None:
    """One file for inference: safetensors for a ``.safetensors`` path (needs the safetensors
    package), else ``torch.save``. Written beside and renamed, so a crash leaves no half file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A fresh name (O_EXCL: a link planted under a fixed one would be written through).
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        if path.suffix == ".safetensors":
            _safetensors().save_file({key: tensor.contiguous() for key, tensor in state.items()}, str(tmp))
        else:
            torch.save(state, tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _safetensors() -> Any:
    """safetensors.torch, imported only when asked for: the module itself needs nothing but torch."""
    try:
        return importlib.import_module("safetensors.torch")
    except ModuleNotFoundError:
        raise RuntimeError("exporting to .safetensors needs the safetensors package (pip install "
                           "safetensors); or export to a .pt path (torch.save)") from None


def check_export_path(path: str | Path | None) -> None:
    """Fail before training, not after it, when the export format cannot be written."""
    if path is not None and Path(path).suffix == ".safetensors":
        _safetensors()


def export_latest_checkpoint(directory: str | Path, path: str | Path,
                             write: Callable[[dict[str, torch.Tensor], str | Path], None] = write_weights) -> Path:
    """Consolidate the latest usable checkpoint of ``directory`` into ``path`` (by ``write``: one
    file by default); returns its folder."""
    latest = usable_checkpoint(directory)
    if latest is None:
        raise FileNotFoundError(f"no complete checkpoint in {directory} to export")
    write(consolidated_weights(latest[1]), path)
    return latest[1]

"""Pretrained weights in (``--init-from PATH``) and trained weights out as a model folder (``--export DIR``).

Loading. PATH is a ``.safetensors`` file, a Hugging Face model folder (``model.safetensors``, or
the shards ``model.safetensors.index.json`` lists; ``pytorch_model.bin`` and its sharded form
likewise) or a file of ``torch.save(state_dict)``. Every rank opens the file lazily (safetensors'
``safe_open``, ``torch.load(mmap=True)``) and reads, one tensor at a time, the part of each
parameter and persistent buffer it holds: a DTensor's local shard (just those bytes when the shard
is one block of the tensor; the whole tensor, then cut, when FSDP's strided shard over TP makes it
several), else the whole tensor. So no rank ever holds more than the largest tensor beside its own
shards, and no collective runs. The file's names are matched against the model's first (a tied
parameter loads from whichever of its names the file has); a mismatch is refused before any
weight changes. Values are cast to each parameter's dtype.

Export. A path without a suffix (or an existing folder) gets a folder: ``model.safetensors``
(tied copies dropped as ``save_pretrained`` drops them) and, for a Hugging Face model (one with a
``config`` that saves itself), ``config.json`` and ``generation_config.json``, so
``AutoModelForCausalLM.from_pretrained(DIR)`` loads it. It is written into a staging folder and
renamed into place; a non-empty folder that autopar did not write is never replaced.

It depends on no plan, so a generated folder holds it once, as pretrained.py beside the training module.

    torchrun ... parallel_<model>.py --init-from llama_hf/   (fine-tune from these weights)
    torchrun ... parallel_<model>.py --export out_hf         (a folder transformers can load)
"""
from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, TypeGuard

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"
# Written last into every folder --export makes: a folder holding it may be replaced by the next export.
EXPORT_MARKER = ".autopar-export"
# What an export folder holds (write_folder): a previous export is replaced only when it holds no more.
EXPORT_FILES = (SAFETENSORS, "config.json", "generation_config.json", EXPORT_MARKER)
SHOWN = 5  # names listed per kind of mismatch


class WeightsError(ValueError):
    """Weights that cannot be loaded into this model; the message says why and what to do."""


def _import_safetensors(package: str = "safetensors") -> Any:
    """safetensors, imported only when a file needs it: the module itself needs nothing but torch."""
    try:
        return importlib.import_module(package)
    except ModuleNotFoundError:
        raise WeightsError("reading or writing .safetensors needs the safetensors package: pip install "
                           "safetensors") from None


def weight_files(path: str | Path) -> dict[str, Path] | list[Path]:
    """The files holding PATH's weights: tensor name -> file for a sharded folder (from its index),
    else the one file as a list."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise WeightsError(f"--init-from {path}: no such file or folder. Fix: pass a .safetensors file, a "
                           f"Hugging Face model folder ({SAFETENSORS} or {SAFETENSORS_INDEX}), or a torch state "
                           "dict file")
    for index in (SAFETENSORS_INDEX, TORCH_BIN_INDEX):
        if (path / index).is_file():
            weight_map = json.loads((path / index).read_text())["weight_map"]
            return {name: path / file for name, file in weight_map.items()}
    for single in (SAFETENSORS, TORCH_BIN):
        if (path / single).is_file():
            return [path / single]
    raise WeightsError(f"--init-from {path}: the folder holds none of {SAFETENSORS}, {SAFETENSORS_INDEX}, "
                       f"{TORCH_BIN}, {TORCH_BIN_INDEX}. Fix: pass the folder save_pretrained wrote, or the "
                       "weights file itself")


class WeightSource:
    """The tensors of a weights file or model folder, opened lazily and read one at a time."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        files = weight_files(path)
        self._handles: dict[Path, Any] = {}
        if isinstance(files, dict):
            self.file_of = files
        else:
            self.file_of = {name: files[0] for name in self._open(files[0]).keys()}

    def _open(self, file: Path) -> Any:
        """A safetensors handle, or a torch state dict whose tensors are mapped from disk."""
        if file not in self._handles:
            if file.suffix == ".safetensors":
                self._handles[file] = _import_safetensors().safe_open(str(file), framework="pt", device="cpu")
            else:
                self._handles[file] = _torch_state(file)
        return self._handles[file]

    def names(self) -> set[str]:
        return set(self.file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        handle = self._open(self.file_of[name])
        if isinstance(handle, dict):
            return tuple(handle[name].shape)
        return tuple(handle.get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor ``name`` (only its block ``index`` when given), on the CPU in the file's dtype."""
        handle = self._open(self.file_of[name])
        if isinstance(handle, dict):
            return handle[name] if index is None else handle[name][index]
        if index is None:
            return handle.get_tensor(name)
        return handle.get_slice(name)[index]


def _torch_state(file: Path) -> dict[str, torch.Tensor]:
    """``torch.load`` of a state dict, mapped from disk (pages are read as tensors are touched)."""
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # noqa: BLE001 - torch raises several kinds for a file it cannot map
        raise WeightsError(f"--init-from {file}: torch.load(weights_only=True, mmap=True) cannot read it "
                           f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}). Fix: "
                           "save it again with torch.save(model.state_dict(), path) (torch >= 1.6 format), or "
                           "convert it to .safetensors") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise WeightsError(f"--init-from {file} holds {type(state).__name__}, not a state dict (name -> tensor). "
                           "Fix: save model.state_dict() alone (not a training checkpoint with optimizer state)")
    return state


@dataclass
class Mismatch:
    """How a file's tensors differ from the model's."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    wrong_shape: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)  # (name, file, model)

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.wrong_shape)

    def message(self, path: str | Path) -> str:
        parts = []
        for label, items in (("missing (in the model, not in the file)", self.missing),
                             ("unexpected (in the file, not in the model)", self.unexpected),
                             ("wrongly shaped", [f"{n} (file {list(f)}, model {list(m)})"
                                                 for n, f, m in self.wrong_shape])):
            if items:
                more = f", ... {len(items) - SHOWN} more" if len(items) > SHOWN else ""
                parts.append(f"{len(items)} {label}: {', '.join(items[:SHOWN])}{more}")
        return (f"--init-from {path} does not match the model of model.py: {'; '.join(parts)}. No weight was "
                "changed. Fix: build in model.py the architecture and sizes the weights were saved from (the file's "
                "names must be the model's named_parameters() and persistent buffers, e.g. a LlamaForCausalLM's "
                "'model.layers.0.self_attn.q_proj.weight'), or rename the file's tensors to the model's")


def expected_tensors(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """What a weights file must hold for ``model`` (built whole, e.g. on the meta device): every
    parameter (tied ones under each name) and persistent buffer, with its shape."""
    return {name: tuple(value.shape) for name, value in model.state_dict(keep_vars=True).items()
            if isinstance(value, torch.Tensor)}


def ignored_unexpected(model: nn.Module) -> list[str]:
    """Patterns of file names a Hugging Face model ignores when loading (``_keys_to_ignore_on_load_unexpected``)."""
    return list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])


def match_names(expected: dict[str, tuple[int, ...]], source: WeightSource, tied: list[list[str]],
                ignored: Sequence[str] = ()) -> tuple[dict[str, str], Mismatch]:
    """(model name -> the file's name for it, what does not match). A tied parameter is found under
    any of its names."""
    available = source.names()
    found: dict[str, str] = {}
    mismatch = Mismatch()
    for name, shape in expected.items():
        group = next((g for g in tied if name in g), [name])
        alias = name if name in available else next((other for other in group if other in available), None)
        if alias is None:
            mismatch.missing.append(name)
            continue
        found[name] = alias
        if source.shape(alias) != shape:
            mismatch.wrong_shape.append((name, source.shape(alias), shape))
    tied_names = {name for group in tied for name in group}
    mismatch.unexpected = sorted(name for name in available - set(expected) - tied_names
                                 if not any(re.search(pattern, name) for pattern in ignored))
    return found, mismatch


def shard_index(tensor: DTensor) -> tuple[slice, ...] | None:
    """The block of the full tensor this rank's shard of ``tensor`` is, or None when the shard is
    not one block (FSDP's strided shard of a tensor-parallel dim)."""
    if any(type(p) not in (Shard, Replicate) for p in tensor.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, shape))


def local_part(source: WeightSource, name: str, target: torch.Tensor,
               permute: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The part of the file's tensor ``name`` that ``target`` holds on this rank (``permute``: the
    rows of a tensor the run holds in another order, a fused projection's, put in that order)."""
    if not isinstance(target, DTensor):
        return source.read(name) if permute is None else permute(source.read(name))
    index = shard_index(target) if permute is None else None
    if index is not None:
        return source.read(name, index)
    # Several blocks: cut the whole tensor as DTensor does (src_data_rank=None: no communication).
    full = source.read(name).to(target.device)
    full = full if permute is None else permute(full)
    return distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()


@torch.no_grad()
def load_pretrained(path: str | Path, expected: dict[str, tuple[int, ...]], held: list[tuple[str, torch.Tensor]],
                    tied: list[list[str]], ignored: Sequence[str] = (),
                    permuted: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None) -> int:
    """Copy the weights at ``path`` into this rank's tensors; returns how many tensors it set.

    Args:
        path: a weights file or model folder (see the module docstring).
        expected: the whole model's tensors and shapes (`expected_tensors`), matched first.
        held: this rank's parameters and persistent buffers under their FQNs in the unsharded
            model (DTensors hold a shard; tied tensors under each name).
        tied: groups of parameter FQNs sharing one tensor.
        ignored: patterns of file names to leave out without complaint (`ignored_unexpected`).
        permuted: FQN -> how to put a whole tensor's rows in the order this run holds them
            (fused projections split as their parts).

    Raises:
        WeightsError: the names or shapes do not match (nothing was changed), or the file is unreadable.
    """
    source = WeightSource(path)
    found, mismatch = match_names(expected, source, tied, ignored)
    unknown = sorted(name for name, _ in held if name not in found and name not in mismatch.missing)
    mismatch.missing += unknown
    if mismatch:
        raise WeightsError(mismatch.message(path))
    done: set[int] = set()
    for name, tensor in held:
        if id(tensor) in done:
            continue
        done.add(id(tensor))
        part = local_part(source, found[name], tensor, (permuted or {}).get(name))
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if tuple(part.shape) != tuple(local.shape):
            raise WeightsError(f"--init-from: {name}'s shard on this rank has shape {list(local.shape)} but its "
                               f"part of the file's tensor {list(part.shape)}: this layout is not supported yet. "
                               "Fix: start from a checkpoint instead (load the weights once under a plan without "
                               "it and save one with --checkpoint-every)")
        local.copy_(part)
    return len(done)


def persistent_buffers(modules: list[nn.Module], prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """The buffers a state dict saves, of every module, under their FQN with ``prefix`` dropped (a
    pipeline stage holds its model copy under ``model.``)."""
    found = []
    for module in modules:
        parameters = {id(p) for p in module.parameters()}
        for name, value in module.state_dict(keep_vars=True).items():
            if isinstance(value, torch.Tensor) and id(value) not in parameters:
                found.append((name.removeprefix(prefix), value))
    return found


def check_paths(init_from: str | Path | None, export: str | Path | None) -> None:
    """Fail before the model is built: the weights to start from are not there, or the export
    folder cannot be written."""
    if init_from is not None:
        weight_files(init_from)
    check_export_folder(export)


def is_folder_export(path: str | Path | None) -> TypeGuard[str | Path]:
    """Whether --export PATH asks for a folder: no suffix, or a folder already there (a path with
    a suffix keeps writing one file: safetensors for .safetensors, else torch.save)."""
    return path is not None and (Path(path).is_dir() or Path(path).suffix == "")


def check_export_folder(path: str | Path | None) -> None:
    """Fail before training, not after it, when the export folder cannot be written: a file is
    there, or a non-empty folder autopar did not write (it is never replaced)."""
    if not is_folder_export(path):
        return
    path = Path(path)
    _import_safetensors()
    if path.is_symlink():
        raise WeightsError(f"--export {path} is a symbolic link; autopar replaces an export folder as a whole and "
                           "never through a link. Fix: pass the folder itself, or a new one")
    if not path.exists() or not any(path.iterdir()):
        return
    foreign = sorted(entry.name for entry in path.iterdir() if entry.name not in EXPORT_FILES) \
        if (path / EXPORT_MARKER).is_file() else ["(no autopar export marker)"]
    if foreign:
        raise WeightsError(f"--export {path}: the folder holds files autopar did not write "
                           f"({', '.join(foreign[:SHOWN])}), "
                           "which it never replaces. Fix: pass a new or empty folder (or move those files yourself)")


def is_hugging_face(model: nn.Module | None) -> TypeGuard[nn.Module]:
    """Whether ``model`` is a transformers model: its config saves itself as config.json."""
    return callable(getattr(getattr(model, "config", None), "save_pretrained", None))


def dropped_tied_names(state: dict[str, torch.Tensor], tied: list[list[str]], model: nn.Module | None) -> set[str]:
    """The names of tied copies the folder leaves out: all but one per group, keeping the one
    ``save_pretrained`` keeps (not a key of the model's tied-weights map, e.g. the embedding,
    not lm_head.weight), else the first."""
    tied_keys = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or ()
    tied_keys = set(tied_keys)  # a dict (tied name -> source) or a list of tied names
    dropped: set[str] = set()
    for group in tied:
        present = [name for name in group if name in state]
        if len(present) > 1:
            keep = next((name for name in present if name not in tied_keys), present[0])
            dropped.update(name for name in present if name != keep)
    return dropped


def write_folder(state: dict[str, torch.Tensor], path: str | Path, tied: list[list[str]],
                 model: nn.Module | None = None) -> Path:
    """Write ``DIR/model.safetensors`` (+ ``config.json`` and ``generation_config.json`` for a
    Hugging Face ``model``, which may be built on the meta device: only its config is read) via a
    staging folder renamed into place; returns the folder."""
    path = Path(path)
    check_export_folder(path)
    dropped = dropped_tied_names(state, tied, model)
    tensors = {name: tensor.detach().contiguous() for name, tensor in state.items() if name not in dropped}
    path.parent.mkdir(parents=True, exist_ok=True)
    # A fresh name beside the target (same file system, so the rename is atomic): nothing that was
    # there before is ever removed.
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
    try:
        _import_safetensors("safetensors.torch").save_file(tensors, str(staging / SAFETENSORS),
                                                           metadata={"format": "pt"})
        if is_hugging_face(model):
            write_hf_config(model, staging)
        (staging / EXPORT_MARKER).write_text(
            json.dumps({"tensors": len(tensors), "dropped_tied": sorted(dropped)}) + "\n")
        replace_folder(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def write_hf_config(model: nn.Module, folder: Path) -> None:
    """config.json (naming the model's class, as save_pretrained does) and generation_config.json."""
    config: Any = model.config
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", lambda: False)
    if generation is not None and can_generate():
        generation.save_pretrained(folder)


def replace_folder(staging: Path, path: Path) -> None:
    """Move ``staging`` to ``path``; a folder there (empty, or autopar's export) is moved aside first
    and removed after, so ``path`` is never a half-written folder."""
    if not path.exists():
        os.replace(staging, path)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))  # a fresh name: nothing else goes
    os.replace(path, aside / path.name)
    os.replace(staging, path)
    shutil.rmtree(aside, ignore_errors=True)

"""Profiles kept between runs, so a second `autopar plan` of the same model skips tracing.

Tracing a frontier model still costs seconds (the 405B Llama: building it on fake tensors and
tracing a narrowed copy, ~4 s of a ~14 s plan); sweeps, re-plans on another cluster and
compile after plan ask for the same profile again. A profile is reused only when everything it
was traced from is unchanged, named in its key:
- the model file's bytes, and the bytes of every neighbour module it imports (a `blocks.py`
  beside `model.py`), the installed version of every other package it imports by name
  (transformers), Python's and torch's versions;
- the settings tracing reads (model.*, micro-batch size, precision, plan.blocks,
  plan.trace_every_block);
- autopar's own code (a digest of its .py files): a profile traced by other code is traced again.
Beside a profile, `<key>.findings.json` keeps what planning then worked out by running the model
(ModelProfile.findings: which tensor-parallel splits its code runs, ~3 s of rebuilding the 405B
model on fake tensors and probing its layers), valid as long as the profile is: same key.
The folder is kept under 2 GiB (`$AUTOPAR_PROFILE_CACHE_MAX_MB`): storing a profile removes the least
recently used ones past that.
A stale or unreadable entry is traced again, never trusted; a cache that cannot be written
(read-only home) costs nothing but the reuse. Entries live in `$AUTOPAR_PROFILE_CACHE`, else
`$XDG_CACHE_HOME/autopar/profiles`, else `~/.cache/autopar/profiles`; `AUTOPAR_PROFILE_CACHE=off`
or `plan.reuse_profile=false` turns reuse off. Entries are JSON (no code, no pickle), the ops of
copied blocks written by reference (autopar.kept_ops: a 70B Llama's 7 MB are 1 MB).
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

from autopar.kept_ops import fold, unfold
from autopar.model_profile import ModelProfile, OpProfile
from autopar.serialize import compact_json, from_jsonable

CACHE_VARIABLE = "AUTOPAR_PROFILE_CACHE"
FINDINGS_SUFFIX = ".findings.json"  # beside <key>.json: ModelProfile.findings of later plans
MAX_MB_VARIABLE = "AUTOPAR_PROFILE_CACHE_MAX_MB"
KEY_PATTERN = re.compile(r"[0-9a-f]{32}")  # `profile_key`'s digests
MAX_BYTES = 2 * 2**30  # the folder's size past which the least recently used profiles go (`prune`)
PACKAGE = Path(__file__).resolve().parent


def cache_folder() -> Path | None:
    """Where profiles are kept (module docstring); None when reuse is off."""
    setting = os.environ.get(CACHE_VARIABLE, "")
    if setting.lower() == "off":
        return None
    if setting:
        return Path(setting).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "autopar" / "profiles"


@functools.cache
def autopar_code_digest() -> str:
    """A digest of autopar's .py files: what a profile's meaning depends on besides the model."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(PACKAGE)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def imported_names(source: bytes) -> list[str]:
    """Top-level names of the modules a file imports (absolute imports, at any depth; none for a
    file that does not parse, whose bytes the key holds anyway)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return sorted(names)


def _neighbour_digest(folder: Path, name: str) -> str | None:
    """The bytes of a module or package beside the model file, digested (None: no such file)."""
    module, package = folder / f"{name}.py", folder / name
    if module.is_file():
        return _digest([module])
    return _digest(sorted(package.rglob("*.py"))) if package.is_dir() else None


def _digest(files: list[Path]) -> str | None:
    """The bytes of the files, digested in order (None: no files)."""
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.read_bytes() if path.is_file() else b"")
    return digest.hexdigest()


def _installed_version(name: str) -> str | None:
    """The version of an imported package, by the distribution of its name, with where it is
    imported from; a module of no known version (one on a path the model file added) by its
    files' bytes; None for the standard library. Read from the installed metadata, never from the
    module itself, so that it reads the same before the model file imports it as after."""
    if name in sys.stdlib_module_names:
        return None
    file = _module_file(name)
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return _distribution_versions(name) if _installed(file) else _files_digest(file)
    return f"{version} at {file}"


def _module_file(name: str) -> str | None:
    """Where a module is (or would be) imported from: its own `__file__` once imported, else
    where the import system finds it, without running it (the same path either way, so a key
    computed before the model file's import equals one computed after)."""
    module = sys.modules.get(name)
    if module is not None:
        return getattr(module, "__file__", None)
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.has_location else None


def _installed(file: str | None) -> bool:
    """Whether a module's file belongs to an installed distribution (site-packages)."""
    return file is not None and any(part in ("site-packages", "dist-packages") for part in Path(file).parts)


def _distribution_versions(name: str) -> str | None:
    """The versions of the distributions providing an installed module whose name is not theirs
    (yaml in PyYAML); reading every distribution's metadata is slow, so only asked here."""
    versions = []
    for distribution in sorted(set(importlib.metadata.packages_distributions().get(name, []))):
        try:
            versions.append(f"{distribution}=={importlib.metadata.version(distribution)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join(versions) or None


def _files_digest(file: str | None) -> str | None:
    """The bytes of a module's file, or of every .py file of its package, digested."""
    if not file:
        return None
    path = Path(file)
    return _digest(sorted(path.parent.rglob("*.py")) if path.name == "__init__.py" else [path])


def dependencies(model_path: Path, source: bytes) -> dict[str, Any]:
    """What the model file imports, as its key records it: neighbours by content, packages by version."""
    found: dict[str, Any] = {}
    seen: set[str] = set()
    pending = [(model_path.parent, source)]
    while pending:
        folder, text = pending.pop()
        for name in imported_names(text):
            if name in seen:
                continue
            seen.add(name)
            neighbour = _neighbour_digest(folder, name)
            if neighbour is not None:
                found[name] = neighbour
                module = folder / f"{name}.py"
                if module.is_file():  # its own imports count too
                    pending.append((folder, module.read_bytes()))
            else:
                found[name] = _installed_version(name)
    return found


def profile_key(model_path: Path, source: bytes, model_sha256: str, settings: dict[str, Any],
                imported: bool = True) -> str | None:
    """The cache key of a profile (module docstring says what it holds); `model_sha256` is the
    digest of `source`, the model file's bytes. Before the model file is imported
    (`imported=False`), None where one of its imports cannot be found yet (a module on a path
    the file adds to sys.path as it runs): nothing would key that module's bytes, so the caller
    imports the file first and asks again."""
    found = dependencies(model_path, source)
    if not imported and any(version is None and name not in sys.stdlib_module_names
                            for name, version in found.items()):
        return None
    facts = {"model": model_sha256, "imports": found,
             "settings": settings, "python": sys.version, "torch": _installed_version("torch"),
             "autopar": autopar_code_digest()}
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def load(key: str, model_path: Path, model_sha256: str) -> ModelProfile | None:
    """The kept profile of `key`, pointed at `model_path` (None: none kept, unreadable, or of
    other bytes than the model file's)."""
    folder = cache_folder()
    if folder is None:
        return None
    try:
        profile = _read(folder / f"{key}.json")
    except Exception:  # noqa: BLE001 - a missing or damaged entry is traced again, never trusted
        return None
    if profile.model_sha256 != model_sha256:
        return None
    # Used now: the last to go when the folder is pruned (a link's own time, never its target's).
    with contextlib.suppress(OSError, NotImplementedError):
        os.utime(folder / f"{key}.json", follow_symlinks=False)
    return dataclasses.replace(profile, model_path=str(model_path), findings=_kept_findings(folder, key))


def _kept_findings(folder: Path, key: str) -> dict[str, Any]:
    try:
        findings = json.loads((folder / f"{key}{FINDINGS_SUFFIX}").read_text())
    except (OSError, ValueError):
        return {}
    return findings if isinstance(findings, dict) else {}


def _read(path: Path) -> ModelProfile:
    """A profile `store` wrote: its ops unfolded (autopar.kept_ops)."""
    data = json.loads(path.read_text())
    profile = from_jsonable(ModelProfile, data["profile"])
    kept = [entry if isinstance(entry, list) else from_jsonable(OpProfile, entry) for entry in data["ops"]]
    return dataclasses.replace(profile, ops=unfold(kept, profile.layers))


def store(key: str, profile: ModelProfile) -> Path | None:
    """Keep a profile under `key`, written whole or not at all (None: not kept)."""
    # Compact, and encoded by json's C encoder in one call (json.dump streams through the
    # pure-Python one, 4x slower on a 405B profile's 11 MB); the copied blocks' ops by reference.
    text = (f'{{"profile":{compact_json(dataclasses.replace(profile, ops=[]))},'
            f'"ops":{compact_json(fold(profile.ops, profile.layers))}}}')
    written = _write(f"{key}.json", text)
    if written is not None:
        prune(written.parent, max_bytes(), keep=key)
    return written


def max_bytes() -> int:
    """How large the folder may grow (`$AUTOPAR_PROFILE_CACHE_MAX_MB`, else MAX_BYTES)."""
    try:
        return int(float(os.environ[MAX_MB_VARIABLE]) * 2**20)
    except (KeyError, ValueError):
        return MAX_BYTES


def prune(folder: Path, limit: int, keep: str) -> list[str]:
    """Remove the least recently used profiles, each with its findings, until the folder holds at
    most `limit` bytes (a profile is used when kept or reused); `keep`, the one just written,
    stays whatever its size, and findings left without their profile go. Returns the keys removed.
    Every model or setting traced, and every autopar version, keys a new entry (a 405B Llama's
    is 11 MB), so an unpruned folder only grows."""
    entries = []
    try:
        # Only autopar's own entries: regular files (it writes no links) named by their key, since a
        # folder set by hand may hold others. Unlinking a name never follows it anyway.
        named = {path.name: path.lstat() for path in folder.glob("*.json") if KEY_PATTERN.fullmatch(_key_of(path.name))}
        own = {name: facts for name, facts in named.items() if stat.S_ISREG(facts.st_mode)}
        for name, facts in own.items():
            key = _key_of(name)
            if name.endswith(FINDINGS_SUFFIX):
                if f"{key}.json" not in named:
                    (folder / name).unlink(missing_ok=True)  # its profile is gone
                continue
            findings = own.get(f"{key}{FINDINGS_SUFFIX}")
            files = [folder / name] + ([folder / f"{key}{FINDINGS_SUFFIX}"] if findings else [])
            entries.append((facts.st_mtime, key, facts.st_size + (findings.st_size if findings else 0), files))
    except OSError:
        return []  # another process pruning or writing beside: its prune will do
    total = sum(size for _, _, size, _ in entries)
    removed = []
    try:
        for _, key, size, files in sorted(entries):
            if total <= limit:
                break
            if key == keep:
                continue
            for path in files:
                path.unlink(missing_ok=True)
            total -= size
            removed.append(key)
    except OSError:
        pass  # a folder that will not let go costs space, never the plan
    return removed


def _key_of(name: str) -> str:
    """The key a cache file is named by (<key>.json, <key>.findings.json)."""
    return name.removesuffix(FINDINGS_SUFFIX).removesuffix(".json")


def store_findings(key: str, findings: dict[str, Any]) -> Path | None:
    """Keep what planning found about the profile of `key` (ModelProfile.findings) beside it, for
    the next plan that reuses it; the profile's own file is not written again."""
    return _write(f"{key}{FINDINGS_SUFFIX}", compact_json(findings))


def _write(name: str, text: str) -> Path | None:
    """Write a cache entry whole or not at all (None: not kept)."""
    folder = cache_folder()
    if folder is None:
        return None
    temporary: str | None = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
        with os.fdopen(handle, "w") as out:
            out.write(text)
        os.replace(temporary, folder / name)
    except OSError:
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
        return None
    return folder / name

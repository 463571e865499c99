"""Writing into an output folder without ever losing what autopar did not write there.

A folder autopar writes (`compile --out-dir`, `report --out-dir`, `plan --report`) gets a
manifest, ``autopar_manifest.json``, listing every file autopar put there and its sha256. A
later write into the same folder:

- replaces a file only if the manifest lists it with the hash it still has (autopar's own,
  unmodified), or its content would not change; anything else that would be replaced (a file
  the user wrote or edited) is refused without ``--force``, and the message lists it;
- refuses a non-empty folder without a manifest (not an autopar output) without ``--force``;
- keeps every other file (``checkpoints/``, ``run.jsonl``, the user's notes) untouched; a
  compile removes only files an earlier compile listed in the manifest, still unmodified, that
  it no longer produces (a module generated for a model file of another name);
- is all or nothing: files are built in a staging folder on the same file system and moved in
  one by one with ``os.replace`` only once all of them are written.

The checks run twice: before any work (`check_out_dir`, so a refusal costs no planning time)
and again just before the files are moved in (`install`), since the folder may change meanwhile.

One compile into a folder at a time (`writing_lock`): two would each pass the checks and the one
that finished last would silently win. The lock is an flock on the folder itself (no file is
added to it; the OS releases it when the compile ends, however it ends).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping

from autopar.errors import UserError

MANIFEST_NAME = "autopar_manifest.json"
_STAGING_PREFIX = ".autopar-staging."
# Folders of an output whose files autopar writes and lists as "<folder>/<name>" (Hydra's record
# of the settings), so an edit there is kept like any other and nothing is written through a link.
SUBFOLDERS = (".hydra",)


class OutputDirError(UserError):
    """The output folder cannot be written safely (it holds files autopar did not write, or is
    not a writable folder)."""


@dataclass(frozen=True)
class Manifest:
    """What autopar wrote into a folder: file name -> sha256 of the content it wrote."""

    files: dict[str, str]

    @classmethod
    def read(cls, folder: Path) -> Manifest | None:
        """The folder's manifest, or None when it has none (or an unreadable one: then nothing in
        the folder is known to be autopar's, which is the safe reading)."""
        try:
            data = json.loads((folder / MANIFEST_NAME).read_text())
            files = data["files"]
            # Only plain names: a manifest naming '../x' must not make autopar touch files elsewhere.
            if isinstance(files, dict) and all(isinstance(k, str) and isinstance(v, str) and _plain_name(k)
                                               for k, v in files.items()):
                return cls(files=dict(files))
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return None

    def to_json(self) -> str:
        return json.dumps({"written_by": "autopar", "files": dict(sorted(self.files.items()))}, indent=1) + "\n"


def _plain_name(name: str) -> bool:
    """A file name of the folder itself, or ``<subfolder>/<name>`` of one of `SUBFOLDERS`."""
    folder, _, rest = name.rpartition("/")
    if folder and folder not in SUBFOLDERS:
        return False
    return bool(rest) and rest not in (".", "..", MANIFEST_NAME) and "\\" not in rest


def _subfolders(names: Iterable[str]) -> list[str]:
    return sorted({name.rpartition("/")[0] for name in names} - {""})


def _refuse_linked_subfolders(out_dir: Path, names: Iterable[str]) -> None:
    """A subfolder autopar writes into must be a real folder: never followed through a link, not
    even with --force (which replaces files, never writes through them)."""
    for folder in _subfolders(names):
        refuse_link(out_dir / folder)
        if (out_dir / folder).exists() and not (out_dir / folder).is_dir():
            raise OutputDirError(f"{out_dir / folder} is a file; autopar writes its own folder of that name there.",
                                 f"move {out_dir / folder} away and run again.")


def staged_files(staging: Path) -> list[str]:
    """The files of a staging folder by manifest name (those of `SUBFOLDERS` as ``folder/name``)."""
    names = [path.name for path in sorted(staging.iterdir()) if path.is_file()]
    for folder in SUBFOLDERS:
        if (staging / folder).is_dir():
            names += [f"{folder}/{path.name}" for path in sorted((staging / folder).iterdir()) if path.is_file()]
    return names


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_out_dir(out_dir: Path, names: Iterable[str], *, force: bool, flag: str = "--out-dir",
                  whole_folder: bool = True, can_force: bool = True) -> None:
    """Refuse, before any work, a folder autopar could not write ``names`` into safely.

    Args:
        out_dir: the folder to write.
        names: the file names the write will produce (known in advance; contents are not).
        force: replace files autopar did not write (``--force``); other files are still kept.
        flag: the option that named the folder, for the message.
        whole_folder: the folder is autopar's output as a whole (compile): a non-empty folder
            without a manifest is refused. Otherwise (a report written beside other files) only
            the files that would be replaced are checked.
        can_force: the verb has ``--force`` (the message offers it).
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputDirError(f"{flag} {out_dir} is an existing file, not a folder.",
                             f"pass a new or existing folder to {flag} (autopar never replaces a file by a folder).")
    _check_writable(out_dir, flag)
    names = list(names)
    _refuse_linked_subfolders(out_dir, names)
    if out_dir.is_dir() and not force:
        conflicts = _conflicts(out_dir, {name: None for name in names}, whole_folder)
        _refuse(out_dir, conflicts, flag, can_force, whole_folder)


def install(staging: Path, out_dir: Path, *, force: bool, flag: str = "--out-dir", whole_folder: bool = True,
            can_force: bool = True) -> dict[str, Path]:
    """Move every file of ``staging`` into ``out_dir`` (created if missing) and update its manifest.

    Refuses (writing nothing) when a file would replace one autopar did not write, unless
    ``force`` (``whole_folder``, ``can_force``: as in `check_out_dir`). Returns name -> installed path."""
    new = {name: sha256_of(staging / name) for name in staged_files(staging)}
    out_dir.mkdir(parents=True, exist_ok=True)
    _refuse_linked_subfolders(out_dir, new)
    if not force:
        _refuse(out_dir, _conflicts(out_dir, new, whole_folder), flag, can_force, whole_folder)
    previous = Manifest.read(out_dir)
    for folder in _subfolders(new):
        (out_dir / folder).mkdir(exist_ok=True)
    for name in new:
        os.replace(staging / name, out_dir / name)  # replaces a link there, never writes through it
    files = dict(new)
    for name, sha in (previous.files if previous is not None else {}).items():
        path = out_dir / name
        if name in new or path.parent.is_symlink() or not (path.exists() or path.is_symlink()):
            continue
        # A whole output (compile) drops an earlier compile's file it no longer produces, only
        # while it is still exactly what autopar wrote; a partial write (a report into a compiled
        # folder) keeps the rest of the folder as it is.
        if whole_folder and path.is_file() and not path.is_symlink() and sha256_of(path) == sha:
            path.unlink()
        else:
            files[name] = sha
    _write_manifest(out_dir, Manifest(files=files))
    return {name: out_dir / name for name in new}


@contextlib.contextmanager
def staging_dir(out_dir: Path) -> Iterator[Path]:
    """A private folder on the same file system as ``out_dir`` (inside it when it exists, so even
    ``.`` works; beside it otherwise), removed afterwards whatever happens."""
    out_dir = Path(out_dir)
    parent = out_dir if out_dir.is_dir() else out_dir.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=parent, prefix=_STAGING_PREFIX))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def writing_lock(out_dir: Path, verb: str = "compile") -> Iterator[Path]:
    """Hold ``out_dir`` for one ``verb`` (created when missing, and removed again with the folders
    made for it when it is left empty), or refuse at once when another process holds it."""
    out_dir = Path(out_dir)
    created = [folder for folder in (out_dir, *out_dir.absolute().parents) if not folder.exists()]
    out_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputDirError(f"{out_dir} is being written by another `autopar {verb}`; two at once would each "
                                 "pass the checks and the one that finished last would silently replace the other's "
                                 "files.", f"wait for it to end, or {verb} into another folder.") from None
        yield out_dir
    finally:
        os.close(fd)
        for folder in created:  # deepest first, only while empty: a failed compile leaves no folder
            try:
                folder.rmdir()
            except OSError:
                break


def _conflicts(out_dir: Path, new: Mapping[str, str | None], whole_folder: bool = True) -> list[str]:
    """Files of ``out_dir`` a write of ``new`` (name -> sha256, None when not known yet) would
    lose: everything when the folder is non-empty and not autopar's, else the replaced files
    autopar did not write or that were edited since."""
    if not out_dir.is_dir():
        return []
    manifest = Manifest.read(out_dir)
    present = sorted(p.name for p in out_dir.iterdir() if not p.name.startswith(_STAGING_PREFIX))
    if manifest is None and whole_folder:
        return present
    known = manifest.files if manifest is not None else {}
    lost = []
    for name in new:
        path = out_dir / name
        if not (path.exists() or path.is_symlink()):
            continue
        if path.is_symlink() or not path.is_file():
            lost.append(name)
            continue
        current = sha256_of(path)
        if current != known.get(name) and current != new[name]:
            lost.append(name)
    return lost


def _refuse(out_dir: Path, lost: list[str], flag: str, can_force: bool, whole_folder: bool) -> None:
    if not lost:
        return
    shown = ", ".join(lost[:8]) + (f" and {len(lost) - 8} more" if len(lost) > 8 else "")
    if whole_folder and Manifest.read(out_dir) is None:
        problem = (f"{out_dir} is not empty and was not written by autopar (it has no {MANIFEST_NAME}); it holds "
                   f"{shown}.")
    else:
        problem = f"Writing {out_dir} would replace files autopar did not write or that were edited since: {shown}."
    force = ", or pass --force to replace them (other files in the folder are always kept)" if can_force else ""
    raise OutputDirError(problem, f"choose a new folder for {flag} or move those files away{force}.")


def _check_writable(out_dir: Path, flag: str) -> None:
    """Refuse a folder (or the folder that would hold it) this process cannot write into."""
    probe = out_dir.resolve()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise OutputDirError(f"{flag} {out_dir} lies under {probe}, which is a file, not a folder.",
                             f"pass a folder path to {flag}.")
    # Permission bits do not tell (root passes them on a read-only mount): a file is created.
    try:
        fd, name = tempfile.mkstemp(dir=probe, prefix=".autopar-probe.")
        os.close(fd)
        os.unlink(name)
    except OSError as err:
        raise OutputDirError(f"{flag} {out_dir}: nothing can be written into {probe} "
                             f"({os.strerror(err.errno) if err.errno else err}; read-only or not yours).",
                             f"pass a path you can write to {flag}.") from None


def _write_manifest(out_dir: Path, manifest: Manifest) -> None:
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{MANIFEST_NAME}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(manifest.to_json())
        os.replace(tmp, out_dir / MANIFEST_NAME)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_out_file(path: Path, flag: str = "--out") -> None:
    """Refuse, before any work, an output file path that cannot be written: a folder, a path
    under a file, or a read-only place (so an hour of planning is not lost at the last step)."""
    path = Path(path)
    if path.is_dir():
        raise OutputDirError(f"{flag} {path} is a folder, not a file.",
                             f"pass a file path to {flag} (e.g. {path / 'out.json'}).")
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputDirError(f"{flag} {path} exists and is not writable (read-only or not yours).",
                             f"pass a path you can write to {flag}.")
    _check_writable(path.parent if str(path.parent) else Path("."), flag)


def write_atomically(path: Path, text: str) -> None:
    """Write via a temporary file in the same folder, so a crash leaves no half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def open_no_follow(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` of a regular file that never follows a symbolic link at ``path``: a folder
    received from someone else could point one of autopar's files (the run lock, run.jsonl) at
    any file of the user's, which writing would truncate or overwrite. Refuses a link or anything
    but a regular file with a UserError naming it."""
    path = Path(path)
    refuse_link(path)
    if path.exists() and not path.is_file():
        _refuse_not_regular(path)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode)
    except OSError as err:
        if err.errno == errno.ELOOP:  # made a link between the check and the open
            refuse_link(path)
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        _refuse_not_regular(path)
    return fd


def _refuse_not_regular(path: Path) -> None:
    raise OutputDirError(f"{path} is not a regular file (a folder, a device or a pipe); autopar keeps its own file "
                         "under this name.", f"move {path} away and run again.")


def refuse_link(path: Path) -> None:
    """Refuse to write ``path`` (or into it) when it is a symbolic link (see `open_no_follow`)."""
    path = Path(path)
    if path.is_symlink():
        raise OutputDirError(f"{path} is a symbolic link (to {os.readlink(path)}); autopar never writes through a "
                             "link, since a folder received from someone else could point it at any file of yours.",
                             f"remove the link ({path}) and run again (copy its target there first if you meant "
                             "to keep writing into it).")

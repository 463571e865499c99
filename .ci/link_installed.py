"""Install requirements into another venv by hard-linking the files this interpreter's venv holds.

The wheel check needs a fresh venv with torch and what the wheel declares, and pip would
download and unpack the same wheels the developer's venv already unpacked (~1 GB for torch: a
minute and more of CI's two cores). When this venv's distributions satisfy the requirements,
their files (and those of what they require, recursively; no extras) are linked into the
target's site-packages with their dist-info, so pip in the target sees them installed and an
undeclared dependency is still missing there; the scripts outside site-packages are left out.
Prints "linked" or "missing" (the caller then installs with pip).

Usage: python .ci/link_installed.py TARGET_SITE_PACKAGES REQUIREMENT... [--requirements-of WHEEL]
"""
from __future__ import annotations

import email.parser
import importlib.metadata as metadata
import os
import shutil
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement


def closure(requirements: list[Requirement]) -> list[metadata.Distribution] | None:
    """The installed distributions satisfying ``requirements`` and what they require (extras off),
    or None when one is missing or the wrong version."""
    found: dict[str, metadata.Distribution] = {}
    pending = list(requirements)
    while pending:
        wanted = pending.pop()
        if wanted.marker is not None and not wanted.marker.evaluate({"extra": ""}):
            continue
        key = canonical(wanted.name)
        if key in found:
            continue
        try:
            distribution = metadata.distribution(wanted.name)
        except metadata.PackageNotFoundError:
            return None
        if not wanted.specifier.contains(distribution.version, prereleases=True):
            return None
        found[key] = distribution
        pending += [Requirement(text) for text in distribution.requires or []]
    return list(found.values())


def installed_in(target: Path) -> set[str]:
    """Normalised names of the distributions a site-packages holds (a new venv's pip, setuptools)."""
    return {canonical(path.name.split("-")[0]) for path in target.glob("*.dist-info")}


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def link(distribution: metadata.Distribution, target: Path) -> None:
    """Hard-link (or copy, across file systems) the distribution's files under site-packages."""
    for record in distribution.files or []:
        if record.parts[0] == ".." or record.name.endswith(".pyc"):
            continue
        source = Path(distribution.locate_file(record))
        if not source.is_file():
            continue
        destination = target / record
        destination.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, destination)
        except OSError:
            shutil.copy2(source, destination)


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """The wheel's own Requires-Dist (read from its METADATA)."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        message = email.parser.BytesParser().parsebytes(archive.read(name))
    return [Requirement(text) for text in message.get_all("Requires-Dist") or []]


def main(argv: list[str]) -> None:
    target, rest = Path(argv[0]), argv[1:]
    requirements = []
    while rest:
        if rest[0] == "--requirements-of":
            requirements += wheel_requirements(Path(rest[1]))
            rest = rest[2:]
        else:
            requirements.append(Requirement(rest.pop(0)))
    distributions = closure(requirements)
    if distributions is None:
        print("missing")
        return
    present = installed_in(target)
    for distribution in distributions:
        if canonical(distribution.metadata["Name"]) not in present:  # the venv's own copy stays
            link(distribution, target)
    print("linked")


if __name__ == "__main__":
    main(sys.argv[1:])

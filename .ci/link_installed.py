"""Install a requirement into another venv by hard-linking the files this interpreter's venv holds.

The wheel check needs a fresh venv with torch alone, and pip would download and unpack the same
~1 GB wheel the developer's venv already unpacked (a minute and a half of CI's two cores). When
this venv's distribution satisfies the requirement, its files (and those of what it requires,
recursively) are linked into the target's site-packages with their dist-info, so pip in the
target sees them installed; the scripts outside site-packages are left out. Prints "linked" or
"missing" (the caller then installs with pip).

Usage: python .ci/link_installed.py TARGET_SITE_PACKAGES REQUIREMENT
"""
from __future__ import annotations

import importlib.metadata as metadata
import os
import shutil
import sys
from pathlib import Path

from packaging.requirements import Requirement


def closure(requirement: Requirement) -> list[metadata.Distribution] | None:
    """The installed distributions satisfying ``requirement`` and what they require (extras off),
    or None when one is missing or the wrong version."""
    found: dict[str, metadata.Distribution] = {}
    pending = [requirement]
    while pending:
        wanted = pending.pop()
        if wanted.marker is not None and not wanted.marker.evaluate({"extra": ""}):
            continue
        key = wanted.name.lower().replace("_", "-")
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


def main(argv: list[str]) -> None:
    target, requirement = Path(argv[0]), Requirement(argv[1])
    distributions = closure(requirement)
    if distributions is None:
        print("missing")
        return
    for distribution in distributions:
        link(distribution, target)
    print("linked")


if __name__ == "__main__":
    main(sys.argv[1:])

"""A Python that can import only the GPU machine's image plus the wheels carried to it.

Put this folder first on ``PYTHONPATH``, name the image's package list in ``MOE_LIT_IMAGE_ALLOW``
and the carried wheels' lists in ``MOE_LIT_IMAGE_CARRY`` (``os.pathsep``-separated files of
``name`` or ``name==version`` lines: ``requirements/gpu-image.txt``, ``requirements/gpu-carry.txt``):
every Python started so (``moe-lit``, ``python -m pytest`` and their subprocesses) then raises
``ModuleNotFoundError``, naming the distribution, for a top-level import that an installed
distribution outside those lists provides. The standard library and the checkout's own packages
(no distribution, or ``moe_lit``) stay importable. An image distribution brings what its installed
version requires (not its extras): the image's own versions bring theirs, and the lock's versions
here may need others. A carried wheel brings nothing (it travels and installs with ``--no-deps``).
``MOE_LIT_IMAGE_GUARD_LOG`` names a file that gets one line per refused import (an optional import
caught by its importer leaves only that line). Unset ``MOE_LIT_IMAGE_ALLOW``: no guard.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata as metadata
import os
import re
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

from packaging.requirements import Requirement

ALLOW_ENV = "MOE_LIT_IMAGE_ALLOW"
CARRY_ENV = "MOE_LIT_IMAGE_CARRY"
LOG_ENV = "MOE_LIT_IMAGE_GUARD_LOG"
CHECKOUT_DISTRIBUTIONS = {"moe-lit"}


def normalize(name: str) -> str:
    """PEP 503's form of a distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_names(path: Path) -> set[str]:
    """The distribution names of a package list (comments and versions dropped)."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {normalize(re.split(r"[=<>!~; ]", line, maxsplit=1)[0]) for line in lines if line}


def with_requirements(names: set[str]) -> set[str]:
    """``names`` and, transitively, what their installed versions require outside any extra."""
    found, todo = set(names), list(names)
    while todo:
        try:
            requires = metadata.requires(todo.pop()) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requires:
            requirement = Requirement(text)
            name = normalize(requirement.name)
            if name not in found and (requirement.marker is None or requirement.marker.evaluate({"extra": ""})):
                found.add(name)
                todo.append(name)
    return found


class ImageGuard(importlib.abc.MetaPathFinder):
    """Refuses the top-level modules of installed distributions outside ``allowed``."""

    def __init__(self, allowed: set[str], lists: str, log: str | None) -> None:
        self.allowed = allowed
        self.lists = lists
        self.log = log
        self.providers = {
            module: {normalize(d) for d in dists} for module, dists in metadata.packages_distributions().items()
        }

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if "." in fullname or fullname in sys.stdlib_module_names:
            return None
        providers = self.providers.get(fullname, set())
        if not providers or providers & (self.allowed | CHECKOUT_DISTRIBUTIONS):
            return None
        message = (
            f"GPU image guard: {fullname!r} comes from {', '.join(sorted(providers))}, which is neither in "
            f"the GPU machine's image nor carried ({self.lists})"
        )
        if self.log:
            with open(self.log, "a") as handle:
                handle.write(message + "\n")
        raise ModuleNotFoundError(message, name=fullname)


def list_names(paths: str) -> set[str]:
    """The distribution names of the ``os.pathsep``-separated package lists ``paths``."""
    return set().union(*(read_names(Path(p)) for p in paths.split(os.pathsep) if p))


def install() -> None:
    image, carried = os.environ.get(ALLOW_ENV), os.environ.get(CARRY_ENV, "")
    if not image:
        return
    allowed = with_requirements(list_names(image)) | list_names(carried)
    described = os.pathsep.join(filter(None, (image, carried)))
    sys.meta_path.insert(0, ImageGuard(allowed, described, os.environ.get(LOG_ENV)))


install()

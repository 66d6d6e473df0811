"""Atomic file output: nothing half-written ever looks complete.

A write that the system refuses (disk full, permission denied, read-only file system) raises
:class:`~moe_lit.errors.MoeLitError` naming the target (one line, exit 2) and leaves no temporary
file or directory behind; the previous content of the target, if any, stays as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from moe_lit.errors import MoeLitError

PathLike = str | os.PathLike


def atomic_write_text(path: PathLike, text: str) -> Path:
    """Write ``text`` to a temporary file beside ``path`` and rename it into place."""
    path = Path(path)
    with _refused_writes(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return path


def atomic_write_json(path: PathLike, data: Any) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


@contextmanager
def atomic_directory(path: PathLike) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``path`` only when the block succeeds."""
    path = Path(path)
    with _refused_writes(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
        try:
            yield tmp
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _refused_writes(path: Path) -> Iterator[None]:
    """OSError while writing ``path`` -> one-line MoeLitError naming it and the system's reason."""
    try:
        yield
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise MoeLitError(f"{path}: cannot write ({reason})") from exc

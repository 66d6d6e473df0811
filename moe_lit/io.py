"""Atomic file output: nothing half-written ever looks complete.

:func:`check_output` is the one overwrite rule of every command that writes: an output that is, holds
or lies inside one of the command's inputs is always refused; an existing non-empty one only
without ``--force``.

Every output follows the user's umask, as a plain ``open`` or ``mkdir`` would: directories get
``0o777`` and files ``0o666`` less the umask (the temporaries that ``tempfile`` creates are private,
``0o700`` and ``0o600``, and would keep that mode after their rename into place).

A write that the system refuses (disk full, permission denied, read-only file system) raises
:class:`~moe_lit.errors.MoeLitError` naming the target (one line, exit 2) and leaves no temporary
file or directory behind; the previous content of the target, if any, stays as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from moe_lit.errors import MoeLitError

PathLike = str | os.PathLike


def check_output(
    out: PathLike, inputs: Mapping[str, PathLike | None] | None = None, force: bool = False, flag: str = "--out"
) -> Path:
    """Refuse ``out`` (option ``flag``) if it is, holds or lies inside an input (``{flag: path}``,
    ``None`` paths skipped), or if it exists and is not empty unless ``force``; returns ``out``."""
    out = Path(out)
    target = out.resolve()
    for input_flag, source in (inputs or {}).items():
        if source is None:
            continue
        source = Path(source).resolve()
        if target == source or target in source.parents:
            raise MoeLitError(f"{flag}: {out} is or contains the input {input_flag}; write the output elsewhere")
        if source in target.parents:
            raise MoeLitError(f"{flag}: {out} lies inside the input {input_flag}; write the output elsewhere")
    if out.exists() and (out.is_file() or any(out.iterdir())) and not force:
        raise MoeLitError(f"{flag}: {out} exists and is not empty; pass --force to replace it")
    return out


def umask() -> int:
    """The process's file mode creation mask (``/proc/self/status`` where the system has it)."""
    # NOTE: os.umask can only read the mask by setting it, and a file another thread creates in
    # between would get the wrong mode; Linux states it in /proc (kernel 4.7 and later).
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode of a new file under the umask: ``0o666`` less it."""
    return 0o666 & ~umask()


def dir_mode() -> int:
    """The mode of a new directory under the umask: ``0o777`` less it."""
    return 0o777 & ~umask()


@contextmanager
def atomic_file(path: PathLike) -> Iterator[Path]:
    """Yield a temporary file beside ``path`` (mode :func:`file_mode`) that replaces ``path`` only
    when the block succeeds; for writers that take a file name (``torch.save``, safetensors)."""
    path = Path(path)
    with _refused_writes(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        tmp = Path(name)
        try:
            tmp.chmod(file_mode())
            yield tmp
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: PathLike, data: bytes) -> Path:
    """Write ``data`` to a temporary file beside ``path`` and rename it into place."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def atomic_write_text(path: PathLike, text: str) -> Path:
    """Write ``text`` to a temporary file beside ``path`` and rename it into place."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def atomic_write_json(path: PathLike, data: Any) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


@contextmanager
def atomic_directory(path: PathLike) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``path`` only when the block succeeds; what it holds
    then gets the umask's modes (:func:`_follow_umask`)."""
    path = Path(path)
    with _refused_writes(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
        try:
            yield tmp
            _follow_umask(tmp)
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


def _follow_umask(root: Path) -> None:
    """``root`` and the folders under it :func:`dir_mode`, its files :func:`file_mode`.

    NOTE: some writers create private files whatever the umask (safetensors' ``save_file``: 0o600)."""
    folder, file = dir_mode(), file_mode()
    root.chmod(folder)
    for path in root.rglob("*"):
        if not path.is_symlink():
            path.chmod(folder if path.is_dir() else file)


@contextmanager
def _refused_writes(path: Path) -> Iterator[None]:
    """OSError while writing ``path`` -> one-line MoeLitError naming it and the system's reason."""
    try:
        yield
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise MoeLitError(f"{path}: cannot write ({reason})") from exc

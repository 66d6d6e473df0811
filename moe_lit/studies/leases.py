"""Atomic point leases: several runners over one shared results directory never run a point twice.

A point's leases live in ``<out_dir>/leases/<point_hash>/`` as numbered generations ``000000.json``,
``000001.json``...; the highest generation is the current lease and holds
``{owner, leased_at, heartbeat_at, released}``. Leasing creates the next generation exclusively
(``os.open`` with ``O_CREAT | O_EXCL``, which NFSv3+ performs on the server), so of any number of
runners on any number of nodes exactly one gets it. A free point has no generation, or its current
one was released, or is stale: its ``heartbeat_at`` is older than ``ttl_s`` because its owner died.
The owner refreshes ``heartbeat_at`` (:class:`Heartbeat`, every ttl/3) while it runs and marks the
lease released when done; it has lost the lease once a higher generation exists.

Typical use by a runner (the record, not the lease, says that a point is finished)::

    lease = try_lease(out_dir, point.hash, ttl_s=600)
    if lease is None:
        continue                      # another runner has it
    with lease:                       # heartbeat thread while running, released on exit
        if not record_path(out_dir, point).exists():   # finished while we were leasing?
            run_point(...)            # writes the record before the lease is released
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_lit.errors import MoeLitError
from moe_lit.io import atomic_write_json

LEASES_DIR = "leases"
PathLike = str | os.PathLike
_GENERATION = re.compile(r"^(\d{6,})\.json$")
# NOTE: why generations instead of renaming a stale lease file away and re-creating it: two runners
# that both read the same stale file race on a rename by *path*, so the slower one can move away the
# fresh lease the faster one has just created, and a third can create one meanwhile (two owners).
# Here every generation is created once, exclusively, and never removed or renamed, so "create
# generation g+1" has exactly one winner, and a runner acting on an old view targets a generation
# that already exists and fails. The price is one small file per lease of a point.
# NOTE: staleness is judged from heartbeat_at in the file's content, not from its mtime: NFS clients
# cache file attributes (mtime) for up to actimeo seconds, while close-to-open consistency makes a
# freshly opened file's content current; the content also survives copying the results directory.
# Both need the nodes' clocks in sync (NTP) to well within ttl_s. The mtime is used only for a file
# whose content cannot be parsed (its writer died between the exclusive create and the write).


def leases_dir(out_dir: PathLike, point_hash: str) -> Path:
    """``<out_dir>/leases/<point_hash>/``: the generations of one point's lease."""
    return Path(out_dir) / LEASES_DIR / point_hash


def new_owner() -> str:
    """``host:pid:uuid``: unique per lease, and readable when a lease is left behind."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"


@dataclass
class Lease:
    """A lease this process holds on one point; a context manager that heartbeats and releases."""

    path: Path
    """This lease's generation file, ``<out_dir>/leases/<point_hash>/<generation>.json``."""
    generation: int
    """Its generation number; the lease is lost once generation + 1 exists."""
    owner: str
    """``host:pid:uuid`` written in the file."""
    ttl_s: float
    """Seconds without a heartbeat after which other runners may take the point over."""
    _heartbeat: Heartbeat | None = field(default=None, init=False, repr=False, compare=False)

    def owned(self) -> bool:
        """Whether this lease is still the point's current, unreleased lease."""
        return self._owned_content() is not None

    def _owned_content(self) -> dict[str, Any] | None:
        if _generation_path(self.path.parent, self.generation + 1).exists():
            return None
        content = _read(self.path)
        if content is None or content["owner"] != self.owner or content.get("released"):
            return None
        return content

    def heartbeat(self) -> bool:
        """Refresh ``heartbeat_at`` (atomic rewrite) while the lease is ours; False once it was lost."""
        return self._rewrite(heartbeat_at=time.time())

    def start_heartbeat(self) -> Heartbeat:
        """Start (once) a daemon thread that heartbeats every ttl/3 until :meth:`release`."""
        if self._heartbeat is None:
            self._heartbeat = Heartbeat(self).start()
        return self._heartbeat

    def release(self) -> bool:
        """Stop the heartbeat and mark the lease released if it is still ours; False if it was lost."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        return self._rewrite(released=True, heartbeat_at=time.time())

    def _rewrite(self, **changes: Any) -> bool:
        content = self._owned_content()
        if content is None:
            return False
        # NOTE: only the owner ever writes its generation (a taker creates the next one), so this
        # rewrite cannot clobber anyone; if a taker won meanwhile, the next heartbeat says so.
        atomic_write_json(self.path, {**content, **changes})
        return True

    def __enter__(self) -> Lease:
        self.start_heartbeat()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.release()


class Heartbeat:
    """Daemon thread calling :meth:`Lease.heartbeat` every ``interval_s`` (default ttl/3).

    It ends when stopped or when the lease is lost (``lost`` becomes True). A failed write (an
    ``OSError`` such as a transient NFS error) is a missed beat, not the end of the lease.
    """

    def __init__(self, lease: Lease, interval_s: float | None = None) -> None:
        self.lease = lease
        self.interval_s = lease.ttl_s / 3 if interval_s is None else interval_s
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat {lease.path}", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                if not self.lease.heartbeat():
                    self.lost = True
                    return
            except OSError:
                continue


def try_lease(out_dir: PathLike, point_hash: str, ttl_s: float) -> Lease | None:
    """Lease ``point_hash`` for this process, or None when another live runner holds it.

    A lease whose heartbeat is older than ``ttl_s``, or that was released, is taken over; of several
    processes trying at once (on any number of nodes sharing ``out_dir``) exactly one gets it.
    """
    if not (isinstance(ttl_s, (int, float)) and not isinstance(ttl_s, bool) and ttl_s > 0):
        raise MoeLitError(f"ttl_s: the lease time-to-live must be a positive number of seconds, got {ttl_s!r}")
    directory = leases_dir(out_dir, point_hash)
    directory.mkdir(parents=True, exist_ok=True)
    current = current_generation(directory)
    if current is not None and not _is_free(_generation_path(directory, current), ttl_s):
        return None
    return _create(directory, 0 if current is None else current + 1, ttl_s)


def current_generation(directory: Path) -> int | None:
    """The highest lease generation in ``directory``; None when the point was never leased."""
    numbers = [int(m.group(1)) for m in map(_GENERATION.match, os.listdir(directory)) if m]
    return max(numbers, default=None)


def _generation_path(directory: Path, generation: int) -> Path:
    return directory / f"{generation:06d}.json"


def _create(directory: Path, generation: int, ttl_s: float) -> Lease | None:
    """Exclusive create of ``generation`` with our content; None if another runner created it."""
    path, owner, now = _generation_path(directory, generation), new_owner(), time.time()
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return None
    with os.fdopen(fd, "w") as handle:
        json.dump({"owner": owner, "leased_at": now, "heartbeat_at": now, "released": False}, handle)
    return Lease(path=path, generation=generation, owner=owner, ttl_s=float(ttl_s))


def _read(path: Path) -> dict[str, Any] | None:
    """The lease's content, or None when it is missing or cannot be parsed."""
    try:
        content = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(content, dict) or not {"owner", "heartbeat_at"} <= content.keys():
        return None
    return content


def _owner_is_dead(owner: str) -> bool:
    """A lease of this host whose process no longer exists (a runner killed with kill -9).

    NOTE: without this, rerunning a study right after its runner was killed would leave every
    point it had leased to the dead runner until the lease expires (ttl_s)."""
    host, _, rest = owner.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _is_free(path: Path, ttl_s: float) -> bool:
    """Released, stale (no heartbeat for more than ``ttl_s``, by the mtime if unparseable), or held
    by a process of this host that no longer exists."""
    content = _read(path)
    if content is not None and (content.get("released") or _owner_is_dead(str(content["owner"]))):
        return True
    try:
        beat = float(content["heartbeat_at"]) if content is not None else path.stat().st_mtime
    except FileNotFoundError:  # not yet visible to us (another client's fresh create): not free
        return False
    return time.time() - beat > ttl_s


__all__ = ["LEASES_DIR", "Lease", "Heartbeat", "leases_dir", "current_generation", "new_owner", "try_lease"]

"""A study point's identity: what it is (:class:`Point`, :class:`Start`, :class:`Call`), its hash,
and where its record lives.

A study YAML names its ``kind`` (a plug-in of :data:`moe_lit.studies.plugins.KINDS`). The kind turns
the spec into points (``expand``) and the finished records into tables, findings and plots
(``analyse``). Running a point is :mod:`moe_lit.studies.run`; scheduling the points of a study over
workers, with resume, is :mod:`moe_lit.studies.schedule`.

* a **point** is one small pipeline: start (from scratch, or from a parent point's checkpoint at
  a step: ``resume`` keeps the whole trainer state, ``init`` only the weights) -> optional
  transform -> train (:func:`~moe_lit.lit.run.train_run` with the point's callbacks and,
  optionally, its own LightningModule, e.g. a distillation module whose frozen teacher is the
  parent's checkpoint) -> optional measurement. Transform, callbacks, module and measurement are
  :class:`Call` s of registered plug-ins (:mod:`moe_lit.studies.plugins`);
* its hash covers everything that determines it (model, run config, seed, start incl. the parent's
  hash, and each plug-in's registered name, declared version and arguments: never an import path,
  so code moves without orphaning a record); fields left at their defaults are not hashed, so a
  config that gains a field with a default keeps every point's identity;
* ``results/<study>/runs/<hash>.json`` is a finished point's record (ok | failed).

Layout of ``results/<study>/``: ``study.json`` (the plan), ``runs/<hash>.json`` (records, small,
committed with the results), ``runs/<hash>/`` (checkpoints and logs, git-ignored), ``runs.csv``,
``summary.md`` and ``plots/`` (:mod:`moe_lit.studies.report`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_lit.accounting import count_config_params, forward_flops_per_token
from moe_lit.config import ConfigError, ModelConfig
from moe_lit.lit.run_config import RunConfig
from moe_lit.registry import Entry

RUNS_DIR = "runs"
STUDY_FILE = "study.json"
STATUS_OK, STATUS_FAILED, STATUS_PENDING = "ok", "failed", "pending"
START_MODES = ("resume", "init")
TRANSFORMED_START = "start"
"""Folder of a point's run directory holding its transformed start weights (an exported model)."""


def stable_dict(value: Any) -> Any:
    """JSON-ready form of configs for hashing: dataclass fields equal to their default are left
    out (recursively), so adding a field with a default changes no hash."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = dataclasses.MISSING
            if default is dataclasses.MISSING or stable_dict(item) != stable_dict(default):
                out[f.name] = stable_dict(item)
        return out
    if isinstance(value, dict):
        return {str(k): stable_dict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [stable_dict(v) for v in value]
    return value


def digest(payload: Any) -> str:
    """12 hex digits of the SHA-256 of ``payload``'s canonical JSON."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Call:
    """A registered plug-in (:mod:`moe_lit.studies.plugins`: a transform, a measurement, a callback,
    a module factory) by its registered name, with JSON-able keyword arguments. Named, not pickled,
    so records and hashes stay data; the hash covers the name and the plug-in's declared version."""

    name: str
    """The plug-in's registered name."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments (JSON-able)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"call.name: expected a registered plug-in name, got {self.name!r}")

    @classmethod
    def of(cls, fn: Callable[..., Any], **kwargs: Any) -> Call:
        """The call of the plug-in ``fn`` by the name it is registered under, so that no name is
        written by hand."""
        from moe_lit.studies.plugins import name_of

        return cls(name_of(fn), kwargs)

    def entry(self) -> Entry[Callable[..., Any]]:
        """The registered plug-in (an unknown name is a one-line error listing the registered ones)."""
        from moe_lit.studies.plugins import plugin

        return plugin(self.name)

    def resolve(self) -> Callable[..., Any]:
        """The registered function or class."""
        return self.entry().obj

    def __call__(self, *args: Any, **extra: Any) -> Any:
        return self.resolve()(*args, **self.kwargs, **extra)

    def to_dict(self) -> dict[str, Any]:
        """What a point's hash covers: the registered name, the declared version, the arguments."""
        return {"name": self.name, "version": self.entry().version, "kwargs": stable_dict(self.kwargs)}


@dataclass(frozen=True)
class Start:
    """Where a point's weights come from when not from scratch: a parent point's checkpoint, or an
    existing checkpoint / exported model directory (``path``, e.g. an imported HF model)."""

    parent: str | None = None
    """Name of the parent point (same study); null with ``path``."""
    step: int | None = None
    """The parent's checkpoint after this many optimizer steps (null: its final weights)."""
    mode: str = "resume"
    """resume: continue the parent's run (weights, optimizer, schedule, data position, step) up to
    this point's budget | init: a new run (fresh optimizer and schedule) from the parent's weights."""

    path: str | None = None
    """A ``.ckpt`` file or exported model directory (relative to the working directory) instead of a
    parent; hashed with the size and content of its files, so a changed model is a new point."""

    def __post_init__(self) -> None:
        if self.mode not in START_MODES:
            raise ConfigError(f"start.mode: got {self.mode!r}, allowed values: {', '.join(START_MODES)}")
        if (self.parent is None) == (self.path is None):
            raise ConfigError("start: give exactly one of parent (a point of the study) and path (a model on disk)")


def path_fingerprint(path: str | os.PathLike) -> list[list[Any]]:
    """``[relative file, size, sha256]`` of a file or of every file under a directory (sorted)."""
    # NOTE: by content, not mtime: re-creating the same model (a new checkout running
    # `make smollm2`) must keep the points' hashes, so finished records are found again.
    root = Path(path)
    if not root.exists():
        raise ConfigError(f"start.path: {root} does not exist")
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return [[str(f.relative_to(root)) if f != root else f.name, f.stat().st_size, _sha256(f)] for f in files]


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@dataclass(frozen=True)
class Point:
    """One pipeline of a study: start -> transform -> train -> measure."""

    name: str
    """Readable label, unique within the study (``.../s<seed>`` when the study has several seeds)."""
    config_name: str
    """The name without the seed: equal for the seeds of one configuration."""
    seed: int
    """Seed of the run (also written into ``run.train.seed``)."""
    model: ModelConfig
    """The model trained from scratch (with ``start``: the parent's, for the accounting)."""
    run: RunConfig
    """The run's settings (data, optim, budget, cadence, Trainer arguments)."""
    info: dict[str, Any] = field(default_factory=dict)
    """The kind's axes of this point (copied into its record; not part of its identity)."""
    start: Start | None = None
    """Fork from a parent point's checkpoint instead of starting from scratch."""
    transform: Call | None = None
    """A pure ``model -> model`` function applied to the start weights (needs ``start.mode: init``)."""
    callbacks: tuple[Call, ...] = ()
    """Lightning callbacks of the run; one with a ``study_record() -> dict`` method adds its dict to the record."""
    measure: Call | None = None
    """``fn(point, result, run_dir) -> dict`` run after training; its dict joins the record."""
    module: Call | None = None
    """``fn(model_cfg, optim, parent=Path | None) -> MoELitModule``: the run's LightningModule
    (train_run's ``module_factory``); ``parent`` is the checkpoint of the parent point the run
    starts from (e.g. a distillation teacher), None without a start. Null: the plain LM module."""
    hash: str = ""
    """Filled by :func:`finalize`."""

    def identity(self, parent_hash: str | None, files: list[list[Any]] | None = None) -> dict[str, Any]:
        """What the hash is made of; ``files`` is the :func:`path_fingerprint` of ``start.path``."""
        return {
            "module": self.module.to_dict() if self.module else None,
            "model": stable_dict(self.model),
            "run": stable_dict(self.run),
            "seed": self.seed,
            "start": None if self.start is None else self._start_identity(parent_hash, files),
            "transform": self.transform.to_dict() if self.transform else None,
            "callbacks": [c.to_dict() for c in self.callbacks],
            "measure": self.measure.to_dict() if self.measure else None,
        }

    def _start_identity(self, parent_hash: str | None, files: list[list[Any]] | None) -> dict[str, Any]:
        if self.start.path is not None:
            return {**stable_dict(self.start), "files": files}
        return {**stable_dict(self.start), "parent": parent_hash}


def finalize(points: Sequence[Point]) -> list[Point]:
    """Validate the parent links and give every point its hash (parents before children)."""
    by_name: dict[str, Point] = {}
    for point in points:
        if point.name in by_name:
            raise ConfigError(f"study: two points are named {point.name!r}")
        by_name[point.name] = point
    hashes: dict[str, str] = {}
    fingerprints: dict[str, list[list[Any]]] = {}  # start.path -> its files, read once per study

    def files_of(point: Point) -> list[list[Any]] | None:
        if point.start is None or point.start.path is None:
            return None
        path = str(point.start.path)
        if path not in fingerprints:
            fingerprints[path] = path_fingerprint(path)
        return fingerprints[path]

    def hash_of(point: Point, seen: tuple[str, ...] = ()) -> str:
        if point.name in hashes:
            return hashes[point.name]
        parent_hash = None
        if point.start is not None and point.transform is not None and point.start.mode != "init":
            raise ConfigError(f"{point.name}.transform: needs start.mode init (a resumed run keeps its model)")
        if point.start is not None and point.start.parent is not None:
            parent = by_name.get(point.start.parent)
            if parent is None:
                raise ConfigError(f"{point.name}.start.parent: no point named {point.start.parent!r} in the study")
            if parent.name in seen:
                raise ConfigError(f"{point.name}.start.parent: the parent links form a cycle")
            parent_hash = hash_of(parent, (*seen, point.name))
        hashes[point.name] = digest(point.identity(parent_hash, files_of(point)))
        return hashes[point.name]

    return [dataclasses.replace(p, hash=hash_of(p)) for p in points]


def fork_steps(points: Sequence[Point]) -> dict[str, set[int]]:
    """Parent name -> the steps at which children fork (checkpoints the parent must keep)."""
    steps: dict[str, set[int]] = {}
    for point in points:
        if point.start is not None and point.start.parent is not None and point.start.step is not None:
            steps.setdefault(point.start.parent, set()).add(point.start.step)
    return steps


def record_path(out_dir: Path, point: Point) -> Path:
    return Path(out_dir) / RUNS_DIR / f"{point.hash}.json"


def run_dir(out_dir: Path, point: Point) -> Path:
    return Path(out_dir) / RUNS_DIR / point.hash


def fork_checkpoint(out_dir: Path, parent: Point, step: int | None) -> Path:
    """Where a parent keeps the checkpoint a child starts from."""
    from moe_lit.lit.run import CHECKPOINT_DIR, LAST_CHECKPOINT

    name = LAST_CHECKPOINT if step is None else f"fork-step={step}.ckpt"
    return run_dir(out_dir, parent) / CHECKPOINT_DIR / name


def read_record(path: Path) -> dict[str, Any] | None:
    """A finished point's record, or None when there is none (or it is unreadable)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def point_status(out_dir: Path, point: Point) -> str:
    record = read_record(record_path(out_dir, point))
    return record["status"] if record else STATUS_PENDING


def is_done(out_dir: Path, point: Point, retry_failed: bool = False) -> bool:
    """Whether a runner leaves ``point`` alone: it has a record, ok or (unless ``retry_failed``) failed."""
    return point_status(out_dir, point) in ({STATUS_OK} if retry_failed else {STATUS_OK, STATUS_FAILED})


def point_record(point: Point) -> dict[str, Any]:
    """What is known of a point before it runs: identity, axes, analytic params and FLOPs."""
    counts = count_config_params(point.model)
    moe = point.model.moe
    return {
        "name": point.name,
        "config_name": point.config_name,
        "hash": point.hash,
        "seed": point.seed,
        "parent": point.start.parent if point.start else None,
        **point.info,
        "num_experts": moe.num_experts if moe else 1,
        "top_k": moe.top_k if moe else 1,
        "expert_size": moe.total_expert_size / moe.num_experts if moe else float(point.model.d_ff),
        "total_params": counts.total,
        "active_params": counts.active,
        "total_non_embedding": counts.total_non_embedding,
        "active_non_embedding": counts.active_non_embedding,
        "flops_per_token": forward_flops_per_token(point.model),
        "model": point.model.to_dict(),
    }


__all__ = [
    "RUNS_DIR",
    "STUDY_FILE",
    "TRANSFORMED_START",
    "Call",
    "Point",
    "Start",
    "digest",
    "finalize",
    "fork_checkpoint",
    "fork_steps",
    "is_done",
    "path_fingerprint",
    "point_record",
    "point_status",
    "read_record",
    "record_path",
    "run_dir",
    "stable_dict",
]

"""The one study engine: points, parent links, hashes, resume, workers, failure records.

A study YAML names its ``kind`` (a plug-in in :mod:`moe_lit.studies.kinds`). The kind turns the
spec into :class:`Point` s (``expand``) and the finished records into tables, findings and plots
(``analyse``); this module owns everything else:

* a **point** is one small pipeline: start (from scratch, or from a parent point's checkpoint at
  a step: ``resume`` keeps the whole trainer state, ``init`` only the weights) -> optional
  transform (a pure function of :mod:`moe_lit.convert`) -> train (:func:`~moe_lit.lit.run.train_run`
  with the point's callbacks and, optionally, its own LightningModule, e.g. a distillation module
  whose frozen teacher is the parent's checkpoint) -> optional measurement. Its hash covers
  everything that determines it (model, run config, seed, start incl. the parent's hash,
  transform, module, callbacks, measurement);
  fields left at their defaults are not hashed, so a config that gains a field with a default
  keeps every point's identity;
* a parent is trained once and keeps a checkpoint at every step a child forks from, so a child
  (an upcycled arm forking from the fixed-E run at tau) never retrains the shared prefix;
* ``results/<study>/runs/<hash>.json`` is a finished point's record (ok | failed), written
  atomically: a study killed at any moment resumes where it stopped; a failure is data, not a
  crash; points are leased atomically (:mod:`moe_lit.studies.leases`) so several runners over
  one results directory never run a point twice.

Layout of ``results/<study>/``: ``study.json`` (the plan), ``runs/<hash>.json`` (records, small,
committed with the results), ``runs/<hash>/`` (checkpoints and logs, git-ignored), ``runs.csv``,
``summary.md`` and ``plots/`` (:mod:`moe_lit.studies.report`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import hashlib
import importlib
import json
import multiprocessing
import os
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from moe_lit.accounting import count_config_params, forward_flops_per_token
from moe_lit.config import ConfigError, ModelConfig
from moe_lit.errors import MoeLitError
from moe_lit.io import atomic_write_json
from moe_lit.lit.run_config import RunConfig

RUNS_DIR = "runs"
STUDY_FILE = "study.json"
STATUS_OK, STATUS_FAILED, STATUS_PENDING = "ok", "failed", "pending"
LEASE_TTL_S = 600.0
"""Seconds without a heartbeat after which a point's lease counts as abandoned (its runner died)."""
START_MODES = ("resume", "init")
TRANSFORMED_START = "start"
"""Folder of a point's run directory holding its transformed start weights (an exported model)."""
Log = Callable[[str], None]
TrainFn = Callable[..., Any]
# NOTE: a worker stopped by Ctrl-C, SIGTERM or SIGUSR1 is an interrupted study, not a failed point:
# it leaves no record but its checkpoint, from which the point continues on resume (a SIGKILL, e.g.
# the OOM killer, is a failure). Its status is 128 + signal (moe_lit.callbacks.preemption), or minus
# the signal when the signal itself ended it.
INTERRUPTED_EXIT_CODES = tuple(
    code for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1) for code in (128 + signum, -signum)
)


# ----------------------------------------------------------------------------- identity
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
    """A module-level function or class named by import path, with JSON-able keyword arguments:
    a transform, a callback, a measurement. Named, not pickled, so records and hashes stay data."""

    path: str
    """``package.module:attribute``."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments (JSON-able)."""

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or self.path.count(":") != 1:
            raise ConfigError(f"call.path: expected 'package.module:attribute', got {self.path!r}")

    @classmethod
    def of(cls, fn: Callable[..., Any], **kwargs: Any) -> Call:
        """The call of a module-level function or class by its import path (``module:name``, the
        string the point's hash covers), so that no path is written by hand."""
        if "<" in fn.__qualname__ or "." in fn.__qualname__:
            raise ConfigError(f"call: {fn.__qualname__} is not a module-level function or class")
        return cls(f"{fn.__module__}:{fn.__qualname__}", kwargs)

    def resolve(self) -> Callable[..., Any]:
        module, attribute = self.path.split(":")
        return getattr(importlib.import_module(module), attribute)

    def __call__(self, *args: Any, **extra: Any) -> Any:
        return self.resolve()(*args, **self.kwargs, **extra)

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "kwargs": stable_dict(self.kwargs)}


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
    parent; hashed with the size and mtime of its files, so a changed model is a new point."""

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
        # NOTE: the module joins the identity only when set, so points without one keep their hashes.
        module = {"module": self.module.to_dict()} if self.module else {}
        return {
            **module,
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


# ----------------------------------------------------------------------------- records
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


def _result_fields(result: Any) -> dict[str, Any]:
    """The training result (a dataclass such as ``RunResult``, or a mapping) as a JSON-ready dict."""
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        data = dataclasses.asdict(result)
    elif isinstance(result, dict):
        data = dict(result)
    else:
        raise MoeLitError(f"train_fn returned {type(result).__name__}; expected a RunResult dataclass or a dict")
    return json.loads(json.dumps(data, default=str))


# ----------------------------------------------------------------------------- one point
def default_train_fn() -> TrainFn:
    """:func:`moe_lit.lit.run.train_run`, imported only when a real run starts."""
    from moe_lit.lit.run import train_run

    return train_run


def _start_arguments(point: Point, parents: dict[str, Point], out_dir: Path) -> dict[str, Any]:
    if point.start is None:
        return {}
    if point.start.path is not None:
        checkpoint = Path(point.start.path)
        if not checkpoint.exists():
            raise MoeLitError(f"{point.name}: start.path {checkpoint} does not exist")
        return _from_weights(point, checkpoint, out_dir)
    parent = parents[point.start.parent]
    checkpoint = fork_checkpoint(out_dir, parent, point.start.step)
    if not checkpoint.is_file():
        raise MoeLitError(
            f"{point.name}: the parent's checkpoint {checkpoint} is missing; delete {record_path(out_dir, parent)} "
            "to train the parent again"
        )
    return _from_weights(point, checkpoint, out_dir)


def _from_weights(point: Point, checkpoint: Path, out_dir: Path) -> dict[str, Any]:
    if point.start.mode == "resume":
        return {"resume_from": checkpoint}
    if point.transform is None:
        return {"init_from": checkpoint}
    from moe_lit.checkpoint import export_model, load_model

    transformed = run_dir(out_dir, point) / TRANSFORMED_START
    export_model(point.transform(load_model(checkpoint)), transformed)
    return {"init_from": transformed}


def _module_arguments(point: Point, parents: dict[str, Point], out_dir: Path) -> dict[str, Any]:
    """train_run's ``module_factory`` of a point with its own module (none: train_run's default)."""
    if point.module is None:
        return {}
    parent = None
    if point.start is not None and point.start.parent is not None:
        parent = fork_checkpoint(out_dir, parents[point.start.parent], point.start.step)
    elif point.start is not None:
        parent = Path(point.start.path)  # a model on disk is the teacher
    return {"module_factory": functools.partial(point.module, parent=parent)}


def _callbacks(point: Point, save_at: Sequence[int], out_dir: Path) -> list[Any]:
    from moe_lit.callbacks.preemption import Preemption, command_line
    from moe_lit.callbacks.study import SaveAtSteps

    callbacks = [call() for call in point.callbacks]
    if save_at:
        callbacks.append(SaveAtSteps({s: fork_checkpoint(out_dir, point, s) for s in sorted(save_at)}))
    # NOTE: the study's command (a spawned worker has its runner's argv) continues the point.
    callbacks.append(Preemption(resume=command_line(), label=f"study point {point.name}"))
    return callbacks


def measure_only(point: Point) -> bool:
    """A 0-step point started from a path with a measurement runs only the measurement."""
    # NOTE: a model on disk (e.g. an imported HF model) has its own tokenizer, so validating it on
    # the study's data could even be refused (another vocabulary); its measurement evaluates it.
    return point.start is not None and point.start.path is not None and point.run.steps == 0 and bool(point.measure)


def run_point(
    point: Point,
    out_dir: Path,
    parents: dict[str, Point],
    save_at: Sequence[int] = (),
    train_fn: TrainFn | None = None,
) -> dict[str, Any]:
    """Run one point and write its record atomically; a failure is recorded, never raised.

    ``KeyboardInterrupt`` (and other non-``Exception`` exits, such as the ``Interrupted`` of a
    signal) propagate and leave no record, so the point runs again on resume: from its
    :func:`interrupted_checkpoint` when it has one.
    """
    workdir = run_dir(out_dir, point)
    interrupted = interrupted_checkpoint(out_dir, point)
    if workdir.exists() and interrupted is None:
        shutil.rmtree(workdir)  # leftovers of a failed attempt: start the point afresh
    workdir.mkdir(parents=True, exist_ok=True)
    record = point_record(point)
    start = time.perf_counter()
    try:
        callbacks = _callbacks(point, save_at, out_dir)
        start_arguments = {"resume_from": interrupted} if interrupted else _start_arguments(point, parents, out_dir)
        if measure_only(point):
            result = {"steps": 0, "checkpoint": str(start_arguments["init_from"])}
        else:
            train = train_fn or default_train_fn()
            result = train(
                point.model,
                point.run,
                workdir,
                callbacks=callbacks,
                **start_arguments,
                **_module_arguments(point, parents, out_dir),
            )
        record.update(status=STATUS_OK, error=None, **_result_fields(result))
        for callback in callbacks:
            if hasattr(callback, "study_record"):
                record.update(callback.study_record())
        if point.measure is not None:
            record.update(point.measure(point, result, workdir))
    except Exception as exc:  # noqa: BLE001 - any failure of one point is data, not a crash of the study
        record.update(
            status=STATUS_FAILED,
            error=f"{type(exc).__name__}: {exc}".splitlines()[0][:500],
            traceback=traceback.format_exc(limit=8),
        )
    record["study_wall_s"] = round(time.perf_counter() - start, 3)
    atomic_write_json(record_path(out_dir, point), record)
    return record


def interrupted_checkpoint(out_dir: Path, point: Point) -> Path | None:
    """The ``last.ckpt`` of a point that stopped without a record (a signal, a killed runner): its
    run continues from there. None when there is none or the point has a record (a failed point is
    retried from its start)."""
    from moe_lit.lit.run import CHECKPOINT_DIR, LAST_CHECKPOINT

    checkpoint = run_dir(out_dir, point) / CHECKPOINT_DIR / LAST_CHECKPOINT
    return checkpoint if checkpoint.is_file() and read_record(record_path(out_dir, point)) is None else None


def run_leased(
    point: Point,
    out_dir: Path,
    parents: dict[str, Point],
    save_at: Sequence[int] = (),
    train_fn: TrainFn | None = None,
    ttl_s: float = LEASE_TTL_S,
) -> dict[str, Any] | None:
    """:func:`run_point` under an exclusive lease (:mod:`moe_lit.studies.leases`); None when another
    runner holds the point or finished it meanwhile. The lease is taken in the process that trains,
    so a dead submitter leaves no point leased and a point submitted twice costs an empty job."""
    from moe_lit.studies.leases import try_lease

    if point_status(out_dir, point) == STATUS_OK:
        return None
    lease = try_lease(out_dir, point.hash, ttl_s)
    if lease is None:
        return None
    with lease:
        if point_status(out_dir, point) == STATUS_OK:
            return None
        return run_point(point, out_dir, parents, save_at, train_fn)


def run_leased_item(item: tuple) -> dict[str, Any] | None:
    """:func:`run_leased` on one packed item: the job function the submitit executors run."""
    return run_leased(*item)


def _worker(point, out_dir, parents, save_at, train_fn, threads) -> None:
    """Body of one spawned process: its own log file and thread count, then :func:`run_leased`."""
    log_file = run_dir(out_dir, point).with_suffix(".log")
    log_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    # NOTE: dup2 on the descriptors (not just sys.stdout) also captures output of C extensions and
    # of Lightning's progress bar, which would otherwise interleave between parallel workers.
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import torch

    torch.set_num_threads(threads)
    try:
        run_leased(point, out_dir, parents, save_at, train_fn)
    except KeyboardInterrupt:
        sys.exit(INTERRUPTED_EXIT_CODES[0])


def _crash_record(point: Point, error: str, out_dir: Path) -> dict[str, Any]:
    record = point_record(point)
    log = run_dir(out_dir, point).with_suffix(".log")
    record.update(status=STATUS_FAILED, error=f"{error} (see {log})")
    atomic_write_json(record_path(out_dir, point), record)
    return record


def _parent_failed_record(point: Point, out_dir: Path) -> dict[str, Any]:
    record = point_record(point)
    record.update(status=STATUS_FAILED, error=f"parent point {point.start.parent!r} failed")
    atomic_write_json(record_path(out_dir, point), record)
    return record


# ----------------------------------------------------------------------------- scheduling
class _Schedule:
    """Which points may run now: pending ones whose parent finished ok, in plan order."""

    def __init__(self, points: Sequence[Point], todo: Sequence[Point], out_dir: Path) -> None:
        self.by_name = {p.name: p for p in points}
        self.todo = list(todo)
        self.out_dir = out_dir
        self.running: set[str] = set()

    def parent_status(self, point: Point) -> str:
        if point.start is None or point.start.parent is None:
            return STATUS_OK
        parent = self.by_name[point.start.parent]
        if parent.name in self.running or any(p.name == parent.name for p in self.todo):
            return STATUS_PENDING
        return point_status(self.out_dir, parent)

    def take_ready(self, on_blocked: Callable[[Point], None]) -> Point | None:
        for point in list(self.todo):
            status = self.parent_status(point)
            if status == STATUS_FAILED:
                self.todo.remove(point)
                on_blocked(point)
            elif status == STATUS_OK:
                self.todo.remove(point)
                self.running.add(point.name)
                return point
        return None


def run_points(
    points: Sequence[Point],
    out_dir: Path,
    *,
    parallel: int = 1,
    retry_failed: bool = False,
    train_fn: TrainFn | None = None,
    executor: Any | None = None,
    log: Log = print,
    label: str = "study",
    only: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Run every unfinished point (parents first); returns the records of all finished points.

    Points run in this process (``parallel == 1``), in ``parallel`` spawned worker processes, or
    as submitit jobs (``executor``: an :class:`~moe_lit.studies.executors.ExecutorConfig` of kind
    slurm | submitit_local; a job array per wave of points whose parents are done). Each point is
    leased where it trains; one leased by another runner is left to it. ``train_fn`` defaults to
    ``train_run`` and must be a module-level function beyond one process. Failed points are
    skipped like finished ones unless ``retry_failed``. ``only``: shell patterns (``fnmatch``); just
    the points whose names match one run (a slice of a long study; a child waits for its parent).
    """
    if not isinstance(parallel, int) or isinstance(parallel, bool) or parallel < 1:
        raise MoeLitError(f"--parallel: must be an integer >= 1, got {parallel!r}")
    out_dir = Path(out_dir)
    parents = {p.name: p for p in points}
    save_at = fork_steps(points)
    skip = {STATUS_OK} if retry_failed else {STATUS_OK, STATUS_FAILED}
    unfinished = [p for p in points if point_status(out_dir, p) not in skip]
    todo = [p for p in unfinished if _selected(p, only)]
    left = f" ({len(unfinished) - len(todo)} others not selected)" if only else ""
    finished = len(points) - len(unfinished)
    log(f"{label}: {len(points)} points, {finished} finished, {len(todo)} to run{left} -> {out_dir}")
    schedule = _Schedule(points, todo, out_dir)
    done, elsewhere = 0, []

    def on_done(point: Point, record: dict[str, Any] | None) -> None:
        nonlocal done
        schedule.running.discard(point.name)
        if record is None:
            elsewhere.append(point.name)
            log(f"{point.name} ({point.hash}) is leased by another runner: left to it")
            return
        done += 1
        outcome = (
            f"val_loss {record.get('val_loss', float('nan')):.4f}"
            if record["status"] == STATUS_OK
            else f"FAILED: {record['error']}"
        )
        log(f"[{done}/{len(todo)}] {point.name} ({point.hash}) {outcome} in {record.get('study_wall_s', 0):.0f}s")

    def blocked(point: Point) -> None:
        on_done(point, _parent_failed_record(point, out_dir))

    def args(point: Point) -> tuple:
        return point, out_dir, parents, sorted(save_at.get(point.name, ())), train_fn

    if executor is not None and executor.kind != "local":
        _run_submitit(schedule, executor, out_dir, args, on_done, blocked, label)
    elif parallel == 1:
        while (point := schedule.take_ready(blocked)) is not None:
            log(f"running {point.name} ({point.hash})")
            on_done(point, run_leased(*args(point)))
    else:
        _run_parallel(schedule, out_dir, args, train_fn or default_train_fn(), parallel, on_done, blocked)
    records = [r for r in (read_record(record_path(out_dir, p)) for p in points) if r is not None]
    failed = sum(r["status"] == STATUS_FAILED for r in records)
    waiting = len(points) - len(records)
    log(
        f"{label}: {len(records)}/{len(points)} points finished, {failed} failed, {waiting} not finished"
        + (f" ({len(elsewhere)} leased by other runners: run again once they are done)" if elsewhere else "")
    )
    return records


def _selected(point: Point, only: Sequence[str]) -> bool:
    return not only or any(fnmatch.fnmatchcase(point.name, pattern) for pattern in only)


def _run_submitit(schedule, executor, out_dir: Path, args, on_done, blocked, label: str) -> None:
    """Waves of submitit jobs: every point whose parent is done, one job each, then the next wave."""
    from moe_lit.studies.executors import submit_points, wait_all

    folder = executor.resolve_folder(out_dir)
    while True:
        wave = []
        while (point := schedule.take_ready(blocked)) is not None:
            wave.append(point)
        if not wave:
            return
        jobs = submit_points(executor, run_leased_item, [args(p) for p in wave], folder, name=label.split()[-1])

        def finished(outcome, wave=wave) -> None:
            point = wave[outcome.index]
            record = outcome.result if outcome.ok else _crash_record(point, outcome.error, out_dir)
            on_done(point, record)

        wait_all(jobs, on_done=finished)


def _run_parallel(schedule, out_dir, args, train_fn, parallel, on_done, blocked) -> None:
    """At most ``parallel`` spawned processes, one per point (a crash takes down one point only)."""
    ctx = multiprocessing.get_context("spawn")
    threads = max(1, (os.cpu_count() or 1) // parallel)
    running: dict[Any, tuple[Any, Point]] = {}
    try:
        while True:
            while len(running) < parallel and (point := schedule.take_ready(blocked)) is not None:
                proc = ctx.Process(target=_worker, args=(*args(point)[:4], train_fn, threads))
                proc.start()
                running[proc.sentinel] = (proc, point)
            if not running:
                return
            for sentinel in wait(list(running)):
                proc, point = running.pop(sentinel)
                proc.join()
                if proc.exitcode in INTERRUPTED_EXIT_CODES:
                    raise KeyboardInterrupt(f"worker of {point.name} was interrupted")
                if proc.exitcode == 0:  # no record: the point was leased by another runner
                    on_done(point, read_record(record_path(out_dir, point)))
                else:
                    on_done(point, _crash_record(point, f"worker process died with exit code {proc.exitcode}", out_dir))
    finally:
        for proc, _ in running.values():
            proc.terminate()
            proc.join()


__all__ = [
    "Call",
    "Point",
    "Start",
    "digest",
    "finalize",
    "measure_only",
    "path_fingerprint",
    "point_record",
    "point_status",
    "read_record",
    "run_leased",
    "run_point",
    "run_points",
    "stable_dict",
]

"""Running one study point (:mod:`moe_lit.studies.identity`) and writing its record.

A point runs in its own directory ``runs/<hash>/``: from its start (a parent's fork checkpoint,
a model on disk, or scratch), through its transform, training with its callbacks and module, to its
measurement; its record ``runs/<hash>.json`` is written atomically, ok or failed (a failure is
data, not a crash). A point is leased atomically (:mod:`moe_lit.studies.leases`) where it trains,
so several runners over one results directory never run it twice; one stopped by a signal leaves
no record and continues from its last checkpoint on resume.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from moe_lit.errors import MoeLitError
from moe_lit.io import atomic_write_json
from moe_lit.studies.identity import (
    STATUS_FAILED,
    STATUS_OK,
    TRANSFORMED_START,
    Point,
    fork_checkpoint,
    is_done,
    point_record,
    read_record,
    record_path,
    run_dir,
)

LEASE_TTL_S = 600.0
"""Seconds without a heartbeat after which a point's lease counts as abandoned (its runner died)."""
TrainFn = Callable[..., Any]


def _result_fields(result: Any) -> dict[str, Any]:
    """The training result (a dataclass such as ``RunResult``, or a mapping) as a JSON-ready dict."""
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        data = dataclasses.asdict(result)
    elif isinstance(result, dict):
        data = dict(result)
    else:
        raise MoeLitError(f"train_fn returned {type(result).__name__}; expected a RunResult dataclass or a dict")
    return json.loads(json.dumps(data, default=str))


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
    if point.start.mode == "resume" and point.start.step is None and not _resumable(checkpoint):
        raise MoeLitError(
            f"{point.name}: start.mode resume, but the parent's checkpoint {checkpoint} keeps its weights only "
            f"(compacted when the parent finished); delete {record_path(out_dir, parent)} to train the parent again"
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

    ``parents``: the study's points by name (a parent among them; whether one resumes from this
    point decides what :func:`compact_finished` keeps). ``KeyboardInterrupt`` (and other
    non-``Exception`` exits, such as the ``Interrupted`` of a signal) propagate and leave no record,
    so the point runs again on resume: from its :func:`interrupted_checkpoint` when it has one.
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
    if record["status"] == STATUS_OK:
        compact_finished(out_dir, point, parents.values())
    return record


def compact_finished(out_dir: Path, point: Point, points: Iterable[Point]) -> None:
    """Free the disk a finished point no longer needs: its transformed start weights, and the
    optimizer state in its ``last.ckpt`` unless one of ``points`` resumes training from there. The
    weights stay, for the children started from them and for eval or export."""
    workdir = run_dir(out_dir, point)
    shutil.rmtree(workdir / TRANSFORMED_START, ignore_errors=True)
    resumed = any(
        p.start is not None and p.start.parent == point.name and p.start.step is None and p.start.mode == "resume"
        for p in points
    )
    checkpoint = fork_checkpoint(out_dir, point, None)
    if resumed or not checkpoint.is_file():
        return
    from moe_lit.checkpoint import drop_training_state

    try:
        drop_training_state(checkpoint)
    except MoeLitError:
        pass  # NOTE: a file it cannot read stays as it is: compaction only frees disk


def _resumable(checkpoint: Path) -> bool:
    """False for a readable checkpoint without optimizer state (compacted); an unreadable one is left
    to the resume, which says what is wrong with it."""
    from moe_lit.checkpoint import has_training_state

    try:
        return has_training_state(checkpoint)
    except MoeLitError:
        return True


def interrupted_checkpoint(out_dir: Path, point: Point) -> Path | None:
    """The ``last.ckpt`` of a point that stopped without a record (a signal, a killed runner): its
    run continues from there. None when there is none, when the point has a record (a failed point
    is retried from its start) or when it keeps weights only (:func:`compact_finished`)."""
    from moe_lit.lit.run import CHECKPOINT_DIR, LAST_CHECKPOINT

    checkpoint = run_dir(out_dir, point) / CHECKPOINT_DIR / LAST_CHECKPOINT
    if not checkpoint.is_file() or read_record(record_path(out_dir, point)) is not None:
        return None
    # NOTE: a finished point's compacted checkpoint (its record deleted to run it again) cannot resume.
    return checkpoint if _resumable(checkpoint) else None


def run_leased(
    point: Point,
    out_dir: Path,
    parents: dict[str, Point],
    save_at: Sequence[int] = (),
    train_fn: TrainFn | None = None,
    retry_failed: bool = False,
    ttl_s: float = LEASE_TTL_S,
) -> dict[str, Any] | None:
    """:func:`run_point` under an exclusive lease (:mod:`moe_lit.studies.leases`); None when another
    runner holds the point or finished it meanwhile (failed too, unless ``retry_failed``: another
    runner's failure is a record, not a retry). The lease is taken in the process that trains, so a
    dead submitter leaves no point leased and a point submitted twice costs an empty job."""
    from moe_lit.studies.leases import try_lease

    if is_done(out_dir, point, retry_failed):
        return None
    lease = try_lease(out_dir, point.hash, ttl_s)
    if lease is None:
        return None
    with lease:
        if is_done(out_dir, point, retry_failed):
            return None
        return run_point(point, out_dir, parents, save_at, train_fn)


def run_leased_item(item: tuple) -> dict[str, Any] | None:
    """:func:`run_leased` on one packed item: the job function the submitit executors run."""
    return run_leased(*item)


__all__ = [
    "LEASE_TTL_S",
    "TrainFn",
    "compact_finished",
    "default_train_fn",
    "interrupted_checkpoint",
    "measure_only",
    "run_leased",
    "run_point",
]

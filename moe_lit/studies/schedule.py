"""Scheduling the points of a study: parents first, in this process, in spawned worker processes
or as submitit jobs; a study killed at any moment resumes where it stopped (finished points are
skipped; an interrupted one continues from its checkpoint, :mod:`moe_lit.studies.run`).
"""

from __future__ import annotations

import fnmatch
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from moe_lit.errors import MoeLitError
from moe_lit.io import atomic_write_json
from moe_lit.studies.identity import (
    STATUS_FAILED,
    STATUS_OK,
    STATUS_PENDING,
    Point,
    fork_steps,
    is_done,
    point_record,
    point_status,
    read_record,
    record_path,
    run_dir,
)
from moe_lit.studies.run import TrainFn, default_train_fn, run_leased, run_leased_item

Log = Callable[[str], None]
# NOTE: a worker stopped by Ctrl-C, SIGTERM or SIGUSR1 is an interrupted study, not a failed point:
# it leaves no record but its checkpoint, from which the point continues on resume (a SIGKILL, e.g.
# the OOM killer, is a failure). Its status is 128 + signal (moe_lit.callbacks.preemption), or minus
# the signal when the signal itself ended it.
INTERRUPTED_EXIT_CODES = tuple(
    code for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1) for code in (128 + signum, -signum)
)


def _worker(point, out_dir, parents, save_at, train_fn, retry_failed, threads) -> None:
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
        run_leased(point, out_dir, parents, save_at, train_fn, retry_failed)
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
    unfinished = [p for p in points if not is_done(out_dir, p, retry_failed)]
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
        return point, out_dir, parents, sorted(save_at.get(point.name, ())), train_fn, retry_failed

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
                packed = args(point)
                proc = ctx.Process(target=_worker, args=(*packed[:4], train_fn, *packed[5:], threads))
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


__all__ = ["INTERRUPTED_EXIT_CODES", "Log", "run_points"]

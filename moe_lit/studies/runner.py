"""Run a study: every point once, N at a time, skipping finished ones; record results and failures.

Layout of ``results/<study>/``::

    study.json            the spec and the expanded points (what `study report` reads back)
    runs/<hash>.json      one record per finished point (status ok | failed), written atomically
    runs/<hash>/          the point's training output (checkpoint, metrics.csv, worker log)
    runs.csv, summary.md, plots/*.png   written by :mod:`moe_lit.studies.report`

A point is finished when its record exists, so a sweep killed at any moment resumes where it
stopped: a point that was running has no record yet and runs again from scratch. A point whose
training raises is recorded with ``status: failed`` and its error, and the sweep goes on.

The training function is injected (``train_fn``, default :func:`moe_lit.lit.runner.train_run`),
so tests run the whole machinery with a fake.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import shutil
import signal
import sys
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from moe_lit.accounting import count_config_params, forward_flops_per_token
from moe_lit.errors import MoeLitError
from moe_lit.io import atomic_write_json
from moe_lit.studies.spec import StudyPoint, StudySpec, TrainingSpec, expand

TrainFn = Callable[..., Any]
Log = Callable[[str], None]
RUNS_DIR = "runs"
STUDY_FILE = "study.json"
STATUS_OK, STATUS_FAILED = "ok", "failed"
# NOTE: a worker stopped by Ctrl-C or SIGTERM is an interrupted sweep, not a failed point: it leaves
# no record, so the point runs again on resume (a SIGKILL, e.g. the OOM killer, is a failure).
INTERRUPTED_EXIT_CODES = (130, -signal.SIGINT, -signal.SIGTERM)


def default_train_fn() -> TrainFn:
    """:func:`moe_lit.lit.runner.train_run`, imported only when a real run starts."""
    from moe_lit.lit.runner import train_run

    return train_run


def record_path(out_dir: Path, point: StudyPoint) -> Path:
    return Path(out_dir) / RUNS_DIR / f"{point.hash}.json"


def run_dir(out_dir: Path, point: StudyPoint) -> Path:
    return Path(out_dir) / RUNS_DIR / point.hash


def read_record(path: Path) -> Optional[dict[str, Any]]:
    """A finished point's record, or None when there is none (or it is unreadable)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def point_record(point: StudyPoint) -> dict[str, Any]:
    """What is known of a point before it trains: its axes and analytic params / FLOPs."""
    counts = count_config_params(point.model)
    moe = point.model.moe
    return {
        "name": point.name,
        "config_name": point.config_name,
        "hash": point.hash,
        "budget": point.budget,
        "seed": point.seed,
        "groups": dict(point.groups),
        "match": point.match,
        "num_experts": point.num_experts,
        "top_k": point.top_k,
        "expert_size": point.expert_size,
        "shared_expert_size": moe.shared_expert_size if moe else 0,
        "heterogeneous": bool(moe and not moe.uniform),
        "balancing": moe.balancing if moe else "",
        "capacity_factor": moe.capacity_factor if moe else None,
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


def run_point(
    point: StudyPoint,
    training: TrainingSpec,
    data_dir: Optional[str],
    out_dir: Path,
    train_fn: TrainFn,
    trainer_overrides: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Train one point and write its record atomically; a failure is recorded, never raised.

    ``KeyboardInterrupt`` (and other non-``Exception`` exits) propagate and leave no record, so the
    point runs again on resume.
    """
    workdir = run_dir(out_dir, point)
    if workdir.exists():
        shutil.rmtree(workdir)  # leftovers of an interrupted attempt: start the point afresh
    workdir.mkdir(parents=True)
    record = point_record(point)
    start = time.perf_counter()
    try:
        result = train_fn(
            model_cfg=point.model,
            data_dir=data_dir,
            out_dir=workdir,
            max_tokens=training.max_tokens,
            seq_len=training.seq_len,
            batch_size=training.batch_size,
            optim=training.optim,
            seed=point.seed,
            val_batches=training.val_batches,
            eval_every=training.eval_every,
            trainer_overrides={**training.trainer, **(trainer_overrides or {})},
        )
        record.update(status=STATUS_OK, error=None, **_result_fields(result))
    except Exception as exc:  # noqa: BLE001 - any failure of one point is data, not a crash of the sweep
        record.update(
            status=STATUS_FAILED,
            error=f"{type(exc).__name__}: {exc}".splitlines()[0][:500],
            traceback=traceback.format_exc(limit=8),
        )
    record["study_wall_s"] = round(time.perf_counter() - start, 3)
    atomic_write_json(record_path(out_dir, point), record)
    return record


def _worker(point, training, data_dir, out_dir, train_fn, threads, trainer_overrides) -> None:
    """Body of one spawned process: its own log file and thread count, then :func:`run_point`."""
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
        run_point(point, training, data_dir, out_dir, train_fn, trainer_overrides)
    except KeyboardInterrupt:
        sys.exit(INTERRUPTED_EXIT_CODES[0])


def _crash_record(point: StudyPoint, exitcode: Optional[int], out_dir: Path) -> dict[str, Any]:
    record = point_record(point)
    log = run_dir(out_dir, point).with_suffix(".log")
    record.update(status=STATUS_FAILED, error=f"worker process died with exit code {exitcode} (see {log})")
    atomic_write_json(record_path(out_dir, point), record)
    return record


def _run_parallel(
    points: Sequence[StudyPoint],
    spec: StudySpec,
    data_dir,
    out_dir: Path,
    train_fn: TrainFn,
    parallel: int,
    on_done: Callable[[StudyPoint, dict[str, Any]], None],
) -> None:
    """At most ``parallel`` spawned processes, one per point (a crash takes down one point only)."""
    ctx = multiprocessing.get_context("spawn")
    threads = max(1, (os.cpu_count() or 1) // parallel)
    overrides = {"enable_progress_bar": False}
    queue, running = list(points), {}
    try:
        while queue or running:
            while queue and len(running) < parallel:
                point = queue.pop(0)
                proc = ctx.Process(
                    target=_worker, args=(point, spec.training, data_dir, out_dir, train_fn, threads, overrides)
                )
                proc.start()
                running[proc.sentinel] = (proc, point)
            for sentinel in wait(list(running)):
                proc, point = running.pop(sentinel)
                proc.join()
                if proc.exitcode in INTERRUPTED_EXIT_CODES:
                    raise KeyboardInterrupt(f"worker of {point.name} was interrupted")
                record = read_record(record_path(out_dir, point)) if proc.exitcode == 0 else None
                on_done(point, record or _crash_record(point, proc.exitcode, out_dir))
    finally:
        for proc, _ in running.values():
            proc.terminate()
            proc.join()


def resolve_data_dir(spec: StudySpec, data_dir: Optional[str]) -> str:
    """--data, else the study's data_dir, else the data pipeline's default directory."""
    if data_dir or spec.data_dir:
        return str(data_dir or spec.data_dir)
    from moe_lit.data.layout import default_data_dir

    return str(default_data_dir())


def ensure_data(spec: StudySpec, data_dir: str) -> None:
    """Prepare ``data_dir`` when the study says how (reused if already prepared the same way), then
    check that the data exists and its tokenizer matches ``base.vocab_size``."""
    from moe_lit.data.layout import read_meta

    if spec.data is not None:
        from moe_lit.data.prepare import prepare

        prepare(spec.prepare_config(data_dir))
    vocab = read_meta(data_dir).get("vocab_size")
    if vocab != spec.base.vocab_size:
        raise MoeLitError(
            f"base.vocab_size: the study says {spec.base.vocab_size} but data_dir {data_dir!r} has a "
            f"tokenizer of {vocab}; prepare matching data (moe-lit data prepare --vocab-size "
            f"{spec.base.vocab_size} --out DIR) or change base.vocab_size"
        )


def point_status(out_dir: Path, point: StudyPoint) -> str:
    """ok | failed | pending."""
    record = read_record(record_path(out_dir, point))
    return record["status"] if record else "pending"


def write_plan(spec: StudySpec, points: Sequence[StudyPoint], out_dir: Path, command: str = "") -> None:
    """``study.json``: the command, the validated spec and the expanded points, for reports."""
    plan = {
        "name": spec.name,
        "description": spec.description,
        "command": command,
        "spec": dataclasses.asdict(spec),
        "points": [point_record(p) for p in points],
    }
    atomic_write_json(Path(out_dir) / STUDY_FILE, plan)


def run_study(
    spec: StudySpec,
    out_dir: Path,
    *,
    data_dir: Optional[str] = None,
    parallel: int = 1,
    retry_failed: bool = False,
    train_fn: Optional[TrainFn] = None,
    prepare_data: bool = True,
    command: str = "",
    log: Log = print,
) -> list[dict[str, Any]]:
    """Run every unfinished point of ``spec``; returns the records of all finished points.

    ``train_fn`` defaults to ``train_run``; with ``parallel > 1`` it must be picklable (a
    module-level function). Failed points are skipped like finished ones unless ``retry_failed``.
    ``prepare_data=False`` skips preparing / checking the data directory (fake ``train_fn``).
    ``command`` (the command line that ran the study) is kept in study.json for the reports.
    """
    if not isinstance(parallel, int) or parallel < 1:
        raise MoeLitError(f"--parallel: must be an integer >= 1, got {parallel!r}")
    out_dir = Path(out_dir)
    data = resolve_data_dir(spec, data_dir)
    if prepare_data:
        ensure_data(spec, data)
    train_fn = train_fn or default_train_fn()
    points = expand(spec)
    write_plan(spec, points, out_dir, command)
    skip = {STATUS_OK, STATUS_FAILED} if not retry_failed else {STATUS_OK}
    todo = [p for p in points if point_status(out_dir, p) not in skip]
    log(f"study {spec.name}: {len(points)} points, {len(points) - len(todo)} finished, {len(todo)} to run -> {out_dir}")
    done = 0

    def on_done(point: StudyPoint, record: dict[str, Any]) -> None:
        nonlocal done
        done += 1
        outcome = (
            f"val_loss {record.get('val_loss', float('nan')):.4f}"
            if record["status"] == STATUS_OK
            else f"FAILED: {record['error']}"
        )
        log(f"[{done}/{len(todo)}] {point.name} ({point.hash}) {outcome} in {record.get('study_wall_s', 0):.0f}s")

    if parallel == 1:
        for point in todo:
            log(f"running {point.name} ({point.hash})")
            on_done(point, run_point(point, spec.training, data, out_dir, train_fn))
    else:
        _run_parallel(todo, spec, data, out_dir, train_fn, parallel, on_done)
    records = [r for r in (read_record(record_path(out_dir, p)) for p in points) if r is not None]
    failed = sum(r["status"] == STATUS_FAILED for r in records)
    log(f"study {spec.name}: {len(records)}/{len(points)} points finished, {failed} failed")
    return records


__all__ = ["point_record", "point_status", "run_point", "run_study", "STUDY_FILE", "RUNS_DIR"]

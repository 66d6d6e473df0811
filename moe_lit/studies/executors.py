"""Running point jobs beyond this machine: submitit's SLURM (job arrays) and local executors.

:class:`ExecutorConfig` is the ``executor:`` section of a study file. ``kind: local`` keeps the
study runner's own worker processes; ``slurm`` submits one job per point as a SLURM job array
(``sbatch --array``), ``submitit_local`` runs the very same submitit path as processes on this
machine (tests, debugging a SLURM setup without a cluster). :func:`submit_points` submits a
picklable module-level function over the items; :func:`wait_all` collects one :class:`JobOutcome`
per item, a raising or killed job being a failed outcome rather than a crash of the study.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import submitit

from moe_lit.configbase import ConfigError, require, require_choice, require_positive_int
from moe_lit.errors import MoeLitError

ExecutorKind = Literal["local", "slurm", "submitit_local"]
EXECUTOR_KINDS = ("local", "slurm", "submitit_local")
SUBMITIT_CLUSTERS = {"slurm": "slurm", "submitit_local": "local"}
PathLike = str | Path


@dataclass
class ExecutorConfig:
    """Where a study's points run: this machine's worker processes, or submitit jobs."""

    kind: ExecutorKind = "local"
    """local: the runner's worker processes | slurm: one SLURM job per point (a job array) through
    submitit | submitit_local: submitit's local executor (the slurm code path on this machine)."""
    parallel: int = 1
    """Worker processes at once for kind=local."""
    folder: str | None = None
    """submitit's folder for job pickles and logs (on the shared filesystem for slurm); null =
    <out_dir>/submitit."""
    partition: str | None = None
    """SLURM partition; null = the cluster's default."""
    gpus_per_node: int = 0
    """GPUs per job. With submitit_local, 0 hides the GPUs from the jobs (CUDA_VISIBLE_DEVICES='')
    and n > 0 gives every job GPUs 0..n-1 (jobs share them: it does not schedule GPUs)."""
    cpus_per_task: int | None = None
    """CPU cores per job; null = the cluster's default."""
    mem_gb: float | None = None
    """Memory per job in GB; null = the cluster's default."""
    timeout_min: int = 240
    """Wall-clock limit of one job in minutes (a job past it is killed and reported failed)."""
    array_parallelism: int = 256
    """Jobs of the array SLURM runs at once (sbatch --array=0-N%this)."""
    account: str | None = None
    """SLURM account to charge; null = the user's default."""
    qos: str | None = None
    """SLURM quality of service; null = the default."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before each job (e.g. 'module load cuda', 'source .venv/bin/activate')."""
    additional: dict[str, Any] = field(default_factory=dict)
    """Extra sbatch options without the leading dashes, e.g. {constraint: a100, mail-type: END}."""

    def __post_init__(self) -> None:
        require_choice(self.kind, "executor.kind", EXECUTOR_KINDS)
        for name in ("parallel", "timeout_min", "array_parallelism"):
            require_positive_int(getattr(self, name), f"executor.{name}")
        require(
            isinstance(self.gpus_per_node, int)
            and not isinstance(self.gpus_per_node, bool)
            and self.gpus_per_node >= 0,
            "executor.gpus_per_node",
            f"must be an integer >= 0, got {self.gpus_per_node!r}",
        )
        if self.cpus_per_task is not None:
            require_positive_int(self.cpus_per_task, "executor.cpus_per_task")
        require(
            self.mem_gb is None
            or (isinstance(self.mem_gb, (int, float)) and not isinstance(self.mem_gb, bool) and self.mem_gb > 0),
            "executor.mem_gb",
            f"must be a positive number of GB or null, got {self.mem_gb!r}",
        )
        for name in ("folder", "partition", "account", "qos"):
            value = getattr(self, name)
            require(
                value is None or (isinstance(value, str) and value),
                f"executor.{name}",
                f"must be a non-empty string or null, got {value!r}",
            )
        require(
            isinstance(self.setup, list) and all(isinstance(line, str) for line in self.setup),
            "executor.setup",
            f"must be a list of shell lines, got {self.setup!r}",
        )
        require(
            isinstance(self.additional, dict) and all(isinstance(k, str) and k for k in self.additional),
            "executor.additional",
            f"must be a mapping of sbatch option names to values, got {self.additional!r}",
        )

    def resolve_folder(self, out_dir: PathLike) -> Path:
        """``folder``, else ``<out_dir>/submitit``."""
        return Path(self.folder) if self.folder else Path(out_dir) / "submitit"

    def submitit_parameters(self) -> dict[str, Any]:
        """Keyword arguments of ``submitit.AutoExecutor.update_parameters`` (nulls left out)."""
        params: dict[str, Any] = {
            "timeout_min": self.timeout_min,
            "gpus_per_node": self.gpus_per_node,
            "cpus_per_task": self.cpus_per_task,
            "mem_gb": self.mem_gb,
            "slurm_partition": self.partition,
            "slurm_account": self.account,
            "slurm_qos": self.qos,
            "slurm_array_parallelism": self.array_parallelism,
            "slurm_additional_parameters": dict(self.additional) or None,
            "slurm_setup": list(self.setup) or None,
            "local_setup": list(self.setup) or None,
        }
        return {k: v for k, v in params.items() if v is not None}


@dataclass(frozen=True)
class JobOutcome:
    """What one submitted item gave: its result, or why it failed."""

    index: int
    """Position of the item in the submitted sequence."""
    job_id: str
    """submitit's job id (SLURM: ``<array id>_<task>``; local: the process id)."""
    ok: bool
    """True when the function returned."""
    result: dict[str, Any] | None
    """The function's return value when ok."""
    error: str | None
    """One line when failed: the exception raised, or how the job died (killed, timed out)."""
    traceback: str | None = None
    """The job's traceback when the function raised."""
    log: str | None = None
    """The job's stderr log file."""


def make_executor(cfg: ExecutorConfig, folder: PathLike, name: str = "moe_lit") -> submitit.AutoExecutor:
    """A submitit AutoExecutor for ``cfg`` (kind slurm or submitit_local) writing into ``folder``."""
    if cfg.kind not in SUBMITIT_CLUSTERS:
        raise ConfigError(
            f"executor.kind: {cfg.kind!r} runs points in the runner's own processes, not through submitit"
        )
    try:
        executor = submitit.AutoExecutor(folder=str(folder), cluster=SUBMITIT_CLUSTERS[cfg.kind])
    except RuntimeError as exc:  # slurm requested where there is no srun
        raise MoeLitError(f"executor.kind: slurm: {exc}") from exc
    executor.update_parameters(name=name, **cfg.submitit_parameters())
    return executor


def _guarded_call(fn: Callable[[Any], dict[str, Any]], item: Any) -> tuple[str, Any, str | None]:
    """Body of each job: ``("ok", result, None)``, or ``("failed", one-line error, traceback)``."""
    try:
        return "ok", fn(item), None
    except Exception as exc:  # noqa: BLE001 - one item's failure is data, not a crash of the study
        return "failed", f"{type(exc).__name__}: {exc}".splitlines()[0][:500], traceback.format_exc(limit=8)


def submit_points(
    cfg: ExecutorConfig,
    fn: Callable[[Any], dict[str, Any]],
    items: Sequence[Any],
    folder: PathLike,
    name: str = "moe_lit",
) -> list[submitit.Job]:
    """Submit ``fn(item)`` for every item, one job each (one SLURM job array); returns the jobs in
    item order. ``fn`` and the items must be picklable: ``fn`` a module-level function."""
    if not items:
        return []
    executor = make_executor(cfg, folder, name)
    return executor.map_array(_guarded_call, [fn] * len(items), list(items))


def _outcome(index: int, job: submitit.Job) -> JobOutcome:
    log = str(job.paths.stderr)
    failure = job.exception()  # the job itself died: killed, timed out, or could not start
    if failure is not None:
        error = f"job {job.job_id} ended without a result (state {job.state}, {type(failure).__name__}); see {log}"
        return JobOutcome(index, job.job_id, False, None, error, log=log)
    status, value, trace = job.result()
    if status == "ok":
        return JobOutcome(index, job.job_id, True, value, None, log=log)
    return JobOutcome(index, job.job_id, False, None, value, traceback=trace, log=log)


def wait_all(
    jobs: Sequence[submitit.Job],
    on_done: Callable[[JobOutcome], None] | None = None,
    poll_s: float = 1.0,
) -> list[JobOutcome]:
    """Wait for every job; ``on_done`` sees each outcome as its job finishes (in finishing order).
    Returns the outcomes in submission order; a failed job is a failed outcome, never an exception."""
    pending = dict(enumerate(jobs))
    outcomes: dict[int, JobOutcome] = {}
    while pending:
        for index in [i for i, job in pending.items() if job.done()]:
            outcomes[index] = _outcome(index, pending.pop(index))
            if on_done is not None:
                on_done(outcomes[index])
        if pending:
            time.sleep(poll_s)
    return [outcomes[i] for i in range(len(jobs))]


__all__ = ["EXECUTOR_KINDS", "ExecutorConfig", "JobOutcome", "make_executor", "submit_points", "wait_all"]

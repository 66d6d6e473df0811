"""A study file: the header every kind shares, the kind's own section, and running it.

```yaml
name: upcycling            # results/<name>/
kind: upcycling            # a plug-in of moe_lit.studies.kinds
description: ...
seeds: [0, 1, 2]           # every configuration runs once per seed
data: {vocab_size: 2048}   # how to prepare run.data.data_dir when missing (moe-lit data prepare settings)
run: {data: ..., optim: ..., train: ..., trainer: ...}   # the base RunConfig of every point
executor: {kind: local}    # where points run (local worker processes | slurm | submitit_local)
...                        # the kind's own fields
```
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from moe_lit.config import ConfigError
from moe_lit.errors import MoeLitError
from moe_lit.io import atomic_write_json
from moe_lit.lit.run_config import RunConfig, read_yaml
from moe_lit.studies.identity import STUDY_FILE, Point, Start, finalize, point_record, read_record
from moe_lit.studies.kinds import kind_module
from moe_lit.studies.run import TrainFn, measure_only
from moe_lit.studies.schedule import Log, run_points
from moe_lit.studies.spec import errors_under, known_keys

HEADER_FIELDS = ("name", "kind", "description", "seeds", "data", "run", "executor")


@dataclass
class StudyHeader:
    """The fields every study kind shares."""

    name: str
    """Study name: results go to results/<name>/ unless --out says otherwise."""
    kind: str
    """The study kind (moe_lit.studies.kinds): dense_vs_sparse | upcycling | language_expansion | ..."""
    run: RunConfig
    """The base run config of every point (a kind changes what its points vary)."""
    seeds: list[int] = field(default_factory=lambda: [0])
    """Seeds: every configuration runs once per seed (tables show mean ± std over them)."""
    data: dict[str, Any] | None = None
    """How to prepare run.data.data_dir before the first run when it is missing or prepared
    otherwise: moe-lit data prepare settings (vocab_size, languages, ...); null = use it as it is."""
    executor: Any = None
    """Where points run: moe_lit.studies.executors.ExecutorConfig fields (kind local | slurm |
    submitit_local, parallel, partition, gpus_per_node, ...); null = local processes."""
    description: str = ""
    """Free text shown at the top of the summary."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ConfigError(f"name: must be a non-empty string without '/', got {self.name!r}")
        self.run = RunConfig.from_dict(self.run)
        if (
            not isinstance(self.seeds, list)
            or not self.seeds
            or len(set(self.seeds)) != len(self.seeds)
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in self.seeds)
        ):
            raise ConfigError(f"seeds: must be a non-empty list of distinct integers, got {self.seeds!r}")
        if self.data is not None:
            self.prepare_config()  # validates the data settings now
        self.executor = _executor(self.executor)

    def prepare_config(self):
        """The :class:`~moe_lit.data.prepare.PrepareConfig` that builds run.data.data_dir from ``data``."""
        from moe_lit.data.prepare import PrepareConfig

        if not isinstance(self.data, dict):
            raise ConfigError(f"data: expected a mapping of data prepare settings, got {self.data!r}")
        allowed = [f.name for f in dataclasses.fields(PrepareConfig) if f.name not in ("out", "force", "progress")]
        known_keys(self.data, "data", allowed)
        with errors_under("data."):
            return PrepareConfig(out=self.run.data.resolved_dir(), **self.data)

    def seeded_run(self, seed: int, run: RunConfig | None = None) -> RunConfig:
        """``run`` (default: the base) with train.seed set to ``seed``."""
        return (run or self.run).replace(train={"seed": seed})

    def point_name(self, config_name: str, seed: int) -> str:
        return config_name + (f"/s{seed}" if len(self.seeds) > 1 else "")

    def point(self, config_name: str, seed: int, *args: Any, **kwargs: Any) -> Point:
        """The point of ``config_name`` at ``seed``, named by :meth:`point_name`; ``args`` and
        ``kwargs``: the rest of :class:`~moe_lit.studies.identity.Point` (model, run, info, ...)."""
        return Point(self.point_name(config_name, seed), config_name, seed, *args, **kwargs)

    def start(self, config_name: str, seed: int, mode: str = "init", step: int | None = None) -> Start:
        """A start from the point ``config_name`` of ``seed`` (its final weights, or those after ``step``)."""
        return Start(parent=self.point_name(config_name, seed), step=step, mode=mode)


def _executor(value: Any):
    from moe_lit.studies.executors import ExecutorConfig

    if isinstance(value, ExecutorConfig):
        return value
    if value is not None and not isinstance(value, dict):
        raise ConfigError(f"executor: expected a mapping of ExecutorConfig fields, got {value!r}")
    known_keys(value or {}, "executor", [f.name for f in dataclasses.fields(ExecutorConfig)])
    return ExecutorConfig(**(value or {}))


@dataclass
class Study:
    """A parsed study file: its header, its kind's module and spec, and its points."""

    header: StudyHeader
    kind: ModuleType
    spec: Any
    points: list[Point]

    @property
    def name(self) -> str:
        return self.header.name


def parse_study(data: Any, data_dir: str | None = None) -> Study:
    """Validate a study mapping (``--data`` replaces run.data.data_dir) and expand its points."""
    if not isinstance(data, dict):
        raise ConfigError(f"study: expected a mapping, got {type(data).__name__}")
    for required in ("name", "kind"):
        if required not in data:
            raise ConfigError(f"{required}: is required")
    module = kind_module(data["kind"])
    own = {k: v for k, v in data.items() if k not in HEADER_FIELDS}
    header_fields = {k: v for k, v in data.items() if k in HEADER_FIELDS}
    header_fields.setdefault("run", {})
    header_fields["run"] = RunConfig.from_dict(dict(copy.deepcopy(module.DEFAULT_RUN)) | header_fields["run"])
    if data_dir is not None:
        header_fields["run"] = header_fields["run"].replace(data={"data_dir": str(data_dir)})
    header = StudyHeader(**header_fields)
    spec = module.parse(own, header)
    return Study(header, module, spec, finalize(module.expand(spec, header)))


def load_study(path: str | Path, data_dir: str | None = None) -> Study:
    return parse_study(read_yaml(path, "study"), data_dir)


def ensure_data(study: Study) -> None:
    """Prepare the data directory when the study says how (reused if prepared the same way), then
    check that it exists and that its tokenizer matches every point's vocab_size."""
    from moe_lit.data.layout import read_meta

    if study.header.data is not None:
        from moe_lit.data.prepare import prepare

        prepare(study.header.prepare_config())
    data_dir = study.header.run.data.resolved_dir()
    vocab = read_meta(data_dir).get("vocab_size")
    # NOTE: a measure-only point's model (on disk) brings its own tokenizer; the data is only text to it.
    wrong = sorted({p.model.vocab_size for p in study.points if not measure_only(p)} - {vocab})
    if wrong:
        raise MoeLitError(
            f"vocab_size: the study's models have {wrong} but data_dir {data_dir!r} has a tokenizer of {vocab}; "
            f"prepare matching data (moe-lit data prepare --vocab-size {wrong[0]} --out DIR) or change the models"
        )


def write_plan(study: Study, out_dir: Path, command: str = "") -> Path:
    """``study.json``: the command, the kind, the header, and the expanded points, for reports."""
    plan = {
        "name": study.name,
        "kind": study.header.kind,
        "description": study.header.description,
        "command": command,
        "seeds": study.header.seeds,
        "run": study.header.run.to_dict(),
        "spec": dataclasses.asdict(study.spec) if dataclasses.is_dataclass(study.spec) else study.spec,
        "points": [point_record(p) for p in study.points],
    }
    return atomic_write_json(Path(out_dir) / STUDY_FILE, plan)


def run_study(
    study: Study,
    out_dir: Path,
    *,
    parallel: int | None = None,
    retry_failed: bool = False,
    train_fn: TrainFn | None = None,
    prepare_data: bool = True,
    command: str = "",
    log: Log = print,
    only: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Run every unfinished point of ``study``; returns the records of all finished points.

    ``parallel`` (default: the study's executor.parallel) is the number of local worker processes;
    an executor of kind slurm or submitit_local submits the points as jobs instead.
    ``prepare_data=False`` skips preparing / checking the data (tests with a fake ``train_fn``).
    ``only``: run just the points whose names match one of these shell patterns (the plan stays whole).
    """
    if prepare_data:
        ensure_data(study)
    write_plan(study, out_dir, command)
    executor = study.header.executor
    return run_points(
        study.points,
        out_dir,
        parallel=executor.parallel if parallel is None else parallel,
        retry_failed=retry_failed,
        train_fn=train_fn,
        executor=executor,
        log=log,
        label=f"study {study.name}",
        only=only or (),
    )


def study_from_plan(out_dir: Path) -> dict[str, Any]:
    """The ``study.json`` of a results directory (what reports read)."""
    plan = read_record(Path(out_dir) / STUDY_FILE)
    if plan is None:
        raise MoeLitError(f"--out: {out_dir} holds no {STUDY_FILE}; run `moe-lit study run` first")
    return plan


__all__ = ["Study", "StudyHeader", "ensure_data", "load_study", "parse_study", "run_study", "write_plan"]

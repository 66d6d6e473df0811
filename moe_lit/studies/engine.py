"""The names that :mod:`moe_lit.studies.study`, :mod:`moe_lit.commands.study` and the
dense_vs_sparse kind still import from here; the engine is :mod:`moe_lit.studies.identity` (points,
calls, hashes), :mod:`moe_lit.studies.run` (one point) and :mod:`moe_lit.studies.schedule`
(workers, resume)."""

# NOTE: a re-export left for modules outside this change's files; it goes when they import the
# three modules above.
from moe_lit.studies.identity import (
    RUNS_DIR,
    STUDY_FILE,
    Call,
    Point,
    Start,
    finalize,
    point_record,
    point_status,
    read_record,
)
from moe_lit.studies.run import TrainFn, measure_only
from moe_lit.studies.schedule import Log, run_points

__all__ = [
    "RUNS_DIR",
    "STUDY_FILE",
    "Call",
    "Log",
    "Point",
    "Start",
    "TrainFn",
    "finalize",
    "measure_only",
    "point_record",
    "point_status",
    "read_record",
    "run_points",
]

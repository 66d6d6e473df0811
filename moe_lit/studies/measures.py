"""Measurements any study kind attaches to a point (``Point.measure = Call("moe_lit.studies.measures:NAME")``).

A measurement is called after the point's run as ``measure(point, result, run_dir, **kwargs)`` and
returns fields for the point's record. To measure an already finished point without running it
again, give it a child point: ``Start(parent=..., mode="init")``, ``train.max_steps: 0`` and the
measurement (:func:`measure_child`); the parent's record and hash stay as they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_lit.config import ConfigError
from moe_lit.studies.engine import Call, Point, Start

LOCAL_SUITE = "moe_lit.studies.measures:local_suite"


@dataclass
class SuiteSpec:
    """A kind's ``suite:`` field: local-suite accuracy of its final models (null: not measured)."""

    limit: int | None = 50
    """Items per task (the first ones of each task; null: every item)."""
    batch_size: int = 32
    """Requests scored per forward."""

    def __post_init__(self) -> None:
        if self.limit is not None and (
            isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1
        ):
            raise ConfigError(f"suite.limit: must be an integer >= 1 or null, got {self.limit!r}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"suite.batch_size: must be an integer >= 1, got {self.batch_size!r}")

    def measure(self) -> Call:
        """The :func:`local_suite` call with these settings."""
        return Call(LOCAL_SUITE, {"limit": self.limit, "batch_size": self.batch_size})


def local_suite(point: Point, result: Any, run_dir: Path, limit: int | None = None, batch_size: int = 32) -> dict:
    """Local-suite accuracy (:func:`moe_lit.evaluation.suite.suite_scores`) of the run's final weights
    on the test split of the point's data dir, with that dir's tokenizer: ``{"suite": scores}``."""
    from moe_lit.checkpoint import load_model
    from moe_lit.evaluation.suite import suite_scores

    data_dir = Path(point.run.data.resolved_dir())
    model = load_model(result.checkpoint)
    return {"suite": suite_scores(model, data_dir / "tokenizer.json", data_dir, limit=limit, batch_size=batch_size)}


def measure_child(parent: Point, measure: Call, suffix: str = "suite") -> Point:
    """A point that validates ``parent``'s final weights (0 steps) and runs ``measure`` on them.

    Named ``<parent config>/<suffix>`` (seeded like the parent); ``info`` is the parent's with
    ``phase: suffix``; the record's ``parent`` field names the measured point, to join the two.
    """
    config_name = f"{parent.config_name}/{suffix}"
    name = parent.name.replace(parent.config_name, config_name, 1)
    return Point(
        name,
        config_name,
        parent.seed,
        parent.model,
        parent.run.replace(train={"max_steps": 0}),
        info={**parent.info, "phase": suffix},
        start=Start(parent=parent.name, mode="init"),
        measure=measure,
    )


__all__ = ["LOCAL_SUITE", "SuiteSpec", "local_suite", "measure_child"]

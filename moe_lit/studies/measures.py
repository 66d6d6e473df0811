"""Measurements every study kind shares: a model's tokenizer (its own, else the data's:
:func:`moe_lit.convert.recipes.data_tokenizer`), validation batches, the start weights'
validation, local-suite accuracy, and a child point that measures a finished one.

A point's measurement (``Point.measure = Call.of(fn, **kwargs)``) is called after its run as
``fn(point, result, run_dir, **kwargs)`` and returns fields for the point's record. To measure
an already finished point without running it again, give it a child point
(:func:`measure_child`: ``Start(parent=..., mode="init")``, ``train.max_steps: 0`` and the
measurement); the parent's record and hash stay as they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_lit.convert import recipes
from moe_lit.studies import spec as check
from moe_lit.studies.engine import TRANSFORMED_START, Call, Point, Start


@dataclass
class SuiteSpec:
    """A kind's ``suite:`` field: local-suite accuracy of its final models (null: not measured)."""

    limit: int | None = 50
    """Items per task (the first ones of each task; null: every item)."""
    batch_size: int = 32
    """Requests scored per forward."""

    def __post_init__(self) -> None:
        check.positive_int(self.limit, "suite.limit", optional=True)
        check.positive_int(self.batch_size, "suite.batch_size")

    def measure(self) -> Call:
        """The :func:`local_suite` call with these settings."""
        return Call.of(local_suite, limit=self.limit, batch_size=self.batch_size)


def model_tokenizer(checkpoint: str | Path, data_dir: str | Path):
    """The tokenizer beside an exported model directory (an imported model's own), else the data's."""
    from moe_lit.checkpoint import TOKENIZER_FILE
    from moe_lit.evaluation.harness import load_tokenizer

    beside = Path(checkpoint) / TOKENIZER_FILE
    return load_tokenizer(beside) if beside.is_file() else recipes.data_tokenizer(data_dir)


def suite(model, data_dir: str | Path, tokenizer=None, **options: Any) -> dict[str, Any]:
    """Local-suite accuracy (:func:`moe_lit.evaluation.suite.suite_scores`) of ``model`` on the test
    split of ``data_dir``, with the data's tokenizer unless given; ``options``: limit, batch_size, languages."""
    from moe_lit.data.layout import tokenizer_file
    from moe_lit.evaluation.suite import suite_scores

    return suite_scores(model, tokenizer or tokenizer_file(data_dir), data_dir, **options)


def suite_fields(model, data_dir: str | Path, limit: int | None) -> dict[str, Any]:
    """A record's suite fields: the whole result under ``suite`` and its two means flat (CSV columns)."""
    scores = suite(model, data_dir, limit=limit)
    return {
        "suite": scores,
        "suite_mean_acc": scores["mean_acc"],
        "suite_mean_above_chance": scores["mean_above_chance"],
    }


def local_suite(point: Point, result: Any, run_dir: Path, limit: int | None = None, batch_size: int = 32) -> dict:
    """Local-suite accuracy of the run's final weights on the test split of the point's data dir:
    ``{"suite": scores}``."""
    from moe_lit.checkpoint import load_model

    data_dir = Path(point.run.data.resolved_dir())
    return {"suite": suite(load_model(result.checkpoint), data_dir, limit=limit, batch_size=batch_size)}


def validation_batches(run) -> dict[str, list]:
    """``{language: [(B, L+1) batches]}``: the validation batches train_run validates ``run`` on."""
    from moe_lit.lit.datamodule import MoEDataModule

    data = run.data
    datamodule = MoEDataModule(
        data.resolved_dir(),
        seq_len=data.seq_len,
        batch_size=data.batch_size,
        languages=data.languages,
        val_batches=data.val_batches,
        seed=run.train.seed,
    )
    return {lang: list(loader) for lang, loader in zip(datamodule.languages, datamodule.val_dataloader(), strict=True)}


def start_validation(point: Point, run_dir: Path) -> dict[str, Any]:
    """Validation loss (overall and per language) of a transformed point's start weights (the model
    the engine wrote under ``run_dir/TRANSFORMED_START``) before training, by a 0-step
    :func:`~moe_lit.lit.runner.train_run` on the run's validation batches."""
    from moe_lit.lit.runner import train_run

    start = Path(run_dir) / TRANSFORMED_START
    converted = train_run(
        point.model, point.run.replace(train={"max_steps": 0}), Path(run_dir) / "converted", init_from=start
    )
    return {
        "val_loss_converted": converted.val_loss,
        "val_loss_converted_per_language": converted.val_loss_per_language,
    }


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


__all__ = [
    "SuiteSpec",
    "local_suite",
    "measure_child",
    "model_tokenizer",
    "start_validation",
    "suite",
    "suite_fields",
    "validation_batches",
]

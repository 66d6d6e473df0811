"""Rebuild per-point records of a dense_vs_sparse study from the runs.csv and study.json that the
pre-engine runner shipped (it did not commit its runs/<hash>.json), so a fresh clone resumes them.

    python scripts/migrate_study_records.py configs/studies/dense_vs_sparse.yaml results/dense_vs_sparse

Each old point is matched to the new point of the same config_name; the match is refused unless
the two model configs are equal (fields the old one lacks must hold their default) and the old
training settings equal the new run config. Records are written atomically as runs/<new hash>.json
with ``migrated_from`` naming the old hash; existing records are never replaced.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import sys
from pathlib import Path

from moe_lit.config import ModelConfig
from moe_lit.errors import MoeLitError
from moe_lit.io import atomic_write_json
from moe_lit.studies.engine import STATUS_OK, point_record, record_path
from moe_lit.studies.study import load_study

FLOAT_FIELDS = ("val_loss", "tokens_per_s", "load_imbalance", "wall_s", "study_wall_s")
INT_FIELDS = ("tokens", "steps")


def _same_fields(old: dict, config) -> bool:
    """Equal on the old fields; fields added since hold their default (the engine's identity rule)."""
    new = json.loads(json.dumps(dataclasses.asdict(config)))
    defaults = json.loads(json.dumps(dataclasses.asdict(type(config)())))
    return all(old[k] == new[k] if k in old else new[k] == defaults[k] for k in new) and set(old) <= set(new)


def _same_run(old_training: dict, run) -> bool:
    """The old TrainingSpec (max_tokens, seq_len, batch_size, val_batches, evaluations, optim, trainer)."""
    steps = old_training["max_tokens"] // (old_training["seq_len"] * old_training["batch_size"])
    return (
        (old_training["max_tokens"], old_training["seq_len"], old_training["batch_size"], old_training["val_batches"])
        == (run.train.max_tokens, run.data.seq_len, run.data.batch_size, run.data.val_batches)
        and max(1, steps // old_training["evaluations"]) == run.eval_every
        and _same_fields(old_training["optim"], run.optim)
        and old_training["trainer"] == run.trainer
    )


def migrate(spec_path: Path, out_dir: Path) -> int:
    study = load_study(spec_path)
    plan = json.loads((out_dir / "study.json").read_text())
    old_points = {p["config_name"]: p for p in plan["points"]}
    rows = {row["config_name"]: row for row in csv.DictReader((out_dir / "runs.csv").open())}
    written = 0
    for point in study.points:
        old, row = old_points.get(point.config_name), rows.get(point.config_name)
        if old is None or row is None or row["status"] != STATUS_OK or record_path(out_dir, point).exists():
            continue
        if ModelConfig.from_dict(old["model"]) != point.model:
            raise MoeLitError(f"{point.config_name}: the old model config differs from the study's")
        if not _same_run(plan["spec"]["training"], point.run):
            raise MoeLitError(f"{point.config_name}: the old training settings differ from the study's run")
        record = point_record(point)
        record.update({k: float(row[k]) for k in FLOAT_FIELDS if row.get(k)})
        record.update({k: int(row[k]) for k in INT_FIELDS if row.get(k)})
        langs = {k.removeprefix("val_loss_"): float(v) for k, v in row.items() if k.startswith("val_loss_") and v}
        record.update(status=STATUS_OK, error=None, val_loss_per_language=langs, migrated_from=old["hash"])
        atomic_write_json(record_path(out_dir, point), record)
        written += 1
    return written


if __name__ == "__main__":
    print(f"wrote {migrate(Path(sys.argv[1]), Path(sys.argv[2]))} records")

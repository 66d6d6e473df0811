"""Carry a study's records over to its points' current hashes.

A point's hash changes when what it covers changes on purpose: a plug-in's new version, a kind
passing its arguments otherwise, or the identity scheme itself (import paths replaced by
registered names). Its record ``runs/<old>.json`` would then be orphaned and the point trained
again. :func:`rehash_results` maps every old hash to the new hash of the point of the same
configuration name and seed in the study's current plan, checks the map both ways (every record
maps to exactly one point, no two records to one point), renames the records and their run
directories, and rewrites every mention of an old hash in the results directory's text files
(``study.json``, the records, ``runs.csv``).
It is idempotent: a second run maps every hash to itself and writes nothing.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from moe_lit.errors import MoeLitError
from moe_lit.io import atomic_write_text
from moe_lit.studies.identity import RUNS_DIR, STUDY_FILE, Point, read_record

HASH = re.compile(r"(?<![0-9a-f])[0-9a-f]{12}(?![0-9a-f])")
"""A point hash (12 hex digits) standing alone."""
TEXT_SUFFIXES = (".json", ".csv", ".md")
"""The results directory's files that may mention a hash (plots and checkpoints are left alone)."""


def hash_map(points: Sequence[Point], planned: Sequence[dict], records: dict[str, dict]) -> dict[str, str]:
    """Old hash -> new hash of every point of ``planned`` (a ``study.json``'s points) and of
    ``records`` (old hash -> record): the hash of the point of ``points`` (the current plan) with
    the same configuration name and seed."""
    # NOTE: by (config_name, seed), which name a point in every kind; a record's "name" can be
    # overwritten by the kind's axes (an upcycling arm's info carries the arm's own name). A record
    # is placed by its own fields, so one written after its study.json changed is placed too.
    new = {(point.config_name, point.seed): point.hash for point in points}
    if len(new) != len(points):
        raise MoeLitError("the current plan has two points of one configuration name and seed")
    old = {entry["hash"]: (entry["config_name"], entry["seed"]) for entry in planned}
    old |= {old_hash: (record["config_name"], record["seed"]) for old_hash, record in records.items()}
    gone = sorted({f"{name} (seed {seed})" for name, seed in old.values() if (name, seed) not in new})
    if gone:
        raise MoeLitError(f"points {', '.join(gone)}: recorded or planned here but not in the study's current plan")
    mapping = {old_hash: new[key] for old_hash, key in old.items()}
    shared = sorted(h for h, n in Counter(mapping[r] for r in records).items() if n > 1)
    if shared:
        raise MoeLitError(f"two records map to one point: {', '.join(shared)}")
    return mapping


def rehash_results(out_dir: Path, points: Sequence[Point]) -> dict[str, str]:
    """Move the records of ``out_dir`` to the hashes of ``points`` (the study's current plan);
    returns the hashes that changed (old -> new)."""
    out_dir, runs = Path(out_dir), Path(out_dir) / RUNS_DIR
    plan = read_record(out_dir / STUDY_FILE)
    if plan is None:
        raise MoeLitError(f"{out_dir}: no readable {STUDY_FILE}")
    records = {path.stem: read_record(path) for path in sorted(runs.glob("*.json"))}
    unreadable = [name for name, record in records.items() if record is None]
    if unreadable:
        raise MoeLitError(f"records {', '.join(unreadable)}: unreadable")
    changed = {old: new for old, new in hash_map(points, plan["points"], records).items() if old != new}
    if not changed:
        return changed
    texts = {path: path.read_text() for path in _text_files(out_dir)}
    for path, text in texts.items():
        target = runs / f"{changed[path.stem]}.json" if path.parent == runs and path.stem in changed else path
        new_text = HASH.sub(lambda match: changed.get(match[0], match[0]), text)
        if target != path or new_text != text:
            atomic_write_text(target, new_text)
    targets = set(changed.values())
    for old in changed:
        if old in records and old not in targets:
            (runs / f"{old}.json").unlink()
        for suffix in ("", ".log"):  # the git-ignored run directory and worker log, where present
            if (runs / f"{old}{suffix}").exists():
                (runs / f"{old}{suffix}").rename(runs / f"{changed[old]}{suffix}")
    return changed


def _text_files(out_dir: Path) -> list[Path]:
    files = [path for path in out_dir.iterdir() if path.suffix in TEXT_SUFFIXES]
    return sorted(files + list((out_dir / RUNS_DIR).glob("*.json")))


__all__ = ["hash_map", "rehash_results"]

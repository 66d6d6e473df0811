"""Move every shipped study's records to its points' current hashes (:mod:`moe_lit.studies.rehash`).

Run it after a change that moves point hashes on purpose (a plug-in's new version, a kind passing
its arguments otherwise): each ``results/<name>/`` with a ``study.json`` and a
``configs/studies/<name>.yaml`` is re-planned from the YAML and its records renamed to the new
hashes of the points of the same names. Idempotent: a second run changes nothing. A study whose
plan cannot be built here (a model on disk that this checkout lacks, e.g. the *-smollm2 studies
before ``make smollm2``) is skipped and named; run the script again where it can be built.

    python scripts/migrate_point_hashes.py             # every study under results/
    python scripts/migrate_point_hashes.py pruning     # some of them
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moe_lit.errors import MoeLitError
from moe_lit.studies.rehash import rehash_results
from moe_lit.studies.study import load_study

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("studies", nargs="*", help="study names (default: every results/<name>/study.json)")
    parser.add_argument("--results", type=Path, default=REPO / "results", help="results root (default results/)")
    parser.add_argument("--configs", type=Path, default=REPO / "configs" / "studies", help="study YAML folder")
    args = parser.parse_args(argv)
    names = args.studies or sorted(path.parent.name for path in args.results.glob("*/study.json"))
    skipped = 0
    for name in names:
        config = args.configs / f"{name}.yaml"
        if not config.is_file():
            print(f"{name}: skipped, no {config}")
            skipped += 1
            continue
        try:
            points = load_study(config).points
        except MoeLitError as exc:  # e.g. a model on disk this checkout lacks
            print(f"{name}: skipped, its plan cannot be built here: {exc}")
            skipped += 1
            continue
        recorded = {path.stem for path in (args.results / name / "runs").glob("*.json")}
        changed = rehash_results(args.results / name, points)
        moved = f"{len(recorded & set(changed))} of {len(recorded)} records moved"
        print(f"{name}: {len(changed)} point hashes changed ({len(points)} planned), {moved}")
    return 1 if skipped and args.studies else 0


if __name__ == "__main__":
    sys.exit(main())

"""How much of the lifecycle study's task measure its calibration text saw, and its claims without it.

configs/studies/lifecycle-smollm2.yaml's records calibrated expert pruning and MoE->dense on the
first ``calibration_tokens`` of the parallel test split (``calibration_split: test``), the text the
minimal pairs come from. This reads the committed records (each item's 0/1 outcome) and the
prepared data, names the suite items whose paragraph the calibration read, and tests each pair of
models item by item (scipy's paired t) on all items, on those, and on the rest. No model runs.

    python scripts/calibration_overlap.py            # after make smollm2 and the study's data prepare

Writes results/lifecycle-smollm2/calibration_overlap.json (atomically) and prints a table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from scipy import stats

from moe_lit.analysis.routing import tokenize_documents
from moe_lit.data.tokenizer import load_tokenizer, resolve_eot_id
from moe_lit.evaluation.tasks import SuiteConfig, build_items, documents, read_parallel
from moe_lit.io import atomic_write_json
from moe_lit.studies.study import load_study

CONTRASTS = [
    ("prune/0.5/maestro", "prune/0.5/reap"),
    ("prune/0.5/maestro", "prune/0.5/naee"),
    ("prune/0.5/maestro", "prune/0.5/frequency"),
    ("prune/0.25/maestro", "prune/0.25/reap"),
    ("prune/0.25/maestro", "prune/0.25/naee"),
    ("prune/0.25/maestro", "prune/0.25/frequency"),
    ("to_dense/moe", "to_dense/dense"),
]
"""(a, b) of the study's claims whose models calibrated on the test split."""


def calibration_ids(data_dir: Path, split: str, languages: list[str], tokens: int) -> set:
    """Paragraph ids of the calibration text (the documents :func:`tokenize_documents` takes)."""
    tokenizer = load_tokenizer(data_dir / "tokenizer.json")
    parallel = read_parallel(data_dir, split, languages)
    chosen = tokenize_documents(parallel, tokenizer, resolve_eot_id(tokenizer), tokens)
    reference = parallel[languages[0]]
    by_doc = documents(reference)
    return {reference[p]["id"] for doc in chosen[languages[0]] for p in by_doc[doc]}


def outcomes(record: dict, item_ids: dict[str, list], keep) -> list[float]:
    """The record's 0/1 item outcomes (tasks in name order) whose paragraph id ``keep`` accepts."""
    kept = []
    for task, values in sorted(record["suite"]["outcomes"].items()):
        ids = item_ids[task.rsplit("_", 1)[1]]
        kept += [float(v) for v, i in zip(values, ids, strict=True) if keep(i)]
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--study", default="configs/studies/lifecycle-smollm2.yaml")
    parser.add_argument("--results", default="results/lifecycle-smollm2")
    args = parser.parse_args()
    study = load_study(Path(args.study))
    spec, data_dir = study.spec, Path(study.header.run.data.resolved_dir())
    seen = calibration_ids(data_dir, spec.calibration_split, spec.languages, spec.calibration_tokens)
    suite = SuiteConfig(languages=spec.suite_languages)
    pairs = build_items(read_parallel(data_dir, "test", spec.suite_languages), suite)["pairs"]
    item_ids = {lang: [item["id"] for item in items[: spec.limit]] for lang, items in pairs.items()}
    runs = sorted(Path(args.results).glob("runs/*.json"))
    records = {record["config_name"]: record for record in (json.loads(path.read_text()) for path in runs)}
    subsets = {"all": lambda i: True, "seen by calibration": lambda i: i in seen, "unseen": lambda i: i not in seen}
    rows = []
    for a, b in CONTRASTS:
        row = {"a": a, "b": b}
        for name, keep in subsets.items():
            xa, xb = outcomes(records[a], item_ids, keep), outcomes(records[b], item_ids, keep)
            test = stats.ttest_rel(xa, xb)
            row[name] = {"n": len(xa), "a - b": sum(xa) / len(xa) - sum(xb) / len(xb), "p": float(test.pvalue)}
        rows.append(row)
    overlap = {lang: sum(i in seen for i in ids) for lang, ids in item_ids.items()}
    out = {"calibration_paragraphs": len(seen), "items_seen": overlap, "items": len(next(iter(item_ids.values())))}
    atomic_write_json(Path(args.results) / "calibration_overlap.json", out | {"contrasts": rows})
    print(f"calibration text: {len(seen)} test paragraphs; suite items whose paragraph it read: {overlap}")
    print("| a - b | " + " | ".join(f"{name} (n, a - b, paired p)" for name in subsets) + " |")
    print("|---|" + "---|" * len(subsets))
    for row in rows:
        cells = [f"{row[n]['n']}, {row[n]['a - b']:+.3f}, {row[n]['p']:.2g}" for n in subsets]
        print(f"| {row['a']} - {row['b']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

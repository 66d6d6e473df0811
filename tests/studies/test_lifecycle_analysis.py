"""The lifecycle kind's analysis on hand-made records: claims pair two models item by item, a
partial chain (a slice) reports the rest untestable, and the separation is in item-paired SEs."""

import math
import statistics

import pytest

from moe_lit.studies.kinds.lifecycle import analyse
from moe_lit.studies.verdicts import UNTESTABLE, judge

SPEC = {
    "shapes": [[8, 4], [16, 8]],
    "methods": ["random", "kmeans", "coactivation", "dot_moe", "pruning"],
    "prune_source": "E8k4/dot_moe",
    "fractions": [0.25],
    "prune_methods": ["maestro", "frequency"],
    "max_increase": 0.01,
}
PLAN = {"seeds": [0], "spec": SPEC}


def _record(config: str, en: list[int], de: list[int], stage: str = "partition", **fields) -> dict:
    outcomes = {"moe_lit_pairs_en": en, "moe_lit_pairs_de": de}
    tasks = {task: statistics.fmean(o) for task, o in outcomes.items()}
    suite = {"outcomes": outcomes, "tasks": tasks, "chance": dict.fromkeys(tasks, 0.5)}
    pooled = en + de
    quality = {"suite": suite, "task_acc": statistics.fmean(pooled), "task_acc_se": 0.1, "task_items": len(pooled)}
    record = {"status": "ok", "config_name": config, "name": config, "seed": 0, "stage": stage, "total_params": 1}
    return record | quality | {"bpb": {"en": 1.5, "de": 2.0}, "bpb_mean": 1.75} | fields


def test_a_slice_judges_what_it_has_and_leaves_the_rest_untestable_without_failing(tmp_path):
    dense = _record("dense", [1] * 6 + [0, 1], [1, 1, 0, 1, 1, 1, 1, 0], stage="dense")
    random = _record("E8k4/random", [0, 1, 0, 0, 1, 0, 0, 1], [1, 0, 0, 1, 0, 1, 0, 0], method="random")
    analysis = analyse(PLAN, [dense, random], tmp_path)
    by_text = {e.claim.text: e for e in analysis.claims}
    en = by_text["E8k4: the dense model scores above a random partition (moe_lit_pairs_en)"]
    differences = [a - b for a, b in zip([1] * 6 + [0, 1], [0, 1, 0, 0, 1, 0, 0, 1], strict=True)]
    assert en.difference.n_a == 8 and en.difference.estimate == pytest.approx(statistics.fmean(differences))
    assert en.difference.test == "paired t-test"
    verdicts = {v.evidence.claim.text: v.word for v in judge(analysis.claims)}
    assert verdicts["E8k4: DOT-MoE beats random"] == UNTESTABLE  # DOT-MoE has not run yet
    assert by_text["E16k8: DOT-MoE beats pruning"].claim.arms == ("E16k8/dot_moe", "E8k4/pruning")  # one width
    z = statistics.fmean(differences) / (statistics.stdev(differences) / math.sqrt(8))
    assert f"(moe_lit_pairs_en): {z:+.1f} item-paired standard errors" in "\n".join(analysis.findings)
    (models,) = [rows for title, rows in analysis.tables.items() if title.startswith("Every model")]
    assert [row["point"] for row in models] == ["dense", "E8k4/random"]
    assert [p.name for p in analysis.plots] == ["chain.png"] and analysis.plots[0].stat().st_size > 0


def test_the_sparsity_table_has_a_row_per_target_and_the_speedups_on_the_highest_within_the_margin(tmp_path):
    def point(target, increases, inactive):
        return [
            {"target": target, "language": lang, "increase": inc, "inactive": inactive}
            for lang, inc in zip(("en", "de"), increases, strict=True)
        ]

    curve = point(0.0, (0.0, 0.0), 0.0) + point(0.5, (0.004, 0.008), 0.49) + point(0.9, (0.2, 0.3), 0.9)
    fields = {"curve": curve, "best_target": 0.5, "layer_speedup": 1.5, "decode_speedup": 1.1}
    sparse = {"status": "ok", "config_name": "sparsity/gate", "seed": 0, "stage": "sparsity", **fields}
    analysis = analyse(PLAN, [sparse], tmp_path)
    (rows,) = [rows for title, rows in analysis.tables.items() if title.startswith("Intra-expert")]
    assert [r["target"] for r in rows] == ["0", "0.5", "0.9"]
    assert (
        rows[1]["loss increase"] == "+0.60%" and rows[1]["increase de"] == "+0.80%" and rows[1]["inactive"] == "0.490"
    )
    speedups = [r["highest within margin: FFN-layer, decode speedup"] for r in rows]
    assert speedups == ["", "1.50x, 1.10x", ""]
    dense_only = analyse(PLAN, [sparse | {"best_target": 0.0, "layer_speedup": None, "decode_speedup": None}], tmp_path)
    (rows,) = [rows for title, rows in dense_only.tables.items() if title.startswith("Intra-expert")]
    assert rows[0]["highest within margin: FFN-layer, decode speedup"] == "no target > 0 within it"
    (gate,) = [e for e in analysis.claims if e.claim.text.startswith("gate: 90%")]
    assert gate.difference.estimate == pytest.approx(0.25) and gate.difference.n_a == 2  # the languages at 0.9

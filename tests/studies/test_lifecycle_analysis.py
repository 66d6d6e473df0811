"""The lifecycle kind's analysis on hand-made records: partition claims take the conversion seed as the
unit (items within one conversion are findings), a partial chain (a slice) reports the rest untestable,
claims about trained MoEs are untestable on a converted one, and identical or forced arms count once."""

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
    "model": "smollm2",
    "recovery": {"steps": 96, "lr": 1e-4, "warmup": 10},
}
PLAN = {"seeds": [0], "spec": SPEC, "run": {"data": {"batch_size": 4, "seq_len": 256}}}


def _record(config: str, en: list[int], de: list[int], stage: str = "partition", **fields) -> dict:
    outcomes = {"moe_lit_pairs_en": en, "moe_lit_pairs_de": de}
    tasks = {task: statistics.fmean(o) for task, o in outcomes.items()}
    suite = {"outcomes": outcomes, "tasks": tasks, "chance": dict.fromkeys(tasks, 0.5), "languages": ["en", "de"]}
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
    assert en.claim.metric == "task acc (seeds)" and en.reason.startswith("1 conversion seed(s), 3 needed")
    verdicts = {v.evidence.claim.text: v.word for v in judge(analysis.claims)}
    assert set(verdicts.values()) == {UNTESTABLE}  # one conversion; DOT-MoE has not run yet
    assert by_text["E16k8: DOT-MoE beats pruning"].claim.arms == ("E16k8/dot_moe", "E8k4/pruning")  # one width
    differences = [a - b for a, b in zip([1] * 6 + [0, 1], [0, 1, 0, 0, 1, 0, 0, 1], strict=True)]
    mean = statistics.fmean(differences)
    (item,) = [f for f in analysis.findings if "random partition (moe_lit_pairs_en)" in f]
    assert item.startswith("- Within one conversion (seed 0") and f"= {mean:+.4f} [" in item and "n=8" in item
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


def _seeded(config: str, seed: int, correct: int, stage: str = "partition", **fields) -> dict:
    """A record of ``seed`` whose en items score ``correct`` of 10 (de: all right)."""
    return _record(config, [1] * correct + [0] * (10 - correct), [1] * 10, stage, seed=seed, **fields)


def test_partition_claims_take_the_conversion_seed_as_the_unit(tmp_path):
    plan = PLAN | {"seeds": [0], "spec": SPEC | {"conversion_seeds": [1, 2]}}
    records = [_seeded("dense", 0, 10, stage="dense")]  # measured once, every seed's baseline
    for seed, (dot, random) in enumerate([(9, 5), (8, 6), (9, 4)]):
        records += [_seeded("E8k4/dot_moe", seed, dot), _seeded("E8k4/random", seed, random)]
    analysis = analyse(plan, records, tmp_path)
    verdicts = {v.evidence.claim.text: v for v in judge(analysis.claims)}
    dot = verdicts["E8k4: DOT-MoE beats random"]
    per_seed = [(9 - 5) / 20, (8 - 6) / 20, (9 - 4) / 20]  # each seed's mean over its 20 items
    assert dot.evidence.difference.n_a == 3 and dot.evidence.difference.estimate == pytest.approx(sum(per_seed) / 3)
    assert dot.word in ("reproduced", "not detected") and dot.evidence.claim.metric == "task acc (seeds)"
    assert verdicts["E8k4: the dense model scores above a random partition (moe_lit_pairs_de)"].evidence.reason


def test_identical_and_forced_pruning_arms_count_once_and_a_trained_moe_claim_is_untestable(tmp_path):
    spec = SPEC | {"fractions": [0.25, 0.5], "prune_methods": ["maestro", "frequency", "router_weighted"]}
    source = {"model": {"moe": {"unit_weights": True, "renormalize": False}}}
    records = [_record("E8k4/dot_moe", [1, 0] * 5, [1] * 10, **source)]
    for fraction, active, right in ((0.25, 2, 4), (0.5, 3, 6)):  # at 0.5 every layer keeps top_k: total = active
        for method, en in (("maestro", [1] * 8 + [0] * 2), ("frequency", [1] * right + [0] * (10 - right))):
            fields = {"total_params": 3, "active_params": active, "top_k": 4}
            records.append(_record(f"prune/{fraction:g}/{method}", en, [1] * 10, stage="prune", **fields))
            if method == "frequency":  # unit router weights: router-weighted frequency is frequency
                records.append(records[-1] | {"config_name": f"prune/{fraction:g}/router_weighted"})
    analysis = analyse(PLAN | {"spec": spec}, records, tmp_path)
    pruned = [v for v in judge(analysis.claims) if "pruned:" in v.evidence.claim.text]
    assert [v.evidence.claim.text for v in pruned] == [
        "0.25 pruned: maestro beats frequency",
        "0.5 pruned: maestro beats frequency",
    ]
    assert all("router-weighted frequency is frequency" in v.evidence.merged for v in pruned)
    assert all(v.word == UNTESTABLE and "the paper tested a trained MoE" in v.evidence.reason for v in pruned)
    assert "every layer keeps exactly top_k = 4" in pruned[1].evidence.reason
    assert "top_k" not in pruned[0].evidence.reason

"""The moe_to_dense kind: points and parent links, matched parameters of the baseline, errors
naming the field, the findings on hand-made records, and a tiny real study end to end."""

import pytest

from moe_lit.accounting import count_config_params
from moe_lit.config import ConfigError
from moe_lit.convert.moe_to_dense import GROUPINGS, SCALINGS, SCORES
from moe_lit.stats import paired_difference
from moe_lit.studies.kinds.moe_to_dense import analyse, factor_spreads, screen_values
from moe_lit.studies.study import load_study, parse_study
from moe_lit.studies.verdicts import judge
from tests.helpers.corpus import prepare_corpus
from tests.helpers.studies import tiny_kind_model, tiny_kind_run

TINY = {
    "name": "m2d",
    "kind": "moe_to_dense",
    "seeds": [0, 1],
    "run": tiny_kind_run(),
    "model": tiny_kind_model(num_experts=4, expert_size=16, top_k=2, expert_output_bias=False),
    "keep": 3,
    "groups": 2,
    "distill": ["do_acp/single/gate_mass", "frequency/kmeans/uniform"],
    "finetune": "do_acp/single/gate_mass",
    "calibration_tokens": 64,
    "distillation": {"steps": 2, "warmup": 1, "lr": 0.001},
    "suite": False,
}


def test_points_parents_and_the_matched_baseline():
    study = parse_study(TINY)
    points = study.points
    assert len(points) == 2 * (2 + len(SCORES) + 2 + 1 + 1)
    by_name = {p.name: p for p in points}
    moe, dense = by_name["moe/pretrain/s1"], by_name["dense/pretrain/s1"]
    assert moe.start is None and dense.start is None and moe.run == dense.run  # the same tokens
    assert dense.model.moe is None and dense.model.d_ff == 4 * 16  # the MoE's total FFN width
    screen = by_name["screen/taylor/s1"]
    assert (screen.start.parent, screen.start.mode, screen.run.steps, screen.transform) == (
        "moe/pretrain/s1",
        "init",
        0,
        None,
    )
    assert screen.measure.kwargs["score"] == "taylor" and screen.measure.kwargs["groupings"] == list(GROUPINGS)
    assert screen.measure.kwargs["scalings"] == list(SCALINGS) and screen.measure.kwargs["keep"] == 3
    distilled = by_name["distill/do_acp/single/gate_mass/s1"]
    finetuned = by_name["finetune/do_acp/single/gate_mass/s1"]
    baseline = by_name["distill/dense_to_dense/s1"]
    assert distilled.start.parent == finetuned.start.parent == "moe/pretrain/s1"
    assert baseline.start.parent == "dense/pretrain/s1"  # distilled from its own dense parent
    assert distilled.module.name == baseline.module.name == "teacher_module"
    assert finetuned.module is None and finetuned.transform == distilled.transform
    assert (
        distilled.transform.kwargs["keep"] == 2
        and by_name["distill/frequency/kmeans/uniform/s1"].transform.kwargs["keep"] == 3
    )  # single keeps `groups` experts, the merging groupings `keep`
    assert baseline.transform.kwargs["width"] == 2 * 16
    # the same final config (dense, d_ff = W), so exactly the same parameters; the same distillation run
    assert distilled.model == baseline.model == dense.model.replace(d_ff=32)
    assert count_config_params(distilled.model) == count_config_params(baseline.model)
    assert distilled.run == baseline.run == finetuned.run and distilled.run.steps == 2
    assert distilled.run.train.seed == 1 and distilled.run.optim.lr == 0.001
    assert len({p.hash for p in points}) == len(points)


def test_the_shipped_study_screens_the_whole_grid_over_three_seeds():
    study = load_study("configs/studies/moe_to_dense.yaml")
    spec = study.spec
    assert study.header.seeds == [0, 1, 2] and (spec.model.moe.num_experts, spec.model.moe.top_k) == (8, 2)
    assert (spec.scores, spec.groupings, spec.scalings) == (list(SCORES), list(GROUPINGS), list(SCALINGS))
    assert spec.width == 64 and spec.dense_parent.d_ff == 256


@pytest.mark.parametrize(
    "change, message",
    [
        ({"keep": 5}, "keep: must be in [groups=2, num_experts=4], got 5"),
        ({"keep": 2}, "groupings: merging groupings need keep > groups"),
        ({"scores": ["do_acp", "magic"]}, "scores: unknown ['magic'], allowed values: frequency"),
        ({"distill": ["do_acp/single"]}, "distill: expected 'score/grouping/scaling', got 'do_acp/single'"),
        ({"distill": ["do_acp/blend/uniform"]}, "distill: 'do_acp/blend/uniform': grouping: got 'blend'"),
        ({"finetune": "random/single/uniform"}, "finetune: must be null or one of distill"),
        ({"model": tiny_kind_model()}, "model.moe: the parent must be an MoE"),
        (
            {"model": {**TINY["model"], "moe": {**TINY["model"]["moe"], "first_dense_layers": 1}}},
            "model.moe: every layer must be MoE",
        ),
        ({"distillation": {"steps": 0}}, "distillation.steps: must be a positive integer, got 0"),
        ({"distillation": {"temperature": 0}}, "distillation.temperature: must be > 0"),
        ({"calibration_split": "dev"}, "calibration_split: got 'dev', allowed values: train, val, test"),
        ({"suite_limit": 0}, "suite_limit: must be null or a positive integer, got 0"),
        ({"colour": 1}, "study: unknown key(s) ['colour']"),
    ],
)
def test_spec_errors_name_the_field(change, message):
    with pytest.raises(ConfigError) as info:
        parse_study({**TINY, **change})
    assert message in str(info.value)


def _screen_record(score, seed, losses):
    """A screen point's record; ``losses``: {(grouping, scaling): val loss}."""
    rows = [
        {"grouping": g, "scaling": c, "params": 100, "val_loss": v, "val_loss_per_language": {"en": v - 1, "de": v + 1}}
        for (g, c), v in losses.items()
    ]
    return {
        "name": f"screen/{score}/s{seed}",
        "status": "ok",
        "arm": "screen",
        "score": score,
        "seed": seed,
        "screen": rows,
    }


def _records():
    # score effect 1.0 (do_acp best), grouping effect 0.1, scaling effect 0.01, + seed noise that
    # cancels in the paired differences, but for a little own noise of do_acp and of the baseline
    records = []
    for seed, noise in ((0, 0.0), (1, 0.02), (2, -0.01)):
        for score, base in (("do_acp", 3.0), ("frequency", 4.0), ("random", 3.5)):
            own = 0.001 * seed**2 if score == "do_acp" else 0.0
            losses = {
                (g, c): base + dg + dc + noise * (1 + dg) + own
                for g, dg in (("single", 0.0), ("kmeans", 0.1))
                for c, dc in (("uniform", 0.0), ("gate_mass", 0.01))
            }
            records.append(_screen_record(score, seed, losses))
        for name, arm, before, after in (
            ("distill/do_acp/single/uniform", "distill", 3.0, 2.0),
            ("finetune/do_acp/single/uniform", "finetune", 3.0, 2.5),
            ("distill/dense_to_dense", "distill", 5.0, 2.2),
        ):
            records.append(
                {
                    "name": f"{name}/s{seed}",
                    "config_name": name,
                    "status": "ok",
                    "arm": arm,
                    "seed": seed,
                    "total_params": 1234,
                    "val_loss": after + noise + (0.002 * seed**2 if name.endswith("dense") else 0.0),
                    "val_loss_converted": before + noise + (0.002 * seed**2 if name.endswith("dense") else 0.0),
                    "val_loss_per_language": {"en": after},
                    "wall_s": 10.0,
                }
            )
    records.append({"name": "moe/pretrain/s0", "status": "ok", "arm": "moe_parent", "seed": 0, "val_loss": 1.5})
    records.append({**_screen_record("taylor", 0, {("single", "uniform"): 0.1}), "status": "failed"})  # left out
    return records


def test_findings_and_tables_from_hand_made_records(tmp_path):
    records = _records()
    values = screen_values(records)
    assert list(values[("do_acp", "kmeans", "gate_mass")]["loss"].values()) == pytest.approx([3.11, 3.133, 3.103])
    assert ("taylor", "single", "uniform") not in values
    spreads = factor_spreads(values)
    assert spreads["score"][0] == pytest.approx(1.0) and spreads["grouping"][0] == pytest.approx(0.1)
    assert spreads["scaling"][1] == pytest.approx(0.01)
    plan = {"spec": {"distill": ["do_acp/single/uniform"], "finetune": "do_acp/single/uniform"}}
    analysis = analyse(plan, records, tmp_path)
    score_grouping, score_scaling, diversity, before, after, accuracy, kd = judge(analysis.claims)
    assert score_grouping.evidence.claim.arms == ("score", "grouping") and score_grouping.word == "reproduced"
    assert score_scaling.evidence.claim.arms == ("score", "scaling") and score_scaling.word == "reproduced"
    assert diversity.evidence.claim.arms == ("do_acp", "random") and diversity.word == "reproduced"
    # paired by seed the seed noise cancels: what is left is the baseline's own 0.002 * seed^2
    d = before.evidence.difference
    expected = paired_difference([3.0, 3.02, 2.99], [5.0, 5.022, 4.998])
    assert (d.estimate, d.p) == pytest.approx((expected.estimate, expected.p)) and before.word == "reproduced"
    assert "after distillation" in after.evidence.claim.text and after.word == "reproduced"
    assert accuracy.word == "untestable here" and accuracy.evidence.reason == "no suite accuracy measured"
    assert kd.evidence.claim.arms == ("distill/do_acp/single/uniform", "finetune/do_acp/single/uniform")
    # distilled minus fine-tuned is -0.5 in every seed: no noise estimate, never significant
    assert kd.word == "untestable here" and "zero spread" in kd.evidence.reason
    rows = analysis.tables[
        "Screen: every conversion before distillation, val loss (mean ± std over seeds; languages: mean)"
    ]
    assert (rows[0]["score"], rows[0]["grouping"], rows[0]["scaling"]) == ("do_acp", "single", "uniform")
    assert rows[0]["en"] == "2.005" and len(rows) == 3 * 4
    distilled = analysis.tables["Distilled children, same budget (mean ± std over seeds; languages: mean after)"]
    assert [r["loss"] for r in distilled] == ["KD (frozen parent)", "LM only", "KD (frozen parent)"]
    assert [p.name for p in analysis.plots] == ["screen.png", "distilled.png"]


@pytest.mark.slow
def test_tiny_study_end_to_end(tmp_path, monkeypatch):
    import csv

    import moe_lit.evaluation.suite

    suite_calls = []

    def fake_suite(model, tokenizer, data_dir, *, limit=None):
        # NOTE: lm-eval on the rendered suite is the lead's measure (tests/evaluation/test_suite.py);
        # here only that the distilled children are scored with it (too slow for this test).
        suite_calls.append((type(model).__name__, model.config.d_ff, limit))
        return {"mean_acc": 0.6, "mean_above_chance": 0.1, "limit": limit, "tasks": {}}

    monkeypatch.setattr(moe_lit.evaluation.suite, "suite_scores", fake_suite)

    from moe_lit.studies.report import write_report
    from moe_lit.studies.study import run_study

    prepare_corpus(tmp_path, paragraphs=30, val_fraction=0.2, test_fraction=0.2)
    spec = {
        **TINY,
        "seeds": [0],
        "scores": ["do_acp", "frequency"],
        "groupings": ["single", "kmeans"],
        "scalings": ["uniform", "gate_mass"],
        "distill": ["do_acp/single/gate_mass"],
        "suite": True,
        "suite_limit": 2,
    }
    study = parse_study(spec, str(tmp_path / "data"))
    records = {r["name"]: r for r in run_study(study, tmp_path / "out", log=lambda _: None)}
    assert len(records) == 7 and all(r["status"] == "ok" for r in records.values()), [
        r.get("error") for r in records.values()
    ]
    screen = records["screen/do_acp"]
    assert len(screen["screen"]) == 4 and {r["params"] for r in screen["screen"]} == {
        records["distill/dense_to_dense"]["total_params"]
    }
    assert screen["screen"][0]["val_loss_per_language"].keys() == {"en", "de", "ru"}
    distilled, finetuned = records["distill/do_acp/single/gate_mass"], records["finetune/do_acp/single/gate_mass"]
    # the same start weights (the converted MoE), one trained with the teacher's KL, one without
    assert distilled["val_loss_converted"] == finetuned["val_loss_converted"]
    single = next(r for r in screen["screen"] if (r["grouping"], r["scaling"]) == ("single", "gate_mass"))
    assert single["val_loss"] == pytest.approx(distilled["val_loss_converted"], rel=1e-4)  # screen = converted start
    assert distilled["val_loss"] != finetuned["val_loss"]
    with open(distilled["metrics_csv"]) as handle:
        columns = next(csv.reader(handle))
    assert "train/kl" in columns  # trained by the DistillModule
    assert distilled["suite_mean_above_chance"] == 0.1 and distilled["suite"]["limit"] == 2
    assert suite_calls == [("Transformer", 32, 2)] * 3  # distilled, fine-tuned, baseline: the trained models
    assert distilled["steps"] == 2 and records["distill/dense_to_dense"]["total_params"] == distilled["total_params"]
    summary = write_report(tmp_path / "out")["summary"].read_text()
    assert "MoE->dense beats dense->dense" in summary and "no noise estimate: 1 seed" in summary
    assert (tmp_path / "out" / "plots" / "screen.png").is_file()

"""The language_expansion kind: points and parent links, analysis on hand-made records, and a tiny
real study whose MoE arms measure the new language's routing."""

import pytest

from moe_lit.studies.kinds.language_expansion import analyse
from moe_lit.studies.study import parse_study
from moe_lit.studies.verdicts import UNTESTABLE, judge
from tests.helpers.corpus import prepare_corpus

TINY = {
    "name": "lang",
    "kind": "language_expansion",
    "run": {
        "data": {"seq_len": 16, "batch_size": 2, "val_batches": 1},
        "optim": {"warmup_steps": 1},
        "train": {"max_steps": 2, "val_every": 2},
        "trainer": {"enable_progress_bar": False, "accelerator": "cpu"},
    },
    "dense": {"vocab_size": 300, "d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64},
    "base_languages": ["en", "de"],
    "new_languages": ["ru"],
    "num_experts": 4,
    "continue_steps": 2,
    "continue_warmup": 1,
}


def test_each_arm_continues_from_its_pretrained_parent_on_all_languages():
    study = parse_study(TINY)
    by_name = {p.name: p for p in study.points}
    assert list(by_name) == ["dense/base", "dense/continued", "moe/base", "moe/continued", "moe_grown/continued"]
    base = by_name["moe/base"].run.data
    assert base.languages == ["en", "de", "ru"] and base.language_weights == {"en": 1.0, "de": 1.0}  # ru: val only
    grown = by_name["moe_grown/continued"]
    assert (grown.start.parent, grown.start.mode) == ("moe/base", "init") and grown.transform.kwargs["factor"] == 2
    cont = by_name["dense/continued"].run
    assert cont.data.language_weights is None and cont.steps == 2 and cont.optim.warmup_steps == 1
    assert by_name["moe/base"].model.moe.num_experts == 4 and by_name["dense/base"].model.moe is None


def test_unknown_and_missing_fields_are_named():
    from moe_lit.config import ConfigError

    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['new_language'\]"):
        parse_study({**TINY, "new_language": ["pl"]})
    with pytest.raises(ConfigError, match="new_languages: is required"):
        parse_study({k: v for k, v in TINY.items() if k != "new_languages"})


def _record(name, family, phase, losses, seed=0, **extra):
    return {
        "name": name,
        "status": "ok",
        "family": family,
        "phase": phase,
        "seed": seed,
        "val_loss_per_language": dict(zip(("en", "de", "ru"), losses, strict=False)),
        **extra,
    }


def test_interference_gain_and_verdict_from_hand_made_records(tmp_path):
    records = []
    for seed, jitter in ((0, 0.0), (1, 0.02)):
        for family, rise in (("dense", 0.30), ("moe", 0.05)):
            base = f"{family}/base/s{seed}"
            records += [
                _record(base, family, "base", (3.0, 3.0, 6.0), seed),
                _record(
                    f"{family}/continued/s{seed}",
                    family,
                    "continued",
                    (3.0 + rise + jitter, 3.0 + rise, 4.0),
                    seed,
                    base_point=base,
                    **({"routing_js_new_vs_base": {"ru": 0.4}} if family == "moe" else {}),
                ),
            ]
    analysis = analyse({"spec": {"base_languages": ["en", "de"], "new_languages": ["ru"]}}, records, tmp_path)
    rows = {r["arm"]: r for r in analysis.tables["Switch to the new languages (mean ± std over seeds)"]}
    assert rows["dense"]["interference (base-language loss change; < 0: improved)"] == "0.3050 ± 0.0071 (n=2)"
    assert rows["moe"]["final loss, new languages"] == "4.0000 ± 0.0000 (n=2)"
    assert rows["moe"]["gain on new languages"] == "2.0000 ± 0.0000 (n=2)"
    assert rows["moe"]["JS(new vs base usage), bits"] == "0.4000 ± 0.0000 (n=2)"
    (claim,) = analysis.claims
    assert claim.claim.arms == ("moe", "dense") and claim.claim.direction == "lower"
    # paired by seed the jitter cancels exactly: no noise estimate, so nothing is called significant
    assert claim.difference.estimate == pytest.approx(-0.25) and claim.difference.test == "paired t-test"
    (verdict,) = judge(analysis.claims)
    assert verdict.word == UNTESTABLE and verdict.evidence.reason.startswith("no noise estimate: the 2 differences")


@pytest.mark.slow
def test_tiny_study_end_to_end(tmp_path):
    from moe_lit.studies.study import run_study

    prepare_corpus(tmp_path, paragraphs=30, val_fraction=0.2, test_fraction=0.1)
    records = {
        r["name"]: r for r in run_study(parse_study(TINY, str(tmp_path / "data")), tmp_path / "out", log=lambda _: None)
    }
    assert all(r["status"] == "ok" for r in records.values()), [r.get("error") for r in records.values()]
    grown, moe = records["moe_grown/continued"], records["moe/continued"]
    assert grown["total_params"] > moe["total_params"]  # 8 experts after the growth, top-k unchanged:
    assert grown["active_params"] - moe["active_params"] == 4 * 32  # only the 4 new router rows are active
    js = records["moe_grown/continued"]["routing_js_new_vs_base"]["ru"]
    assert 0.0 <= js <= 1.0 and "routing_js_new_vs_base" not in records["dense/continued"]


def test_interference_plot_per_arm_and_paired_with_dense():
    from moe_lit.plotting import pyplot
    from moe_lit.studies.kinds.language_expansion import interference_figure

    per_arm = {
        "dense": {"interference": {0: 0.30, 1: 0.32}},
        "moe": {"interference": {0: 0.05, 1: 0.10, 2: 0.2}},  # seed 2 has no dense partner
        "moe_grown": {},
    }
    fig = interference_figure(per_arm)
    ax_arm, ax_diff = fig.axes
    assert [t.get_text() for t in ax_arm.get_xticklabels()] == ["dense", "moe"]
    dots = ax_arm.containers[0].lines[0]
    assert list(dots.get_ydata()) == pytest.approx([0.31, 0.35 / 3])
    assert "bars: ± std over 2-3 seeds" in ax_arm.get_title()
    paired = ax_diff.containers[0]
    assert list(paired.lines[0].get_ydata()) == pytest.approx([-0.235]) and paired.has_yerr  # (-0.25, -0.22)
    assert [0.0, 0.0] in [list(line.get_ydata()) for line in ax_diff.lines]
    pyplot().close(fig)
    assert interference_figure({"dense": {}, "moe": {}}) is None

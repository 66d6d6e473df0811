"""The language_expansion kind: points and parent links, analysis on hand-made records, and a tiny
real study whose MoE arms measure the new language's routing."""

import numpy as np
import pytest
import scipy.stats

from moe_lit.studies.kinds.language_expansion import analyse, per_arm, related
from moe_lit.studies.study import parse_study
from moe_lit.studies.verdicts import NO_MARGIN, UNTESTABLE, judge, second_analysis
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


def test_each_arm_continues_from_its_pretrained_parent_with_and_without_the_new_languages():
    study = parse_study(TINY)
    by_name = {p.name: p for p in study.points}
    arms = [f"{arm}/{phase}" for arm in ("dense", "moe", "moe_grown") for phase in ("continued", "control")]
    assert list(by_name) == ["dense/base", *arms[:2], "moe/base", *arms[2:]]
    base = by_name["moe/base"].run.data
    assert base.languages == ["en", "de", "ru"] and base.language_weights == {"en": 1.0, "de": 1.0}  # ru: val only
    for phase in ("continued", "control"):
        grown = by_name[f"moe_grown/{phase}"]
        assert (grown.start.parent, grown.start.mode) == ("moe/base", "init") and grown.transform.kwargs["factor"] == 2
    cont, control = by_name["dense/continued"].run, by_name["dense/control"].run
    assert cont.data.language_weights is None and cont.steps == 2 and cont.optim.warmup_steps == 1
    # the control: the same budget and schedule on the base languages alone, the same data seed
    assert control.data.language_weights == {"en": 1.0, "de": 1.0} and control.steps == 2
    assert control.optim == cont.optim and control.train.seed == cont.train.seed
    assert by_name["moe/base"].model.moe.num_experts == 4 and by_name["dense/base"].model.moe is None
    assert by_name["moe/continued"].measure is not None and by_name["moe/control"].measure is None


def test_control_steps_give_the_control_the_base_language_tokens_of_the_continued_run():
    by_name = {p.name: p for p in parse_study({**TINY, "control_steps": 1}).points}
    assert by_name["dense/control"].run.steps == 1 and by_name["dense/continued"].run.steps == 2
    assert by_name["moe_grown/control"].run.steps == 1
    default = {p.name: p for p in parse_study(TINY).points}
    assert by_name["dense/continued"].hash == default["dense/continued"].hash  # only the control changes
    assert by_name["dense/control"].hash != default["dense/control"].hash


@pytest.mark.parametrize("bad", [0, 1.5, "3"])
def test_control_steps_must_be_a_positive_integer(bad):
    from moe_lit.config import ConfigError

    with pytest.raises(ConfigError, match="control_steps: must be null or a positive integer"):
        parse_study({**TINY, "control_steps": bad})


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


def test_interference_is_against_the_base_only_control_paired_by_seed(tmp_path):
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
                _record(f"{family}/control/s{seed}", family, "control", (2.9, 2.9, 5.5), seed, base_point=base),
            ]
    spec = {"base_languages": ["en", "de"], "new_languages": ["ru"], "margin": 0.1}
    analysis = analyse({"spec": spec}, records, tmp_path)
    rows = {r["arm"]: r for r in analysis.tables["Switch to the new languages (mean ± std over seeds)"]}
    interference = "interference (with new languages minus without; > 0: interferes)"
    assert rows["dense"][interference] == "0.4050 ± 0.0071 (n=2)"  # 3.3 (+0.01) - 2.9
    assert rows["dense"]["base languages, base-only control"] == "2.9000 ± 0.0000 (n=2)"
    assert rows["moe"]["final loss, new languages"] == "4.0000 ± 0.0000 (n=2)"
    assert rows["moe"]["gain on new languages"] == "2.0000 ± 0.0000 (n=2)"
    assert rows["moe"]["JS(new vs base usage), bits"] == "0.4000 ± 0.0000 (n=2)"
    dense, less, none, sharing = analysis.claims
    assert dense.claim.arms == ("dense", "0") and dense.claim.direction == "higher"
    assert dense.difference.test == "one-sample t-test" and dense.difference.estimate == pytest.approx(0.405)
    assert less.claim.arms == ("moe", "dense") and less.claim.direction == "lower"
    # paired by seed the jitter cancels exactly: no noise estimate, so nothing is called significant
    assert less.difference.estimate == pytest.approx(-0.25) and less.difference.test == "paired t-test"
    assert none.claim.bounds == (-0.1, 0.1) and none.difference.estimate == pytest.approx(0.155)
    assert sharing.reason == "families: no related and unrelated pairs of measured languages"
    verdicts = judge(analysis.claims)
    assert verdicts[1].word == UNTESTABLE and verdicts[1].evidence.reason.startswith(
        "no noise estimate: the 2 differences"
    )
    without = analyse({"spec": {**spec, "margin": None}}, records, tmp_path).claims[2]
    assert without.reason == NO_MARGIN


def test_sharing_claim_is_the_residual_of_routing_js_after_a_line_on_unigram_js(tmp_path):
    families = {"romance": ["fr", "es", "it"], "germanic": ["en", "de"]}
    unigram = {"en|de": 0.30, "en|fr": 0.50, "en|es": 0.55, "en|it": 0.52, "de|fr": 0.60}
    unigram |= {"de|es": 0.62, "de|it": 0.58, "fr|es": 0.35, "fr|it": 0.33, "es|it": 0.28}
    records, expected = [_record("moe/base/s0", "moe", "base", (3.0, 3.0, 3.0))], {}
    for seed in (0, 1, 2):
        shift = {p: -0.05 - 0.01 * seed if related(p, families) else 0.01 * seed for p in unigram}
        routing = {p: 0.2 + 0.5 * u + shift[p] for p, u in unigram.items()}
        measures = {"routing_js_new_vs_base": {"ru": 0.3}, "routing_js_pairs": routing, "unigram_js_pairs": unigram}
        name = f"moe/continued/s{seed}"
        records.append(_record(name, "moe", "continued", (3.0,) * 3, seed, base_point="moe/base/s0", **measures))
        fit = scipy.stats.linregress(list(unigram.values()), list(routing.values()))  # scipy's line, not the kind's
        residual = {p: routing[p] - (fit.intercept + fit.slope * u) for p, u in unigram.items()}
        rel = np.mean([r for p, r in residual.items() if related(p, families)])
        expected[seed] = (rel, np.mean([r for p, r in residual.items() if not related(p, families)]))
    spec = {"base_languages": ["en", "de"], "new_languages": ["ru"], "families": families}
    values = per_arm({"spec": spec}, records)["moe"]
    assert values["related_residual"] == pytest.approx({s: e[0] for s, e in expected.items()})
    assert values["unrelated_residual"] == pytest.approx({s: e[1] for s, e in expected.items()})
    analysis = analyse({"spec": spec}, records, tmp_path)
    (sharing,) = [c for c in analysis.claims if c.claim.metric.startswith("routing JS residual")]
    by_seeds = sharing if sharing.difference.test == "paired t-test" else sharing.also
    assert by_seeds.claim.metric == "routing JS residual (seeds)"
    assert by_seeds.difference.estimate == pytest.approx(np.mean([e[0] - e[1] for e in expected.values()]))
    # language pairs as the units: each pair's residual averaged over the seeds, Welch related vs unrelated
    by_pairs = sharing.also if sharing is by_seeds else sharing
    fits = [
        scipy.stats.linregress(list(unigram.values()), [r["routing_js_pairs"][p] for p in unigram]) for r in records[1:]
    ]
    mean = {
        p: np.mean(
            [r["routing_js_pairs"][p] - (f.intercept + f.slope * u) for r, f in zip(records[1:], fits, strict=True)]
        )
        for p, u in unigram.items()
    }
    welch = scipy.stats.ttest_ind(
        [m for p, m in mean.items() if related(p, families)],
        [m for p, m in mean.items() if not related(p, families)],
        equal_var=False,
    )
    assert by_pairs.claim.metric == "routing JS residual (language pairs, seeds averaged)"
    assert by_pairs.difference.test == "Welch's t-test" and by_pairs.p == pytest.approx(welch.pvalue)
    assert sharing.p == max(by_seeds.p, by_pairs.p)  # the verdict follows the conservative test
    (verdict,) = [v for v in judge(analysis.claims) if v.evidence is not None and v.evidence.also is not None]
    assert f"Second analysis, not the verdict ({sharing.also.claim.metric})" in second_analysis(verdict.evidence)
    pairs = {r["pair"]: r for r in analysis.tables["Language pairs after the continuation (mean ± std over seeds)"]}
    assert pairs["fr|es"]["related"] == "yes" and pairs["en|fr"]["related"] == "no"
    assert pairs["en|de"]["unigram JS, bits"] == "0.3000 ± 0.0000 (n=3)"


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
    pairs = ["en|de", "en|ru", "de|ru"]
    for arm in ("moe", "moe_grown"):
        measured = records[f"{arm}/continued"]
        assert list(measured["routing_js_pairs"]) == pairs and list(measured["unigram_js_pairs"]) == pairs
        assert all(
            0.0 <= v <= 1.0 for v in [*measured["routing_js_pairs"].values(), *measured["unigram_js_pairs"].values()]
        )
    # the unigram baseline is a property of the text: the same for both arms
    assert records["moe/continued"]["unigram_js_pairs"] == records["moe_grown/continued"]["unigram_js_pairs"]
    assert "routing_js_pairs" not in records["moe/control"]


def test_interference_plot_per_arm_and_paired_with_dense():
    from moe_lit.plotting import pyplot
    from moe_lit.studies.kinds.language_expansion import interference_figure

    per_arm = {
        "dense": {"interference": {0: 0.30, 1: 0.32}},
        "moe": {"interference": {0: 0.05, 1: 0.10, 2: 0.2}},  # seed 2 has no dense partner
        "moe_grown": {},
    }
    fig = interference_figure(per_arm)
    ax_arm, ax_diff, ax_pairs = fig.axes
    assert [t.get_text() for t in ax_arm.get_xticklabels()] == ["dense", "moe"]
    dots = ax_arm.containers[0].lines[0]
    assert list(dots.get_ydata()) == pytest.approx([0.31, 0.35 / 3])
    assert "bars: ± std over 2-3 seeds" in ax_arm.get_title()
    paired = ax_diff.containers[0]
    assert list(paired.lines[0].get_ydata()) == pytest.approx([-0.235]) and paired.has_yerr  # (-0.25, -0.22)
    assert [0.0, 0.0] in [list(line.get_ydata()) for line in ax_diff.lines]
    pyplot().close(fig)
    assert interference_figure({"dense": {}, "moe": {}}) is None

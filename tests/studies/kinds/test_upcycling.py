"""The upcycling kind: expansion of points with parent links, analysis on hand-made records, and a
tiny real study (train_run) where the arms fork from fixed_E's checkpoint."""

import math

import numpy as np
import pytest
import scipy.stats

from moe_lit.config import ConfigError
from moe_lit.convert.expand import MAX_COPIES, ExpansionConfig
from moe_lit.studies.kinds.upcycling import analyse
from moe_lit.studies.study import parse_study, run_study
from moe_lit.studies.verdicts import NO_MARGIN
from tests.helpers.corpus import prepare_corpus

TINY = {
    "name": "up",
    "kind": "upcycling",
    "run": {
        "data": {"seq_len": 16, "batch_size": 2, "val_batches": 1},
        "optim": {"lr": 3e-3, "warmup_steps": 1},
        "train": {"max_steps": 6, "val_every": 2},
        "trainer": {"enable_progress_bar": False, "accelerator": "cpu"},
    },
    "model": {
        "vocab_size": 300,
        "d_model": 32,
        "n_layers": 1,
        "n_heads": 2,
        "d_ff": 64,
        "moe": {"num_experts": 2, "expert_size": 16, "top_k": 1, "balancing": "bias"},
    },
    "expand_at": 4,
    "utility_batches": 2,
    "separation_every": 1,
    "timing_rounds": 2,
    "arms": [{"name": "utility_copy", "selection": "utility"}],
}


def test_arms_fork_from_their_seeds_fixed_E_checkpoint():
    study = parse_study({**TINY, "seeds": [0, 1]})
    by_name = {p.name: p for p in study.points}
    assert list(by_name) == [f"{arm}/s{s}" for s in (0, 1) for arm in ("fixed_E", "fixed_mE", "up_utility_copy")]
    child = by_name["up_utility_copy/s1"]
    assert (child.start.parent, child.start.step, child.start.mode) == ("fixed_E/s1", 2, "resume")
    assert by_name["fixed_mE/s0"].model.moe.num_experts == 4
    # the child's identity covers its parent's: a longer parent run is another child
    longer = parse_study({**TINY, "seeds": [0, 1], "run": {**TINY["run"], "train": {"max_steps": 8, "val_every": 2}}})
    assert {p.hash for p in longer.points}.isdisjoint(p.hash for p in study.points)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"expand_at": 5}, "expand_at: must be a multiple of run.train.val_every=2"),
        ({"expand_at": 2}, "expand_at: must be in (utility_batches=2, 6 steps), got 2"),
        ({"arms": [{"name": "x", "selection": "best"}]}, "arms[0].selection: got 'best'"),
        ({"margin": 0}, "margin: must be a number > 0, got 0"),
        ({"factor": 1}, "factor: must be an integer >= 2"),
        ({"expand_a": 4}, "unknown key(s) ['expand_a']"),
        ({"factor": 4}, "arms[utility_copy].max_copies: must be >= factor=4 for utility selection to copy unevenly"),
        ({"rewarm": "yes"}, "rewarm:"),
    ],
)
def test_spec_errors_name_the_field(change, message):
    with pytest.raises(ConfigError) as info:
        parse_study({**TINY, **change})
    assert message in str(info.value)


def test_rewarm_restarts_every_arms_schedule_at_tau_and_max_copies_joins_the_upcycling_arguments():
    plain = parse_study(TINY).points
    rewarmed = parse_study({**TINY, "rewarm": True}).points
    assert all(p.run.optim.rewarm_at is None for p in plain)
    assert all(p.run.optim.rewarm_at == 4 for p in rewarmed)
    assert {p.hash for p in plain}.isdisjoint(p.hash for p in rewarmed)
    capped = parse_study({**TINY, "arms": [{"name": "utility_copy", "selection": "utility", "max_copies": 5}]}).points
    (child,) = [p for p in capped if p.name == "up_utility_copy"]
    grow = next(c for c in child.callbacks if c.name == "expert_upcycling")
    assert grow.kwargs["expansion"]["max_copies"] == 5
    unset = next(c for c in plain[2].callbacks if c.name == "expert_upcycling")
    assert "max_copies" not in unset.kwargs["expansion"]  # null: the transform's default, left out of the hash
    assert ExpansionConfig.from_dict(unset.kwargs["expansion"]).max_copies == MAX_COPIES
    assert [p.hash for p in capped][:2] == [p.hash for p in plain][:2]  # the fixed arms are unchanged
    assert capped[2].hash != plain[2].hash


def _record(arm, seed, loss, **extra):
    return {
        "status": "ok",
        "arm": arm,
        "seed": seed,
        "val_loss": loss,
        "num_experts": 2,
        "expand_at": 4,
        "total_steps": 10,
        "factor": 2,
        "curve": [{"step": 10, "val_loss": loss}],
        **extra,
    }


def test_analysis_gap_closure_per_seed_and_compute_both_ways(tmp_path):
    events = [{"copies": {"0": [2, 0], "1": [1, 1]}}]
    records = [
        _record("fixed_E", 0, 3.0),
        _record("fixed_E", 1, 3.2),
        _record("fixed_E", 2, 3.1),
        _record("fixed_mE", 0, 2.5, step_times={"E": 1.0, "mE": 2.0}),
        _record("fixed_mE", 1, 2.6, step_times={"E": 1.0, "mE": 2.0}),
        _record("fixed_mE", 2, 2.55, step_times={"E": 1.0, "mE": 2.0}),
        _record("up_a", 0, 2.8, probe_before=3.0, probe_after=3.25, events=events),
        _record("up_a", 1, 2.9, probe_before=3.0, probe_after=3.25),
        _record("up_a", 2, 2.85, probe_before=3.0, probe_after=3.25),
    ]
    analysis = analyse({"spec": {"cost_ratios": [1.9]}}, records, tmp_path)
    eta = [(3.0 - 2.8) / (3.0 - 2.5), (3.2 - 2.9) / (3.2 - 2.6), (3.1 - 2.85) / (3.1 - 2.55)]  # paired by seed
    (finding,) = [f for f in analysis.findings if f.startswith("- **up_a**")]
    ci = scipy.stats.t.interval(0.95, 2, loc=np.mean(eta), scale=scipy.stats.sem(eta))
    assert f"eta = {np.mean(eta):.4f} [{ci[0]:+.4f}, {ci[1]:+.4f}] (n=3)" in finding  # the gap: p < 0.01
    measured = next(f for f in analysis.findings if "measured" in f)
    assert "C_up/C_fixed = 0.800, saving 20.0%" in measured  # (4*1 + 6*2) / (10*2)
    model = next(f for f in analysis.findings if "cost model" in f)
    assert f"r=1.9: {100 * 0.4 * (1 - 1 / 1.9):.1f}%" in model
    row = next(r for r in analysis.tables["Arms (mean ± std over seeds)"] if r["arm"] == "up_a")
    assert row["experts"] == 4 and row["val jump at swap"] == "0.2500 ± 0.0000 (n=3)"
    assert row["copies (seed 0)"] == "[2, 0]; uneven in 1/2 blocks"
    assert (
        row["minus fixed_E (paired)"].startswith("-0.2500 [") and "paired t-test, p=" in row["minus fixed_E (paired)"]
    )
    gap, beats, matches, saving = analysis.claims  # paired by seed: each arm against its own seed's runs
    assert gap.claim.arms == ("fixed_mE", "fixed_E") and gap.difference.estimate == pytest.approx(-0.55)
    assert gap.difference.p < 0.01
    assert beats.claim.arms == ("up_a", "fixed_E") and beats.difference.test == "paired t-test"
    assert matches.reason == NO_MARGIN  # no margin stated in the study file: untestable
    with_margin = analyse({"spec": {"cost_ratios": [1.9], "margin": 0.5}}, records, tmp_path).claims[2]
    # with a margin stated the claim is tested, here without a noise estimate (up_a - fixed_mE is 0.3 in both seeds)
    assert with_margin.claim.bounds == (-0.5, 0.5) and with_margin.reason.startswith("no noise estimate")
    assert (
        saving.reason.startswith("the saving comes from the GPU step-time ratio") and "here r = 2.00" in saving.reason
    )
    assert [p.name for p in analysis.plots] == ["val_loss.png"] and analysis.plots[0].read_bytes()[:4] == b"\x89PNG"


def test_utility_claim_pairs_each_utility_arm_with_its_uniform_twin_on_eta(tmp_path):
    base = {"optimizer_state": "copy", "noise": 1e-3, "router_noise": 0.5, "drop_fraction": 0.0}
    arms = [
        {"name": "uni", "selection": "uniform", **base},
        {"name": "util", "selection": "utility", **base, "max_copies": 6},
        {"name": "plain", "selection": "uniform", **base, "router_noise": 0.0},  # not a twin: other noise
    ]
    losses = {"fixed_E": (3.0, 3.2, 3.1), "fixed_mE": (2.5, 2.6, 2.55), "up_uni": (2.9, 3.1, 3.0)}
    losses |= {"up_util": (2.8, 2.95, 2.9), "up_plain": (3.0, 3.2, 3.1)}
    records = [_record(arm, s, loss) for arm, values in losses.items() for s, loss in enumerate(values)]
    claims = analyse({"spec": {"cost_ratios": [1.9], "arms": arms}}, records, tmp_path).claims
    (utility,) = [c for c in claims if c.claim.metric == "eta"]
    assert utility.claim.arms == ("up_util", "up_uni") and utility.claim.direction == "higher"

    def eta(arm):
        return [(e - x) / (e - m) for e, m, x in zip(losses["fixed_E"], losses["fixed_mE"], losses[arm], strict=True)]

    assert utility.difference.test == "paired t-test"
    assert utility.difference.estimate == pytest.approx(np.mean(np.subtract(eta("up_util"), eta("up_uni"))))
    assert utility.claim.paper == pytest.approx(2 * np.mean(eta("up_uni")))  # "more than tripling" eta
    assert claims[-1].claim.metric == "compute"  # the compute claim stays last


def test_utility_claim_keeps_its_registered_test_and_the_later_rule_is_a_second_analysis(tmp_path):
    from statsmodels.stats.power import TTestPower

    base = {"optimizer_state": "copy", "noise": 1e-3, "router_noise": 0.5, "drop_fraction": 0.0}
    arms = [{"name": "uni", "selection": "uniform", **base}, {"name": "util", "selection": "utility", **base}]
    losses = {"fixed_E": (3.0, 3.2, 3.1, 3.05), "fixed_mE": (2.5, 2.6, 2.55, 2.5)}
    losses |= {"up_uni": (2.98, 3.21, 3.08, 3.05), "up_util": (2.99, 3.2, 3.09, 3.06)}  # eta about 0 in both
    records = [_record(arm, s, loss) for arm, values in losses.items() for s, loss in enumerate(values)]
    claims = analyse({"spec": {"cost_ratios": [1.9], "arms": arms}}, records, tmp_path).claims
    (utility,) = [c for c in claims if c.claim.metric == "eta"]

    def eta(arm):
        e, m, x = (np.array(losses[a]) for a in ("fixed_E", "fixed_mE", arm))
        return (e - x) / (e - m)

    assert utility.decides == "difference" and not utility.reason  # the registered design: tested, in Holm
    assert utility.difference.estimate == pytest.approx(np.mean(eta("up_util") - eta("up_uni")))
    later = utility.also
    assert later.claim.metric == "eta, rule added after the 8-seed result"
    assert "3x of up_uni's eta has no size: that eta is" in later.reason
    paper = 2 * eta("up_uni").mean()
    assert paper > 0 and utility.claim.paper == pytest.approx(paper)
    sd = np.std(eta("up_util") - eta("up_uni"), ddof=1)
    needed = math.ceil(TTestPower().solve_power(effect_size=paper / sd, alpha=0.05, power=0.8))
    assert f"would need about {needed} seeds" in later.reason and needed > 4


def test_eta_is_not_computed_where_the_gap_is_not_shown_at_p_below_001(tmp_path):
    records = [_record("fixed_E", s, loss) for s, loss in ((0, 3.0), (1, 3.2))]
    records += [_record("fixed_mE", s, loss) for s, loss in ((0, 2.5), (1, 2.6))]  # 2 seeds: p = 0.058
    records += [_record("up_a", s, loss) for s, loss in ((0, 2.8), (1, 2.9))]
    analysis = analyse({"spec": {"cost_ratios": [1.9]}}, records, tmp_path)
    assert not any(f.startswith("- **up_a**") for f in analysis.findings)
    assert "- eta is not computed: the gap L_E - L_mE is not shown at p < 0.01 (p = 0.0577)." in analysis.findings
    row = next(r for r in analysis.tables["Arms (mean ± std over seeds)"] if r["arm"] == "up_a")
    assert row["eta [95% CI]"] == ""


@pytest.mark.slow
def test_tiny_study_end_to_end_and_resume(tmp_path):
    from moe_lit.studies.report import write_report

    prepare_corpus(tmp_path, paragraphs=30, val_fraction=0.2, test_fraction=0.1)
    study = parse_study(TINY, data_dir=str(tmp_path / "data"))
    records = {r["arm"]: r for r in run_study(study, tmp_path / "out", log=lambda _: None)}
    assert {arm: r["status"] for arm, r in records.items()} == dict.fromkeys(
        ("fixed_E", "fixed_mE", "up_utility_copy"), "ok"
    ), [r.get("error") for r in records.values()]
    up = records["up_utility_copy"]
    assert up["events"][0]["step"] == 4 and up["events"][0]["num_experts"] == 4
    assert up["probe_after"] == pytest.approx(up["probe_before"], abs=1e-5)  # top-1 expansion: exact
    steps = [p["step"] for p in up["curve"]]
    assert min(steps) > 2 and steps[-1] == 6  # resumed at step 2 (the prefix is not retrained), validated at the end
    assert [p["step"] for p in records["fixed_E"]["curve"]] == [2, 4, 6]
    first = up["copy_separation"][0]
    assert first["step"] == 5 and first["layers"]["0"]["cosine"][0] == pytest.approx(1.0, abs=1e-3)  # one step after
    assert records["fixed_mE"]["step_times"]["E"] > 0
    summary = write_report(tmp_path / "out")["summary"].read_text()
    assert "eta is not computed" in summary and "Compute, cost model" in summary  # one seed: no gap shown
    log = []
    run_study(study, tmp_path / "out", log=log.append)  # finished points are not trained again
    assert log[0] == f"study up: 3 points, 3 finished, 0 to run -> {tmp_path / 'out'}"


def test_curves_plot_marks_tau_and_pairs_each_arm_with_its_seeds_fixed_e():
    from moe_lit.plotting import pyplot
    from moe_lit.studies.kinds.upcycling import _by_arm, curves_figure

    def curve(*pairs):
        return [{"step": s, "val_loss": v} for s, v in pairs]

    records = [
        _record("fixed_E", 0, 2.8, curve=curve((2, 3.5), (4, 3.0), (10, 2.8))),
        _record("fixed_E", 1, 3.0, curve=curve((2, 3.7), (4, 3.2), (10, 3.0))),
        _record("up_a", 0, 2.7, curve=curve((4, 3.0), (10, 2.7))),  # resumed fixed_E: the steps before tau are its
        _record("up_a", 1, 2.95, curve=curve((4, 3.2), (10, 2.95))),
    ]
    fig = curves_figure(_by_arm(records), tau=4)
    ax_all, ax_after, ax_diff, ax_copy = fig.axes
    for ax in fig.axes:  # the expansion step is marked in every panel
        assert [4, 4] in [list(line.get_xdata()) for line in ax.lines]
    assert "band: ± std over 2 seeds" in ax_all.get_title()
    up_all = next(line for line in ax_all.lines if line.get_label() == "up_a (n=2)")
    assert list(up_all.get_xdata()) == [2, 4, 10] and list(up_all.get_ydata()) == pytest.approx([3.6, 3.1, 2.825])
    assert min(ax_after.lines[0].get_xdata()) == 4  # the zoom starts at tau
    (paired,) = [line for line in ax_diff.lines if line.get_linestyle() == "--"]  # up_a minus fixed_E, per seed
    assert list(paired.get_xdata()) == [4, 10] and list(paired.get_ydata()) == pytest.approx([0.0, -0.075])
    assert len(ax_diff.collections) == 1  # its ± std band (the seeds differ by 0.1 and 0.05 at step 10)
    assert not ax_copy.containers  # no arm measured its copies here
    pyplot().close(fig)

"""The pruning kind: points and parent links, retention and MAESTRO's verdicts on hand-made records,
errors naming the field, and a tiny real study (pretrain -> prune -> evaluate / recover)."""

import re
from pathlib import Path

import pytest

from moe_lit.config import ConfigError
from moe_lit.convert.importance import METHODS
from moe_lit.stats import paired_difference
from moe_lit.studies.kinds.pruning import analyse, retention_values
from moe_lit.studies.study import load_study, parse_study
from moe_lit.studies.verdicts import NOT_DETECTED, UNTESTABLE, judge
from tests.helpers.corpus import prepare_corpus
from tests.helpers.studies import tiny_kind_model, tiny_kind_run

TINY = {
    "name": "prune",
    "kind": "pruning",
    "seeds": [0, 1],
    "run": tiny_kind_run(),
    "model": tiny_kind_model(num_experts=4, expert_size=32, top_k=1),
    "calibration_tokens": 64,
    "recovery_steps": 2,
    "recovery_warmup": 1,
}


def test_every_method_and_fraction_prunes_the_seeds_own_parent_with_and_without_recovery():
    points = parse_study(TINY).points
    assert len(points) == 2 * (2 + len(METHODS) * 2 * 2)
    by_name = {p.name: p for p in points}
    parent, control = by_name["original/s1"], by_name["original/recovered/s1"]
    assert parent.start is None and parent.run.steps == 4 and parent.run.train.seed == 1
    # the control: the unpruned parent fine-tuned like the recovered arms (their retention reference)
    assert (control.start.parent, control.start.mode, control.transform) == ("original/s1", "init", None)
    pruned, recovered = by_name["maestro/50%/pruned/s1"], by_name["maestro/50%/recovered/s1"]
    for child in (pruned, recovered):
        assert (child.start.parent, child.start.mode, child.start.step) == ("original/s1", "init", None)
        assert child.transform.name == "prune_by_importance"
        assert child.transform.kwargs == {
            "method": "maestro",
            "fraction": 0.5,
            "data_dir": "some/data",
            "calibration_tokens": 64,
            "languages": None,
            "split": "test",
            "damping": 0.85,
            "naee_cap": 2000,
            "seed": 1,
        }
        assert child.measure.name == "measure_memory" and child.measure.kwargs == {}
        assert child.info["method"] == "maestro" and child.info["fraction"] == 0.5
        assert child.info["calibration"] == "mix"
    assert pruned.info["reference"] == "original/s1" and recovered.info["reference"] == "original/recovered/s1"
    assert pruned.run.steps == 0  # evaluated as it is: the run only validates
    assert recovered.run == control.run
    assert recovered.run.steps == 2 and recovered.run.optim.warmup_steps == 1 and recovered.run.train.seed == 1
    assert parent.measure is None and control.measure is None  # no task measure by default
    assert by_name["random/25%/pruned/s0"].transform.kwargs["fraction"] == 0.25
    assert len({p.hash for p in points}) == len(points)


ARMS = {
    **TINY,
    "methods": ["maestro", "naee", "frequency"],
    "tasks": True,
    "task_limit": 20,
    "task_fractions": [0.5],
    "single_language_calibration": ["de", "en"],
    "single_language_tokens": 256,
}


def test_single_language_arms_prune_at_half_with_one_language_and_measure_tasks():
    points = parse_study(ARMS).points
    assert len(points) == 2 * (2 + 3 * 2 * 2 + 2 * 2)  # + de and en for maestro and naee
    by_name = {p.name: p for p in points}
    mix, de = by_name["naee/50%/pruned/s1"], by_name["naee/50%/pruned/calibration-de/s1"]
    assert de.transform.kwargs == {**mix.transform.kwargs, "languages": ["de"], "calibration_tokens": 256}
    assert de.info == {**mix.info, "calibration": "de"} and de.info["reference"] == "original/s1"
    assert de.run == mix.run and de.run.steps == 0 and de.start == mix.start
    # without the recovered arm: no control, no recovered children, the same pruned points
    pruned_only = {p.name: p for p in parse_study({**ARMS, "arms": ["pruned"]}).points}
    assert set(pruned_only) == {n for n in by_name if "recovered" not in n}
    assert all(pruned_only[n].hash == by_name[n].hash for n in pruned_only)
    assert (
        "frequency/50%/pruned/calibration-de/s1" not in by_name
        and "naee/50%/recovered/calibration-de/s1" not in by_name
    )
    # tasks: the references and the 50% children measure them, the 25% children only the memory
    for name in ("original/s0", "original/recovered/s0"):
        assert by_name[name].measure.to_dict() == {
            "name": "measure_tasks",
            "version": 1,
            "kwargs": {"limit": 20},
        }
    assert mix.measure.kwargs == {"tasks": True, "task_limit": 20}
    assert by_name["naee/25%/pruned/s1"].measure.kwargs == de.measure.kwargs == {}  # de: val loss per language
    # the calibration is part of the hash; a field only the single-language arms read changes only theirs
    assert len({p.hash for p in points}) == len(points)
    changed = {p.name: p.hash for p in parse_study({**ARMS, "single_language_tokens": 512}).points}
    assert {n for n, p in by_name.items() if p.hash != changed[n]} == {
        f"{m}/50%/pruned/calibration-{lang}/s{s}" for m in ("maestro", "naee") for lang in ("de", "en") for s in (0, 1)
    }
    # the task margin is analysis only: no point changes
    assert [p.hash for p in parse_study({**ARMS, "task_margin": 0.05}).points] == [p.hash for p in points]


def test_the_shipped_study_prunes_e16_top2_parents_over_three_seeds():
    study = load_study("configs/studies/pruning.yaml")
    assert study.header.seeds == [0, 1, 2] and len(study.points) == 3 * (2 + len(METHODS) * 2 * 2)
    moe = study.points[0].model.moe
    assert (moe.num_experts, moe.top_k) == (16, 2) and study.spec.fractions == [0.25, 0.5]
    # the task / calibration study: 50% pruned, every method on the suite, de and en arms on val loss
    tasks = load_study("configs/studies/pruning_tasks.yaml")
    assert len(tasks.points) == 3 * (1 + len(METHODS) + 2 * 2)
    scored = [p.name for p in tasks.points if p.measure and (p.measure.name == "measure_tasks" or p.measure.kwargs)]
    assert len(scored) == 3 * 7 and not any("calibration-" in name for name in scored)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"fractions": [0.5, 1.0]}, "fractions: [1.0] not allowed, each must be in (0, 1)"),
        ({"fractions": [0.95]}, "fractions: fraction/num: removing 4 of the 4 experts"),
        (
            {"fractions": [0.75], "model": tiny_kind_model(num_experts=4, expert_size=32, top_k=2)},
            "fractions: 0.75 keeps 1 of 4 experts, fewer than top_k=2",
        ),
        ({"methods": ["maestro", "magic"]}, "methods: unknown ['magic'], allowed values: maestro, frequency"),
        ({"model": tiny_kind_model()}, "model.moe: the parent must be an MoE"),
        ({"calibration_split": "dev"}, "calibration_split: got 'dev', allowed values: train, val, test"),
        ({"recovery_steps": 0}, "recovery_steps: must be a positive integer, got 0"),
        ({"damping": 0.0}, "damping: must be a number in (0, 1], got 0.0"),
        ({"colour": 1}, "study: unknown key(s) ['colour']"),
        ({"task_limit": 0}, "task_limit: must be null or a positive integer, got 0"),
        ({"task_fractions": [0.3]}, "task_fractions: unknown [0.3], allowed values: 0.25, 0.5"),
        ({"recovery_warmup": 3}, "recovery_warmup: must be an integer in [0, recovery_steps], got 3"),
        ({"task_margin": -0.1}, "task_margin: must be a number >= 0, got -0.1"),
        ({"tasks": "yes"}, "tasks: must be true or false, got 'yes'"),
        ({"arms": ["pruned", "distilled"]}, "arms: unknown ['distilled'], allowed values: pruned, recovered"),
        (
            {"single_language_calibration": ["de"], "single_language_methods": ["reap"], "methods": ["maestro"]},
            "single_language_methods: unknown ['reap'], allowed values: maestro",
        ),
        (
            {"single_language_calibration": ["de"], "fractions": [0.25]},
            "single_language_calibration: its arms prune 0.5, so fractions must include it",
        ),
        ({"single_language_calibration": "de"}, "single_language_calibration: must be a list of distinct language"),
    ],
)
def test_spec_errors_name_the_field(change, message):
    with pytest.raises(ConfigError) as info:
        parse_study({**TINY, **change})
    assert message in str(info.value)


def _same(d, expected) -> bool:
    """The same test of the same numbers (to rounding)."""
    return (d.test, d.estimate, d.p, d.ci_low, d.ci_high) == pytest.approx(
        (expected.test, expected.estimate, expected.p, expected.ci_low, expected.ci_high)
    )


PARENT = {"en": 2.0, "de": 4.0}


CONTROL = {"en": 1.0, "de": 2.0}  # the recovered arms' reference


def _child(method, fraction, arm, seed, retention, **extra):
    """A child record whose val loss per language gives the hand-chosen retention (reference / pruned)."""
    reference = PARENT if arm == "pruned" else CONTROL
    losses = {lang: reference[lang] / r for lang, r in zip(reference, retention, strict=False)}
    return {
        "name": f"{method}/{fraction}/{arm}/s{seed}",
        "status": "ok",
        "arm": arm,
        "method": method,
        "fraction": fraction,
        "seed": seed,
        "val_loss_per_language": losses,
        "val_loss": sum(losses.values()) / 2,
        "reference": f"original/s{seed}" if arm == "pruned" else f"original/recovered/s{seed}",
        **extra,
    }


def _records():
    memory = {
        "params_before": 1000,
        "params_after": 600,
        "params_saved_fraction": 0.4,
        "bytes_before": 4000,
        "bytes_after": 2400,
        "params_saved": 400,
    }
    records = [
        {"name": f"original/s{s}", "status": "ok", "arm": "original", "val_loss_per_language": PARENT, "val_loss": 3.0}
        for s in (0, 1)
    ]
    records += [
        {
            "name": f"original/recovered/s{s}",
            "status": "ok",
            "arm": "control",
            "val_loss_per_language": CONTROL,
            "val_loss": 1.5,
        }
        for s in (0, 1)
    ]
    for seed, (maestro, frequency) in enumerate((((1.0, 0.8), (0.5, 0.5)), ((0.8, 0.8), (0.5, 0.4)))):
        records += [
            _child("maestro", 0.5, "pruned", seed, maestro, **memory, kept_experts=[2, 2]),
            _child("frequency", 0.5, "pruned", seed, frequency),
            _child("random", 0.5, "pruned", seed, (1.0, 1.0)),  # best of all, but never "the best baseline"
            _child("maestro", 0.5, "recovered", seed, (0.8, 0.8) if seed == 0 else (0.5, 0.5)),
            _child("frequency", 0.5, "recovered", seed, (0.5, 0.5)),
            _child("router_weighted", 0.25, "pruned", seed, (0.5, 1.0)),
        ]
    records.append({**_child("naee", 0.5, "pruned", 0, (1.0, 1.0)), "status": "failed"})  # failed: left out
    records.append(_child("naee", 0.5, "pruned", 7, (1.0, 1.0)))  # its parent has no record: left out
    return records


def test_retention_tables_and_verdicts_from_hand_made_records(tmp_path):
    analysis = analyse({}, _records(), tmp_path)
    table = analysis.tables["Retention = original / pruned val loss per language (mean ± std over seeds)"]
    rows = {(r["removed"], r["arm"], r["method"]): r for r in table}
    assert next(iter(rows)) == ("25%", "pruned", "router_weighted") and ("50%", "pruned", "naee") not in rows
    # maestro, pruned: per seed mean (1.0+0.8)/2=0.9 and 0.8, variance across languages 0.01 and 0.
    maestro = rows[("50%", "pruned", "maestro")]
    assert maestro["retention (mean over languages)"] == "0.8500 ± 0.0707 (n=2)"
    assert maestro["variance across languages"] == "0.005000 ± 0.007071 (n=2)"
    assert rows[("50%", "pruned", "frequency")]["retention (mean over languages)"] == "0.4750 ± 0.0354 (n=2)"
    assert rows[("25%", "pruned", "router_weighted")]["variance across languages"] == "0.062500 ± 0.000000 (n=2)"
    mean_pruned, var_pruned, mean_recovered, var_recovered = judge(analysis.claims)
    assert mean_pruned.evidence.claim.arms == ("maestro", "frequency")  # random (retention 1.0) is not a baseline
    # paired by seed (both methods prune the same parent): differences 0.4 and 0.35
    d = mean_pruned.evidence.difference
    assert _same(d, paired_difference([0.9, 0.8], [0.5, 0.45])) and d.p == pytest.approx(0.0424, abs=1e-4)
    assert mean_pruned.evidence.claim.paper == pytest.approx(0.1061) and mean_pruned.fields["paper"] == "+0.1061"
    # significant alone; Holm over the three tested claims of the study (the smallest p, times 3) is not
    assert mean_pruned.p_holm == pytest.approx(3 * d.p) and mean_pruned.word == NOT_DETECTED
    assert _same(var_pruned.evidence.difference, paired_difference([0.01, 0.0], [0.0, 0.0025]))
    assert var_pruned.word == NOT_DETECTED  # maestro's variance is the higher one, within the noise
    assert mean_recovered.evidence.difference.estimate == pytest.approx(0.15) and mean_recovered.word == NOT_DETECTED
    assert var_recovered.word == UNTESTABLE  # equal variances (0 and 0) in both seeds: no noise estimate
    (memory,) = analysis.tables["Memory saved (parameters and persistent buffers)"]
    assert memory == {
        "removed": "50%",
        "experts per layer": "2, 2",
        "parameters": "1,000 -> 600",
        "saved": "40.0%",
        "bytes": "4,000 -> 2,400",
    }
    assert [p.name for p in analysis.plots] == ["retention.png"] and analysis.plots[0].stat().st_size > 0


def test_without_maestro_at_half_the_claims_are_not_tested(tmp_path):
    records = [r for r in _records() if r.get("method") != "maestro"]
    claims = analyse({}, records, tmp_path).claims
    assert claims and all(c.reason.startswith("needs maestro and another non-random method") for c in claims)


@pytest.mark.slow
def test_tiny_study_end_to_end(tmp_path, monkeypatch):
    from moe_lit.studies.report import write_report
    from moe_lit.studies.study import run_study

    prepare_corpus(tmp_path, paragraphs=30, val_fraction=0.2, test_fraction=0.2)
    calls = []

    def fake_suite_scores(model, tokenizer, data_dir, *, limit=None):
        """lm-eval's real suite is tested in tests/evaluation; here accuracy = 0.6 + 0.3 x the
        share of layer 0's experts kept (0.9 unpruned, 0.75 at half), chance 0.5."""
        calls.append((Path(tokenizer).name, Path(data_dir), limit))
        acc = 0.6 + 0.3 * model.config.moe_layer_config(0).num_experts / 4
        tasks = {f"moe_lit_pairs_{lang}": acc for lang in ("de", "en", "ru")}
        return {
            "tasks": tasks,
            "chance": dict.fromkeys(tasks, 0.5),
            "languages": dict.fromkeys(("de", "en", "ru"), acc),
            "mean_acc": acc,
            "mean_above_chance": acc - 0.5,
            "limit": limit,
        }

    monkeypatch.setattr("moe_lit.evaluation.suite.suite_scores", fake_suite_scores)
    spec = {
        **TINY,
        "seeds": [0],
        "fractions": [0.5],
        "methods": ["maestro", "naee"],
        "tasks": True,
        "task_limit": 8,
        "single_language_calibration": ["de"],
        "single_language_methods": ["maestro"],
    }
    records = {
        r["name"]: r for r in run_study(parse_study(spec, str(tmp_path / "data")), tmp_path / "out", log=lambda _: None)
    }
    assert all(r["status"] == "ok" for r in records.values()), [r.get("error") for r in records.values()]
    original, pruned, recovered = (records[n] for n in ("original", "maestro/50%/pruned", "maestro/50%/recovered"))
    assert pruned["steps"] == 0 and recovered["steps"] == 2 and records["original/recovered"]["steps"] == 2
    assert pruned["val_loss"] != original["val_loss"]  # evaluated after pruning, not the parent again
    assert pruned["kept_experts"] == [2, 2] and records["naee/50%/recovered"]["kept_experts"] == [2, 2]
    assert pruned["params_before"] == original["total_params"]
    assert (
        pruned["params_saved"] == 2 * 2 * 3 * 32 * 32 + 2 * 2 * 32
    )  # 2 layers x 2 experts x (w1, v1, w2), router rows
    assert pruned["val_loss_per_language"].keys() == original["val_loss_per_language"].keys() == {"en", "de", "ru"}
    # every point scored its final model on the run's data, with the study's limit
    assert calls == [("tokenizer.json", tmp_path / "data", 8)] * 6  # not the de-calibrated arm: val loss only
    assert pruned["suite_mean_acc"] == pytest.approx(0.75) and original["suite_mean_acc"] == pytest.approx(0.9)
    assert records["maestro/50%/pruned/calibration-de"]["calibration"] == "de"
    written = write_report(tmp_path / "out")
    summary = written["summary"].read_text()
    assert "| 50% | pruned | maestro |" in summary and "| retention: maestro - naee |" in summary
    # the claim, then its objects (paper / here), then its metric
    assert re.search(r"\| 50% removed, pruned: MAESTRO retains more[^|]*\|[^|]*\| task retention: maestro - ", summary)
    assert "maestro calibrated on de alone: de retains more" in summary
    assert "| 0.6250 (n=1) |" in summary  # task retention (0.75 - 0.5) / (0.9 - 0.5)
    assert "**untestable here**: no noise estimate: 1 seed" in summary  # one seed
    assert "params_saved" in written["runs_csv"].read_text().splitlines()[0]
    assert (tmp_path / "out" / "plots" / "retention.png").is_file()


TASK_CHANCE = {"moe_lit_next_en": 0.25, "moe_lit_pairs_en": 0.5, "moe_lit_next_de": 0.25, "moe_lit_pairs_de": 0.5}
TASK_ABOVE = {"moe_lit_next_en": 0.2, "moe_lit_pairs_en": 0.4, "moe_lit_next_de": 0.2, "moe_lit_pairs_de": 0.4}
"""The references' accuracy above chance (accuracy 0.45 and 0.9)."""


def _suite(retention=(1.0, 1.0, 1.0, 1.0)):
    """suite_scores-shaped: accuracy = chance + retention x the reference's margin, per task."""
    tasks = {t: TASK_CHANCE[t] + r * TASK_ABOVE[t] for t, r in zip(TASK_CHANCE, retention, strict=True)}
    return {"tasks": tasks, "chance": TASK_CHANCE, "languages": {"en": 0.0, "de": 0.0}}


def _task_records():
    """Parents and controls with suites; maestro / naee at 50% pruned with hand-chosen task retention
    (order next_en, pairs_en, next_de, pairs_de), and naee calibrated on de only."""
    records = [
        {**r, "suite": _suite()}
        for r in _records()
        if r.get("arm") in ("original", "control") and r["name"][-1] in "01"
    ]
    task_retention = {
        ("maestro", "mix"): [(1.0, 0.5, 1.0, 0.5), (0.8, 0.8, 0.8, 0.8)],
        ("naee", "mix"): [(0.5, 0.5, 0.5, 0.5), (0.6, 0.6, 0.6, 0.6)],
        ("naee", "de"): [(0.25, 0.25, 1.0, 1.0), (0.3, 0.3, 0.9, 0.9)],
    }
    loss_retention = {"mix": [(0.9, 0.9), (0.8, 0.8)], "de": [(0.7, 1.0), (0.5, 0.95)]}  # (en, de)
    for (method, calibration), per_seed in task_retention.items():
        for seed, retention in enumerate(per_seed):
            child = _child(method, 0.5, "pruned", seed, loss_retention[calibration][seed], suite=_suite(retention))
            if calibration != "mix":
                child |= {"name": f"{child['name']}/calibration-{calibration}"}
            records.append({**child, "calibration": calibration})
    return records


def test_task_retention_is_above_chance_and_calibration_arms_compare_to_the_mix_by_seed(tmp_path):
    analysis = analyse({"spec": {"calibration_languages": None}}, _task_records(), tmp_path)
    title = next(iter(analysis.tables))
    assert "task retention = (pruned - chance) / (original - chance)" in title
    rows = {(r["method"]): r for r in analysis.tables[title]}
    assert set(rows) == {"maestro", "naee"}  # the de-calibrated arm is not a row of the main table
    # maestro seed 0: tasks (1, .5, 1, .5): mean .75, variance .0625; per language (.2+.2)/(.6) = 2/3 both
    assert rows["maestro"]["task retention (mean over tasks)"] == "0.7750 ± 0.0354 (n=2)"
    assert rows["maestro"]["variance across tasks"] == "0.031250 ± 0.044194 (n=2)"
    assert rows["maestro"]["task variance across languages"] == "0.000000 ± 0.000000 (n=2)"
    claims = {(c.claim.text, c.claim.metric): c for c in analysis.claims}
    task = claims[("50% removed, pruned: MAESTRO retains more", "task retention")]
    assert task.claim.arms == ("maestro", "naee")
    assert _same(task.difference, paired_difference([0.75, 0.8], [0.5, 0.6]))
    variance = claims[("pruned: MAESTRO varies less across tasks", "variance of task retention")]
    assert _same(variance.difference, paired_difference([0.0625, 0.0], [0.0, 0.0]))
    # naee on de only vs the mix, paired by seed: de's own retention (higher) and the others' (here en; lower)
    text = "naee calibrated on de alone"
    own, others = (
        claims[(f"{text}: de retains more", "val-loss retention")],
        claims[(f"{text}: the others retain less", "val-loss retention (others)")],
    )
    assert own.claim.arms == ("naee@de", "naee@mix") and own.claim.direction == "higher"
    assert _same(own.difference, paired_difference([1.0, 0.95], [0.9, 0.8]))
    assert _same(others.difference, paired_difference([0.7, 0.5], [0.9, 0.8])) and others.claim.direction == "lower"
    assert _same(
        claims[(f"{text}: de retains more", "task retention")].difference, paired_difference([1.0, 0.9], [0.5, 0.6])
    )
    task_others = claims[(f"{text}: the others retain less", "task retention (others)")]
    assert _same(task_others.difference, paired_difference([0.25, 0.3], [0.5, 0.6]))
    per_language = analysis.tables["Task retention per language at 50% removed (mean over seeds)"]
    assert {"arm": "pruned", "method": "naee", "calibration": "de", "de": "0.9500", "en": "0.2750"} in per_language
    assert [p.name for p in analysis.plots] == ["retention.png", "task_retention.png"]


def test_task_margin_leaves_out_tasks_the_reference_does_not_solve(tmp_path):
    records = _task_records()
    for record in records:
        if record.get("arm") in ("original", "control"):
            record["suite"] = {**record["suite"], "tasks": {**record["suite"]["tasks"], "moe_lit_next_de": 0.26}}
    values = retention_values(records, task_margin=0.02)
    maestro = values[(0.5, "pruned", "maestro", "mix")]
    assert maestro["tasks_left_out"] == {0: 1, 1: 1}
    # seed 1: next_de left out; the other three at 0.8
    assert maestro["task_mean"][1] == pytest.approx(0.8)

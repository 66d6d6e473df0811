"""The pruning kind: points and parent links, retention and MAESTRO's verdicts on hand-made records,
errors naming the field, and a tiny real study (pretrain -> prune -> evaluate / recover)."""

import pytest

from moe_lit.config import ConfigError
from moe_lit.convert.importance import METHODS
from moe_lit.studies.kinds.pruning import analyse
from moe_lit.studies.stats import compare_paired, format_comparison
from moe_lit.studies.study import load_study, parse_study

TINY = {
    "name": "prune",
    "kind": "pruning",
    "seeds": [0, 1],
    "run": {
        "data": {"data_dir": "some/data", "seq_len": 16, "batch_size": 2, "val_batches": 1},
        "optim": {"warmup_steps": 1},
        "train": {"max_steps": 4, "val_every": 4},
        "trainer": {"enable_progress_bar": False, "accelerator": "cpu"},
    },
    "model": {
        "vocab_size": 300,
        "d_model": 32,
        "n_layers": 2,
        "n_heads": 2,
        "d_ff": 64,
        "moe": {"num_experts": 4, "expert_size": 32, "top_k": 1},
    },
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
        assert child.transform.path == "moe_lit.studies.kinds.pruning:prune_by_importance"
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
        assert child.measure.path == "moe_lit.studies.kinds.pruning:measure_memory"
        assert child.info["method"] == "maestro" and child.info["fraction"] == 0.5
    assert pruned.info["reference"] == "original/s1" and recovered.info["reference"] == "original/recovered/s1"
    assert pruned.run.steps == 0  # evaluated as it is: the run only validates
    assert recovered.run == control.run
    assert recovered.run.steps == 2 and recovered.run.optim.warmup_steps == 1 and recovered.run.train.seed == 1
    assert by_name["random/25%/pruned/s0"].transform.kwargs["fraction"] == 0.25
    assert len({p.hash for p in points}) == len(points)


def test_the_shipped_study_prunes_e16_top2_parents_over_three_seeds():
    study = load_study("configs/studies/pruning.yaml")
    assert study.header.seeds == [0, 1, 2] and len(study.points) == 3 * (2 + len(METHODS) * 2 * 2)
    moe = study.points[0].model.moe
    assert (moe.num_experts, moe.top_k) == (16, 2) and study.spec.fractions == [0.25, 0.5]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"fractions": [0.5, 1.0]}, "fractions: each must be in (0, 1), got 1.0"),
        ({"fractions": [0.95]}, "fractions: fraction/num: removing 4 of the 4 experts"),
        (
            {"fractions": [0.75], "model": {**TINY["model"], "moe": {"num_experts": 4, "expert_size": 32, "top_k": 2}}},
            "fractions: 0.75 keeps 1 of 4 experts, fewer than top_k=2",
        ),
        ({"methods": ["maestro", "magic"]}, "methods: unknown ['magic'], allowed values: maestro, frequency"),
        ({"model": {k: v for k, v in TINY["model"].items() if k != "moe"}}, "model.moe: the parent must be an MoE"),
        ({"calibration_split": "dev"}, "calibration_split: got 'dev', allowed values: train, val, test"),
        ({"recovery_steps": 0}, "recovery_steps: must be a positive integer, got 0"),
        ({"damping": 0.0}, "damping: must be in (0, 1], got 0.0"),
        ({"colour": 1}, "study: unknown key(s) ['colour']"),
    ],
)
def test_spec_errors_name_the_field(change, message):
    with pytest.raises(ConfigError) as info:
        parse_study({**TINY, **change})
    assert message in str(info.value)


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
    mean_pruned, var_pruned, mean_recovered, var_recovered = analysis.findings
    assert "maestro vs the best baseline (frequency)" in mean_pruned  # random (retention 1.0) is not a baseline
    # paired by seed (both methods prune the same parent): differences 0.4 and 0.35
    assert format_comparison(compare_paired([0.9, 0.8], [0.5, 0.45])) in mean_pruned
    assert "diff 0.3750 ± 0.0250 (paired t=15.00, p=0.042): significant" in mean_pruned
    assert mean_pruned.endswith("**reproduced**.")
    assert format_comparison(compare_paired([0.01, 0.0], [0.0, 0.0025]), digits=6) in var_pruned
    assert var_pruned.endswith("**not reproduced**.")  # maestro's variance is the higher one
    assert "diff 0.1500 ± 0.1500 (paired t=1.00, p=0.5): within noise" in mean_recovered
    assert mean_recovered.endswith("**not reproduced**.")
    assert var_recovered.endswith("**not reproduced**.")  # equal variances (0 and 0)
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
    assert all("not tested" in finding for finding in analyse({}, records, tmp_path).findings)


@pytest.mark.slow
def test_tiny_study_end_to_end(tmp_path):
    from moe_lit.data.prepare import PrepareConfig, prepare
    from moe_lit.studies.report import write_report
    from moe_lit.studies.study import run_study
    from tests.helpers.corpus import write_corpus

    corpus = write_corpus(tmp_path / "corpus", files=2, paragraphs=30)
    prepare(
        PrepareConfig(
            source=str(corpus),
            out=tmp_path / "data",
            vocab_size=300,
            val_fraction=0.2,
            test_fraction=0.2,
            progress=False,
        )
    )
    spec = {**TINY, "seeds": [0], "fractions": [0.5], "methods": ["maestro", "naee"]}
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
    written = write_report(tmp_path / "out")
    summary = written["summary"].read_text()
    assert "| 50% | pruned | maestro |" in summary and "maestro vs the best baseline (naee)" in summary
    assert "not testable (n < 2)" in summary  # one seed
    assert "params_saved" in written["runs_csv"].read_text().splitlines()[0]
    assert (tmp_path / "out" / "plots" / "retention.png").is_file()

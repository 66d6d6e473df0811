import json

import pytest

from moe_lit.config import ConfigError
from moe_lit.studies.upcycling import FIXED_E, FIXED_ME, UpcyclingStudySpec, analyse, run_study

TINY = dict(
    model=dict(vocab_size=300, d_model=32, n_layers=1, n_heads=2, seq_len=16, d_ff=64,
               moe=dict(num_experts=2, expert_size=16, top_k=1, balancing="bias")),
    optim=dict(lr=3e-3, warmup_steps=1), total_steps=6, expand_at=4, utility_batches=2, val_every=2,
    val_batches=1, batch_size=2, selections=["utility"], optimizer_states=["copy"], accelerator="cpu",
    timing_rounds=2,
)


def _record(arm, experts, final, curve_steps=(2, 4, 6), events=()):
    return {
        "arm": arm, "num_experts_final": experts, "flops_per_step": {"E": 10, "mE": 11},
        "curve": [{"step": s, "val_loss": final + (6 - s) * 0.1} for s in curve_steps],
        "step_seconds_median": 99.0,  # in-run timing: not what the compute estimate uses
        "steps_trained": 6, "wall_s": 1.0, "events": list(events),
        "val_probe": {"before": 3.0, "after": 3.25} if events else {},
    }


def test_analysis_compute_saving_gap_closure_and_jump():
    spec = UpcyclingStudySpec(**{**TINY, "total_steps": 10, "expand_at": 4})
    event = {"step": 4, "loss_before": 3.1, "loss_after": 3.4}
    records = {
        FIXED_E: _record(FIXED_E, 2, 3.0, curve_steps=(2, 4, 6, 8, 10)),
        FIXED_ME: _record(FIXED_ME, 4, 2.5, curve_steps=(2, 4, 6, 8, 10)),
        "up_utility_copy": _record("up_utility_copy", 4, 2.8, curve_steps=(4, 6, 8, 10), events=[event]),
    }
    analysis = analyse(spec, records, {"E": 1.0, "mE": 2.0})
    assert analysis["C_fixed"] == 20.0  # T * s_mE
    assert analysis["C_up"] == 4 * 1.0 + 6 * 2.0
    assert analysis["saving_pct"] == pytest.approx(20.0)
    up = next(r for r in analysis["rows"] if r["arm"] == "up_utility_copy")
    assert up["gap closure eta"] == pytest.approx((3.0 - 2.8) / (3.0 - 2.5))
    (jump,) = analysis["jumps"]
    assert jump["val jump"] == pytest.approx(0.25) and jump["batch loss after"] == 3.4
    assert jump["val change over next 2 steps"] == pytest.approx(-0.2)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(expand_at=5), "upcycling.expand_at: must be a multiple of val_every=2"),
        (dict(expand_at=2), "upcycling.expand_at: must lie between utility_batches=2 and total_steps=6"),
        (dict(selections=["best"]), "upcycling.selections: got \\['best'\\], allowed values: uniform, utility"),
        (dict(factor=1), "upcycling.factor: must be >= 2"),
    ],
)
def test_spec_errors_name_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        UpcyclingStudySpec(**{**TINY, **change})


def test_unknown_yaml_key_is_named(tmp_path):
    (tmp_path / "s.yaml").write_text("total_step: 5\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['total_step'\]"):
        UpcyclingStudySpec.from_yaml(tmp_path / "s.yaml")


@pytest.mark.slow
def test_tiny_study_end_to_end_and_resume(tmp_path):
    from moe_lit.data.prepare import PrepareConfig, prepare
    from tests.data.conftest import write_corpus

    corpus = write_corpus(tmp_path / "corpus", files=2, paragraphs=30)
    prepare(PrepareConfig(source=str(corpus), out=tmp_path / "data", vocab_size=300, val_fraction=0.2,
                          test_fraction=0.1, progress=False))
    spec = UpcyclingStudySpec(**TINY, data_dir=str(tmp_path / "data"))
    paths = run_study(spec, tmp_path / "out", log=lambda _: None)
    results = json.loads(paths["results"].read_text())
    up = results["arms"]["up_utility_copy"]
    assert up["num_experts_final"] == 4 and up["events"][0]["step"] == 4
    assert up["val_probe"]["after"] == pytest.approx(up["val_probe"]["before"], abs=1e-5)  # top-1: exact
    assert [p["step"] for p in results["arms"][FIXED_E]["curve"]] == [2, 4, 6]
    assert paths["plot"].stat().st_size > 0 and "gap closure" in paths["summary"].read_text()
    times = json.loads((tmp_path / "out" / "step_times.json").read_text())
    assert results["analysis"]["s_E"] == times["E"] > 0 and times["mE"] > 0
    skipped = []
    run_study(spec, tmp_path / "out", log=skipped.append)  # finished arms are not trained again
    assert skipped == [f"{arm}: done before, skipped" for arm in spec.arms()]

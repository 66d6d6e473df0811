import pytest

from moe_lit.accounting import count_config_params
from moe_lit.config import ConfigError
from moe_lit.studies.study import load_study, parse_study
from tests.helpers.paths import STUDIES
from tests.helpers.studies import small_spec


def test_expansion_is_the_grid_plus_ablations_deduplicated():
    points = parse_study(small_spec()).points
    groups = {p.name: p.info["groups"] for p in points}
    assert list(groups) == [
        "S/dense",
        "S/E4k2",
        "S/E8k2",
        "M/dense",
        "M/E4k2",
        "M/E8k2",
        "M/E4k1",
        "M/E8k1",
        "M/E8k4",  # granularity: k=4 skipped at E=4 (every expert active)
        "M/E4k2/shared=0.5",
        "M/E4k2/profile=skewed",
        "M/E4k2/bias=0.001",
        "M/E4k2/cf=1",
        "M/E4k2/cf=2",
        "M/E4k2/total",
        "M/E4k2/cf=1/dropless-val",  # each capacity-limited point validated dropless, after every trained point
        "M/E4k2/cf=2/dropless-val",
    ]
    # the reference point is one run that appears in every ablation, with its label in each group;
    # the aux_loss=0.01 balancing variant IS the reference (default coefficient) and merges into it
    assert groups["M/E4k2"] == {
        "grid": "E4k2",
        "shared": "none",
        "heterogeneous": "equal",
        "balancing": "aux_loss=0.01",
        "capacity": "dropless",
        "matching": "active-matched",
    }
    assert groups["M/dense"] == {"grid": "dense", "matching": "dense"}
    assert groups["M/E4k2/cf=2"] == {"capacity": "cf=2"}
    assert len({p.hash for p in points}) == len(points)
    ref = next(p for p in points if p.name == "M/E4k2/cf=2")
    assert ref.model.moe.capacity_factor == 2.0 and ref.model.moe.expert_size == 63


def test_seeds_multiply_points_and_hashes_follow_what_determines_a_run():
    points = parse_study(small_spec(seeds=[0, 1], ablations=None)).points
    assert len(points) == 2 * 3 * 2
    assert [p.name for p in points[:2]] == ["S/dense/s0", "S/E4k2/s0"]
    assert {p.config_name for p in points if p.seed == 1} == {p.config_name for p in points if p.seed == 0}
    assert points[0].run.train.seed == 0 and points[1 + len(points) // 2].run.train.seed == 1
    renamed = parse_study(small_spec(name="other", seeds=[0, 1], ablations=None, description="x")).points
    assert [p.hash for p in renamed] == [p.hash for p in points]  # stable: no names, no order
    run = small_spec()["run"]
    longer = parse_study(small_spec(ablations=None, run={**run, "train": {"max_tokens": 8192}})).points
    assert not {p.hash for p in longer} & {p.hash for p in points}


def _rounding_slack(point, mode):
    """Largest mismatch from rounding expert sizes to integers: half a row (3*d params) per expert
    counted (k active ones, or all E), in every layer."""
    d, moe = point.model.d_model, point.model.moe
    return point.model.n_layers * 3 * d * (moe.top_k if mode == "active" else moe.num_experts) / 2


def test_matched_configs_hit_their_budget():
    study = parse_study(small_spec())
    for point in study.points:
        dense = count_config_params(study.spec.dense_model(point.info["budget"]))
        counts = count_config_params(point.model)
        if point.model.moe is None:
            assert counts.total == counts.active == dense.total
            continue
        mode = point.info["match"]
        got, want = (counts.active, dense.active) if mode == "active" else (counts.total, dense.total)
        assert abs(got - want) <= _rounding_slack(point, mode), point.name
        if mode == "active":
            assert counts.total > dense.total  # the sparse model holds more parameters than it uses
        else:
            assert counts.active < dense.active


def test_shipped_studies_load_and_expand():
    tiny = load_study(STUDIES / "dense_vs_sparse.yaml").points
    assert len(tiny) == (14 + 1) * 4  # 14 configurations and cf=1 validated dropless, x 4 seeds
    grid = [p for p in tiny if "grid" in p.info["groups"]]
    assert [p.name for p in tiny if p.run.steps == 0] == [f"M/E8k2/cf=1/dropless-val/s{s}" for s in range(4)]
    assert {(p.model.moe.num_experts, p.model.moe.top_k) if p.model.moe else 1 for p in grid} == {
        1,
        (8, 2),
        (8, 4),
        (32, 2),
        (32, 4),
    }
    gpu = load_study(STUDIES / "dense_vs_sparse_gpu.yaml").points
    assert len(gpu) > len(tiny)
    for other in ("upcycling-e8-e32", "language_expansion"):
        assert load_study(STUDIES / f"{other}.yaml").points


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"grid": {"num_experts": ["dense", 1]}},
            "grid.num_experts: [1] not allowed, each must be 'dense' or an integer >= 2",
        ),
        ({"grid": {"match": ["params"]}}, "grid.match: got 'params', allowed values: active, total"),
        ({"grid": {"experts": [4]}}, "grid: unknown key(s) ['experts']"),
        ({"grid": {"moe": {"top_k": 3}}}, "grid.moe: unknown or solved field(s) ['top_k']"),
        ({"ablations": {"budget": "XL"}}, "ablations.budget: got 'XL', allowed values: S, M"),
        (
            {"ablations": {"budget": "M", "num_experts": 4, "size_profiles": {"bad": [1, 2]}}},
            "ablations.size_profiles.bad: needs num_experts=4 positive numbers",
        ),
        ({"ablations": {"budget": "M", "balancing": [{"balancing": "magic"}]}}, "moe.balancing: got 'magic'"),
        ({"base": {"d_model": 32, "n_heads": 4, "moe": {"num_experts": 4}}}, "base.moe: must be dense (moe: null)"),
        (
            {"base": {"d_model": 32, "n_heads": 4, "seq_len": 64}},
            "base.seq_len: set the sequence length in run.data.seq_len",
        ),
        ({"budgets": [{"name": "S", "d_fff": 1}]}, "budgets[S].overrides: unknown model field(s) ['d_fff']"),
        ({"budgets": [{"name": "S", "d_ff": 0}]}, "budgets[S]: model.d_ff: must be a positive integer"),
        ({"run": {"optim": {"lr": -1}}}, "optim.lr: must be > 0"),
        ({"run": {"data": {"batch_size": 0}}}, "data.batch_size: must be a positive integer"),
        ({"run": {"train": {"max_tokens": 10, "max_steps": 3}}}, "train.max_tokens: set exactly one"),
        ({"run": {"colour": 1}}, "run: unknown key(s) ['colour']"),
        ({"kind": "magic"}, "kind: got 'magic', allowed values: dense_vs_sparse"),
        ({"seeds": [0, 0]}, "seeds: must be a non-empty list of distinct integers"),
        ({"data": {"vocab_sise": 2048}}, "data: unknown key(s) ['vocab_sise']"),
        ({"colour": "red"}, "study: unknown key(s) ['colour']"),
    ],
)
def test_bad_specs_name_the_field(changes, message):
    with pytest.raises(ConfigError) as info:
        parse_study(small_spec(**changes))
    assert message in str(info.value)


# ----------------------------------------------------------------------------- plots
def _record(config, seed, loss, groups, num_experts=4, top_k=2, total=2000, active=1000, match="active"):
    return {
        "status": "ok",
        "name": config,
        "config_name": config,
        "seed": seed,
        "val_loss": loss,
        "budget": config.split("/")[0],
        "groups": groups,
        "match": match,
        "num_experts": num_experts,
        "top_k": top_k,
        "expert_size": 128.0 / top_k,
        "total_params": total,
        "active_params": active,
        "active_non_embedding": active,
        "flops_per_token": 2 * active,
        "tokens_per_s": 1000.0,
    }


def _plot_records(seeds=(0, 1)):
    bump = {0: 0.0, 1: 0.2}
    records = []
    for seed in seeds:
        b = bump[seed]
        records += [
            _record("S/dense", seed, 4.0 + b, {"grid": "dense"}, num_experts=1, top_k=1, total=900, active=900),
            _record("S/E4k2", seed, 3.9 + b, {"grid": "E4k2"}, active=900),
            _record("M/dense", seed, 3.8 + b, {"grid": "dense", "matching": "dense"}, 1, 1, 1000),
            _record("M/E4k2", seed, 3.7 + b, {"grid": "E4k2", "shared": "none", "matching": "active-matched"}),
            _record("M/E4k1", seed, 3.75 + b, {"granularity": "k=1"}, top_k=1),
            _record("M/E4k2/shared=0.5", seed, 3.6 + b + 0.05 * seed, {"shared": "0.5"}, total=1500),
            _record(
                "M/E4k2/total", seed, 3.9 + b, {"matching": "total-matched"}, total=1000, active=600, match="total"
            ),
        ]
    return records


def _plot_rows(seeds=(0, 1)):
    from moe_lit.studies.report import aggregate

    return aggregate(_plot_records(seeds))


ABLATION = {"budget": "M", "num_experts": 4, "top_k": 2}


def _close(fig):
    from moe_lit.plotting import pyplot

    pyplot().close(fig)


@pytest.mark.parametrize("seeds, note, has_bars", [((0, 1), "bars: ± std over 2 seeds", True), ((0,), "1 seed", False)])
def test_total_params_plot_has_seed_error_bars_or_says_there_are_none(seeds, note, has_bars):
    from moe_lit.studies.kinds.dense_vs_sparse import total_params_figure

    fig = total_params_figure(_plot_rows(seeds))
    (ax,) = fig.axes
    assert note in ax.get_title()
    assert [c.has_yerr for c in ax.containers] == [has_bars, has_bars]  # a line per budget
    if has_bars:
        (segments,) = ax.containers[0].lines[2]
        assert abs(segments.get_segments()[0][1][1] - segments.get_segments()[0][0][1]) == pytest.approx(
            2 * 0.2 / 2**0.5
        )
    _close(fig)


def test_the_kind_draws_one_plot_of_its_own(tmp_path):
    from moe_lit.studies.kinds.dense_vs_sparse import analyse

    analysis = analyse({"spec": {"ablations": ABLATION, "margin": 0.1}}, _plot_records((0, 1)), tmp_path)
    assert analysis.plots == [tmp_path / "loss_vs_total_params.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss_vs_total_params.png"]


def test_ablations_are_claims_paired_with_the_reference_and_findings():
    from moe_lit.studies.kinds.dense_vs_sparse import claims, findings

    rows = _plot_rows()
    tested = {c.claim.text: c for c in claims(rows, ABLATION, margin=0.1)}
    shared = tested["shared: 0.5 matters little"]
    assert shared.claim.arms == ("M/E4k2/shared=0.5", "M/E4k2")
    assert shared.difference.paired and shared.difference.estimate == pytest.approx(-0.075)  # -0.1 and -0.05
    assert not [t for t in tested if "matching" in t or "total-matched" in t]  # matching: a finding, no claim
    assert "- **shared**: none 3.8000, 0.5 3.7250." in findings(rows)
    assert "- **matching**: dense 3.9000, active-matched 3.8000, total-matched 4.0000." in findings(rows)
    assert not [c for c in claims(rows) if "matters little" in c.claim.text]  # no ablations declared: none tested


def _granularity_rows(e32_k4_shift: float):
    """M: E8 and E32 at top-2 and top-4 over 3 seeds; top-4 is 0.05 better at E8 and by
    0.05 - ``e32_k4_shift`` at E32, with seed noise shared by the arms of a seed."""
    from moe_lit.studies.report import aggregate

    noise = {0: 0.0, 1: 0.03, 2: -0.02}
    records = []
    for seed, n in noise.items():
        records += [
            _record("M/E8k2", seed, 3.70 + n, {"grid": "E8k2"}, num_experts=8),
            _record("M/E8k4", seed, 3.65 + n + 0.002 * seed, {"grid": "E8k4"}, num_experts=8, top_k=4),
            _record("M/E32k2", seed, 3.60 + n, {"grid": "E32k2"}, num_experts=32),
            _record("M/E32k4", seed, 3.55 + n + e32_k4_shift - 0.001 * seed, {"grid": "E32k4"}, 32, 4),
        ]
    return aggregate(records)


@pytest.mark.parametrize("shift, verdict", [(0.0, "reproduced"), (0.2, "contradicted")])
def test_the_expert_size_claim_is_a_paired_interaction_of_top_k_and_e(shift, verdict):
    from moe_lit.studies.kinds.dense_vs_sparse import claims
    from moe_lit.studies.verdicts import judge

    (evidence,) = [c for c in claims(_granularity_rows(shift), margin=0.03) if "expert size" in c.claim.text]
    assert evidence.claim.text.startswith("M: E32's top-2 vs top-4 effect is E8's")
    assert evidence.difference.paired and evidence.difference.estimate == pytest.approx(0.003 - shift, abs=1e-9)
    (judged,) = judge([evidence])
    assert judged.word == verdict


# ----------------------------------------------------------------------------- dropless validation
def test_a_capacity_limited_point_has_a_0_step_child_validating_its_weights_dropless():
    from moe_lit.convert.common import dropless
    from moe_lit.studies.identity import finalize

    points = {p.name: p for p in parse_study(small_spec(seeds=[0, 1])).points}
    parent, child = points["M/E4k2/cf=1/s1"], points["M/E4k2/cf=1/dropless-val/s1"]
    assert (child.start.parent, child.start.mode, child.start.step) == (parent.name, "init", None)
    assert child.run.steps == 0 and child.seed == 1 and child.transform.resolve() is dropless
    assert child.model == parent.model.replace(moe={"capacity_factor": None})
    assert child.info == {**parent.info, "groups": {}, "validation": "dropless"}
    assert finalize([parent])[0].hash == parent.hash  # the child re-plans no committed point
    assert not [p for p in points.values() if p.run.steps == 0 and "/cf=" not in p.name]  # dropless ones have none


def test_the_dropless_transform_keeps_the_weights_and_only_stops_dropping():
    import torch

    from moe_lit.config import ModelConfig
    from moe_lit.convert.common import dropless
    from moe_lit.model import Transformer

    moe = {"num_experts": 4, "expert_size": 16, "top_k": 2, "capacity_factor": 0.5}
    cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, d_ff=64, seq_len=16, moe=moe)
    torch.manual_seed(0)
    model, idx = Transformer(cfg).eval(), torch.randint(0, 97, (2, 16))
    reference = Transformer(cfg.replace(moe={"capacity_factor": None})).eval()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        before = model(idx).logits_BLV
        out = dropless(model)
        assert out.config.moe.capacity_factor is None and model.config.moe.capacity_factor == 0.5
        assert torch.equal(out(idx).logits_BLV, reference(idx).logits_BLV)
        assert torch.equal(model(idx).logits_BLV, before)  # the source is untouched
        assert not torch.allclose(before, reference(idx).logits_BLV)  # it dropped tokens: dropless differs


def _capacity_rows(with_children: bool):
    from moe_lit.studies.report import aggregate

    records = []
    for seed, noise in enumerate((0.0, 0.03, -0.02)):
        records += [
            _record("M/E4k2", seed, 3.70 + noise, {"capacity": "dropless"}),
            _record("M/E4k2/cf=1", seed, 3.80 + noise + 0.002 * seed, {"capacity": "cf=1"}),
        ]
        child = _record("M/E4k2/cf=1/dropless-val", seed, 3.72 + noise + 0.001 * seed, {})
        records += [child | {"validation": "dropless"}] if with_children else []
    return aggregate(records)


def test_dropless_beats_dropping_is_tested_on_the_weights_validated_dropless():
    from moe_lit.studies.kinds.dense_vs_sparse import claims, findings, summary_rows

    rows = _capacity_rows(with_children=True)
    (evidence,) = claims(rows, ABLATION)
    assert evidence.claim.text == "dropless beats token dropping (cf=1)" and not evidence.reason
    assert evidence.claim.arms == ("M/E4k2", "M/E4k2/cf=1/dropless-val")
    assert evidence.difference.paired and evidence.difference.estimate == pytest.approx(-0.021)  # not -0.1
    assert "- **capacity**: dropless 3.7033, cf=1 3.8053 (validated dropless 3.7243)." in findings(rows)
    table = {r["point"]: r for r in summary_rows(rows)}
    assert list(table) == ["M/E4k2", "M/E4k2/cf=1"]  # the child is a column of its parent, not a row
    assert table["M/E4k2/cf=1"]["val loss"] == "3.8053 ± 0.0244"  # as validated with its capacity: 3.8, 3.832, 3.784
    assert table["M/E4k2/cf=1"]["val loss, dropless"] == "3.7243 ± 0.0248"  # seeds 3.72, 3.751, 3.702
    assert table["M/E4k2"]["val loss, dropless"] == ""
    assert not [r for r in summary_rows(_capacity_rows(with_children=False)) if "val loss, dropless" in r]


def test_without_its_dropless_validation_the_capacity_claim_is_untestable_here():
    from moe_lit.studies.kinds.dense_vs_sparse import DROPPING_AT_VALIDATION, claims

    (evidence,) = claims(_capacity_rows(with_children=False), ABLATION)
    assert evidence.claim.arms == ("M/E4k2", "M/E4k2/cf=1") and evidence.reason == DROPPING_AT_VALIDATION
    assert evidence.difference.estimate == pytest.approx(-0.102)  # the mixed contrast stays, as a finding


@pytest.mark.slow
def test_a_trained_capacity_point_is_validated_dropless_from_its_final_weights(tmp_path):
    from moe_lit.studies.study import run_study
    from tests.helpers.corpus import write_corpus
    from tests.helpers.studies import trained_spec

    corpus = write_corpus(tmp_path / "corpus", files=2, paragraphs=30)
    ablations = {"budget": "S", "num_experts": 4, "top_k": 2, "capacity_factor": [0.25]}
    spec = parse_study(trained_spec(tmp_path, corpus, steps=3, ablations=ablations))
    records = {r["name"]: r for r in run_study(spec, tmp_path / "out", log=lambda _: None)}
    parent, child = records["S/E4k2/cf=0.25"], records["S/E4k2/cf=0.25/dropless-val"]
    assert child["status"] == "ok", child.get("error")
    assert (parent["steps"], child["steps"], child["parent"]) == (3, 0, "S/E4k2/cf=0.25")
    assert child["model"]["moe"]["capacity_factor"] is None and child["capacity_factor"] == 0.25  # trained with
    assert child["val_loss"] != parent["val_loss"]  # the same weights, no token dropped at validation

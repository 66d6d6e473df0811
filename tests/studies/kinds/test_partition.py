"""The partition kind: points and parent links, one recovery budget for all, analysis on
hand-made records, bad fields, and a tiny real study (pretrain, convert, recover, measure)."""

import math

import pytest

from moe_lit.config import ConfigError
from moe_lit.studies.kinds.partition import analyse, chance_retention
from moe_lit.studies.study import parse_study
from moe_lit.studies.verdicts import NOT_DETECTED, UNTESTABLE, judge
from tests.helpers.corpus import prepare_corpus

TINY = {
    "name": "part",
    "kind": "partition",
    "seeds": [0, 1],
    "run": {
        "data": {"seq_len": 16, "batch_size": 2, "val_batches": 1},
        "optim": {"lr": 0.003, "warmup_steps": 1},
        "train": {"max_steps": 4, "val_every": 2},
        "trainer": {"enable_progress_bar": False, "accelerator": "cpu"},
    },
    "dense": {"vocab_size": 300, "d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64},
    "settings": [{"experts": 8, "top_k": 4}, {"experts": 16, "top_k": 8}, {"experts": 8, "top_k": 2}],
    "methods": [
        {"method": "random", "router": "random"},
        {"method": "kmeans"},
        {"method": "coactivation", "router": "trained"},
        {"method": "dot_moe"},
    ],
    "conversion": {"calibration_tokens": 64, "train_tokens": 64, "batch_size": 2, "router_steps": 3},
    "recovery": {"steps": 2, "lr": 0.001, "warmup": 1},
}


def test_every_conversion_forks_from_its_seeds_pretrained_dense_with_one_recovery_budget():
    study = parse_study(TINY)
    points = {p.name: p for p in study.points}
    assert len(points) == 2 * (1 + 1 + 3 * 4 + 2)  # per seed: pretrain, dense, 3 settings x 4 methods, 2 prunings
    s0 = [p for p in study.points if p.seed == 0]
    assert [p.config_name for p in s0[:3]] == ["dense/pretrain", "dense/recovered", "E8k4/random+random"]
    assert {p.config_name for p in s0 if p.info["method"] == "pruning"} == {"pruning/ffn0.5", "pruning/ffn0.25"}
    children = [p for p in study.points if p.start is not None]
    parents = {(p.start.parent, p.start.mode) for p in children}
    assert parents == {("dense/pretrain/s0", "init"), ("dense/pretrain/s1", "init")}
    assert all(p.start.parent.endswith(f"/s{p.seed}") for p in children)
    assert len({(p.run.steps, p.run.optim.lr, p.run.optim.warmup_steps, p.run.data.batch_size) for p in children}) == 1
    assert children[0].run.steps == 2 and points["dense/pretrain/s0"].run.steps == 4
    dense = points["dense/recovered/s1"]
    assert dense.transform is None and dense.measure is None and dense.model.moe is None
    kmeans = points["E16k8/kmeans+centroid/s1"]
    assert kmeans.transform.name == "partition_on_stream" and kmeans.measure is not None
    assert (kmeans.model.moe.num_experts, kmeans.model.moe.top_k, kmeans.model.moe.unit_weights) == (16, 8, True)
    assert kmeans.transform.kwargs["seed"] == 1 and kmeans.info["conversion_tokens"] == 0
    # only what a method reads is in its arguments (and its hash): DOT-MoE's lr is not kmeans'
    assert "lr" not in kmeans.transform.kwargs and "calibration_tokens" not in kmeans.transform.kwargs
    coact = points["E8k2/coactivation+trained/s0"].transform.kwargs
    assert (coact["calibration_tokens"], coact["router_steps"], coact["router"]) == (64, 3, "trained")
    assert points["E8k4/dot_moe/s0"].transform.kwargs["train_tokens"] == 64
    pruned = points["pruning/ffn0.25/s0"]
    assert pruned.model.d_ff == 16 and pruned.info["conversion_tokens"] == 64  # 2 whole batches of 2 x 16
    changed = parse_study({**TINY, "conversion": {**TINY["conversion"], "lr": 0.5}})
    hashes = {p.name: p.hash for p in changed.points}
    assert hashes["E8k4/kmeans+centroid/s0"] == points["E8k4/kmeans+centroid/s0"].hash
    assert hashes["E8k4/dot_moe/s0"] != points["E8k4/dot_moe/s0"].hash


def test_suite_adds_one_zero_step_measuring_child_per_recovered_model_and_keeps_every_other_hash():
    plain = {p.name: p for p in parse_study(TINY).points}
    study = parse_study({**TINY, "suite": {"limit": 5}})
    suite = [p for p in study.points if p.info["phase"] == "suite"]
    recovered = [p for p in plain.values() if p.info["phase"] == "recovered"]
    assert len(suite) == len(recovered) == 2 * (1 + 3 * 4 + 2)
    assert {p.start.parent for p in suite} == {p.name for p in recovered}
    child = {p.name: p for p in suite}["E8k4/dot_moe/suite/s1"]
    assert (child.start.parent, child.start.mode, child.run.steps, child.seed) == ("E8k4/dot_moe/s1", "init", 0, 1)
    assert child.transform is None and child.model == plain["E8k4/dot_moe/s1"].model
    assert (child.measure.name, child.measure.kwargs) == (
        "local_suite",
        {"limit": 5, "batch_size": 32},
    )
    assert all(plain[p.name].hash == p.hash for p in study.points if p.info["phase"] != "suite")
    with pytest.raises(ConfigError, match="suite.limit: must be null or a positive integer, got 0"):
        parse_study({**TINY, "suite": {"limit": 0}})


@pytest.mark.parametrize(
    "change, message",
    [
        ({"methods": [{"method": "dot_moe", "router": "centroid"}]}, "methods[0].router: dot_moe learns its routers"),
        ({"methods": [{"method": "kmeans", "router": "best"}]}, "methods[0].router: got 'best', allowed values"),
        ({"methods": [{"method": "svd"}]}, "methods[0].method: got 'svd', allowed values: random, kmeans"),
        ({"settings": [{"experts": 5, "top_k": 2}]}, "settings[0].num_experts: must divide model.d_ff=64"),
        ({"recovery": {"steps": 2, "warmup": 2}}, "recovery.warmup: must be an integer in [0, steps)"),
        ({"conversion": {"train_tokens": 0}}, "conversion.train_tokens: must be a positive integer, got 0"),
        ({"recover": {"steps": 2}}, "study: unknown key(s) ['recover']"),
        (
            {"dense": {**TINY["dense"], "moe": {"num_experts": 4, "expert_size": 16}}},
            "dense.moe: the dense model must be dense",
        ),
    ],
)
def test_bad_fields_name_the_field(change, message):
    with pytest.raises(ConfigError) as err:
        parse_study({**TINY, **change})
    assert str(err.value).startswith(message), str(err.value)


def _rec(config, seed, loss, method, family, phase="recovered", setting=None, active_ffn=1.0, **extra):
    return {
        "name": f"{config}/s{seed}",
        "config_name": config,
        "seed": seed,
        "status": "ok",
        "val_loss": loss,
        "method": method,
        "family": family,
        "phase": phase,
        "setting": setting,
        "active_ffn": active_ffn,
        "router": extra.pop("router", None),
        "num_experts": extra.pop("experts", 1),
        "top_k": 1,
        "total_params": 100,
        "active_params": 50,
        "val_loss_per_language": {"en": loss - 0.1, "de": loss + 0.1},
        **extra,
    }


def test_gap_retention_orderings_and_plot_from_hand_made_records(tmp_path):
    records = []
    for seed, jitter in ((0, 0.0), (1, 0.02)):
        records += [
            _rec("dense/pretrain", seed, 4.0, "dense", "dense", phase="pretrain"),
            _rec("dense/recovered", seed, 3.9 + jitter, "dense", "dense"),
            _rec(
                "E8k4/random+random",
                seed,
                4.5 + jitter,
                "random",
                "random",
                setting="E8k4",
                active_ffn=0.5,
                router="random",
                experts=8,
                val_loss_converted=5.0,
            ),
            _rec(
                "E8k4/kmeans+centroid",
                seed,
                4.2 + jitter,
                "kmeans",
                "clustering",
                setting="E8k4",
                active_ffn=0.5,
                router="centroid",
                experts=8,
                val_loss_converted=4.6 + 2 * jitter,
            ),
            _rec(
                "E8k4/coactivation+trained",
                seed,
                4.3,
                "coactivation",
                "clustering",
                setting="E8k4",
                active_ffn=0.5,
                router="trained",
                experts=8,
            ),
            _rec(
                "E8k4/dot_moe", seed, 4.0 + 2 * jitter, "dot_moe", "dot_moe", setting="E8k4", active_ffn=0.5, experts=8
            ),
            _rec("pruning/ffn0.5", seed, 4.05 + jitter, "pruning", "pruning", active_ffn=0.5),
        ]
    records.append({**_rec("E8k4/dot_moe", 2, 9.0, "dot_moe", "dot_moe", setting="E8k4"), "status": "failed"})
    for seed, dense_acc, kmeans_acc in ((0, 0.70, 0.60), (1, 0.72, 0.66)):  # chance 0.5: above 0.2 vs 0.1, 0.22 vs 0.16
        for config, acc in (("dense/recovered", dense_acc), ("E8k4/kmeans+centroid", kmeans_acc)):
            scores = {"mean_acc": acc, "mean_above_chance": acc - 0.5}
            records.append(
                {
                    **_rec(f"{config}/suite", seed, 0.0, "x", "x", phase="suite"),
                    "parent": f"{config}/s{seed}",
                    "suite": scores,
                }
            )
    analysis = analyse({"spec": {"dense": {"vocab_size": 300}}}, records, tmp_path)
    main = analysis.tables["Conversions after the same recovery budget (mean ± std over seeds)"]
    rows = {r["point"]: r for r in main}
    assert list(rows) == [
        "dense/recovered",
        "E8k4/random+random",
        "E8k4/kmeans+centroid",
        "E8k4/coactivation+trained",
        "E8k4/dot_moe",
        "pruning/ffn0.5",
    ]
    # gap per seed: kmeans (4.2 - 3.9, 4.22 - 3.92) = (0.3, 0.3); dot_moe (0.1, 0.12); random (0.6, 0.6)
    assert rows["E8k4/kmeans+centroid"]["loss gap to dense"] == "0.3000 ± 0.0000 (n=2)"
    assert rows["E8k4/dot_moe"]["loss gap to dense"] == "0.1100 ± 0.0141 (n=2)"
    assert rows["dense/recovered"]["loss gap to dense"] == "0.0000 ± 0.0000 (n=2)"
    # before recovery, against the pretrained dense (4.0): kmeans (0.6, 0.64); the dense model itself 0
    assert rows["E8k4/kmeans+centroid"]["gap before recovery"] == "0.6200 ± 0.0283 (n=2)"
    assert rows["dense/recovered"]["gap before recovery"] == "0.0000 ± 0.0000 (n=2)"
    assert rows["E8k4/coactivation+trained"]["gap before recovery"] == ""
    chance = math.log(300)
    assert chance_retention(4.2, 3.9, 300) == pytest.approx((chance - 4.2) / (chance - 3.9))
    r0, r1 = chance_retention(4.5, 3.9, 300), chance_retention(4.52, 3.92, 300)
    assert rows["E8k4/random+random"]["retention"] == f"{(r0 + r1) / 2:.4f} ± {abs(r0 - r1) / math.sqrt(2):.4f} (n=2)"
    assert rows["E8k4/dot_moe"]["val loss"] == "4.0200 ± 0.0283 (n=2)"  # the failed seed is left out
    assert rows["E8k4/kmeans+centroid"]["task acc"] == "0.6300 ± 0.0424 (n=2)"
    r0, r1 = 0.1 / 0.2, 0.16 / 0.22
    assert (
        rows["E8k4/kmeans+centroid"]["task retention (above chance)"]
        == f"{(r0 + r1) / 2:.4f} ± {abs(r0 - r1) / math.sqrt(2):.4f} (n=2)"
    )
    assert rows["dense/recovered"]["task retention (above chance)"] == "1.0000 ± 0.0000 (n=2)"
    assert rows["E8k4/dot_moe"]["task acc"] == ""  # not measured
    languages = {r["point"]: r for r in analysis.tables["Val loss per language after recovery (mean over seeds)"]}
    assert languages["pruning/ffn0.5"] == {"point": "pruning/ffn0.5", "en": "3.9600", "de": "4.1600"}
    dot_vs_clust, clust_vs_random, dot_vs_pruning = judge(analysis.claims)
    # best clustering: kmeans (gaps 0.3, 0.3) beats coactivation (0.4, 0.38); DOT-MoE (0.1, 0.12) vs kmeans,
    # paired by seed (every conversion starts from its own seed's dense model): differences -0.2, -0.18
    assert dot_vs_clust.evidence.claim.text == "E8k4: DOT-MoE beats clustering"
    assert dot_vs_clust.evidence.claim.arms == ("E8k4/dot_moe", "E8k4/kmeans+centroid")
    d = dot_vs_clust.evidence.difference
    assert d.test == "paired t-test" and d.estimate == pytest.approx(-0.19) and d.p == pytest.approx(0.0335, abs=1e-3)
    # kmeans - random is -0.3 in both seeds: no noise estimate, so no verdict but untestable here
    assert clust_vs_random.word == UNTESTABLE and clust_vs_random.evidence.reason.startswith("no noise estimate")
    # DOT-MoE (0.1, 0.12) vs pruning (0.15, 0.15): -0.05, -0.03; Holm over the two tested claims
    assert dot_vs_pruning.evidence.claim.arms[1] == "pruning/ffn0.5"
    assert dot_vs_clust.p_holm == pytest.approx(2 * d.p) and dot_vs_clust.word == dot_vs_pruning.word == NOT_DETECTED
    assert analysis.findings[0].startswith("- Each family stands for its best configuration")
    assert [p.name for p in analysis.plots] == ["loss_gap.png"] and analysis.plots[0].stat().st_size > 0


@pytest.mark.slow
def test_tiny_study_end_to_end(tmp_path):
    from moe_lit.studies.report import write_report
    from moe_lit.studies.study import run_study

    prepare_corpus(tmp_path, paragraphs=30, val_fraction=0.2, test_fraction=0.1)
    spec = {
        **TINY,
        "seeds": [0],
        "settings": [{"experts": 4, "top_k": 2}],
        "methods": [{"method": "kmeans", "router": "trained"}, {"method": "dot_moe"}],
        "suite": {"limit": 2, "batch_size": 4},
    }
    records = {
        r["name"]: r for r in run_study(parse_study(spec, str(tmp_path / "data")), tmp_path / "out", log=lambda _: None)
    }
    measured = ["E4k2/dot_moe", "E4k2/kmeans+trained", "dense/recovered", "pruning/ffn0.5"]
    assert sorted(records) == sorted([*measured, *(f"{name}/suite" for name in measured), "dense/pretrain"])
    for name in measured:
        scores = records[f"{name}/suite"]["suite"]
        assert (
            scores["limit"] == 2 and 0.0 <= scores["mean_acc"] <= 1.0 and set(scores["languages"]) == {"en", "de", "ru"}
        )
    assert all(r["status"] == "ok" for r in records.values()), [r.get("error") for r in records.values()]
    dense, kmeans, pruned = records["dense/recovered"], records["E4k2/kmeans+trained"], records["pruning/ffn0.5"]
    assert all(r["steps"] == (0 if n.endswith("/suite") else 2) for n, r in records.items() if n != "dense/pretrain")
    assert kmeans["total_params"] == dense["total_params"] + 4 * 32 + 32  # the MoE adds router rows, expert bias
    ffn_half = 3 * 32 * 64 // 2  # w1, v1, w2 of half the neurons
    assert dense["active_params"] - kmeans["active_params"] == ffn_half - 4 * 32 - 32
    assert dense["active_params"] - pruned["active_params"] == ffn_half
    for record in (kmeans, pruned, records["E4k2/dot_moe"]):
        assert math.isfinite(record["val_loss_converted"]) and set(record["val_loss_converted_per_language"]) == {
            "en",
            "de",
            "ru",
        }
    assert "val_loss_converted" not in dense
    paths = write_report(tmp_path / "out")
    summary = paths["summary"].read_text()
    assert (
        "E4k2: DOT-MoE beats pruning" in summary
        and "no noise estimate: 1 seed" in summary
        and paths["loss_gap"].is_file()
    )

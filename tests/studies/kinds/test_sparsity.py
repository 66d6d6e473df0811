"""The sparsity kind: points per model / rule / granularity, the start from a model on disk (its
hash follows the files), errors naming the field, and a tiny real study (pretrain -> measure)."""

import math
import os

import numpy as np
import pytest
from statsmodels.stats.weightstats import ttost_paired

from moe_lit.config import ConfigError
from moe_lit.studies.identity import Start, path_fingerprint
from moe_lit.studies.study import parse_study
from tests.helpers.corpus import prepare_corpus
from tests.helpers.studies import tiny_kind_model, tiny_kind_run

MOE = tiny_kind_model(num_experts=4, expert_size=32, top_k=1)
DENSE = tiny_kind_model()
TINY = {
    "name": "sparse",
    "kind": "sparsity",
    "seeds": [0, 1],
    "run": tiny_kind_run(),
    "models": {"moe": MOE, "dense": DENSE},
    "targets": [0.0, 0.5, 0.9],
    "calibration_tokens": 128,
    "eval_tokens": 64,
    "timing_rounds": 2,
    "decode_tokens": 2,
}


def test_each_seed_pretrains_every_model_and_measures_each_rule_and_granularity():
    points = parse_study(TINY).points
    # per seed: 2 pretrain parents, MoE 2 rules x 2 granularities, dense 2 rules x layer only
    assert len(points) == 2 * (2 + 4 + 2)
    by_name = {p.name: p for p in points}
    parent = by_name["moe/pretrain/s1"]
    assert parent.start is None and parent.run.steps == 4 and parent.run.train.seed == 1
    child = by_name["moe/gate_up/expert/s1"]
    assert (child.start.parent, child.start.mode) == ("moe/pretrain/s1", "init") and child.run.steps == 0
    assert child.measure.name == "measure_sparsity"
    assert child.measure.kwargs["seed"] == 1 and child.measure.kwargs["targets"] == [0.0, 0.5, 0.9]
    assert (child.measure.kwargs["rule"], child.measure.kwargs["granularity"]) == ("gate_up", "expert")
    assert "dense/gate/expert/s0" not in by_name and by_name["dense/gate/layer/s0"].start.parent == "dense/pretrain/s0"
    assert len({p.hash for p in points}) == len(points)
    assert child.measure.kwargs["suite_limit"] is child.measure.kwargs["suite_batch_size"] is None  # no suite
    with_suite = {p.name: p for p in parse_study({**TINY, "suite": {"limit": 7}}).points}
    assert with_suite["moe/gate_up/expert/s1"].measure.kwargs["suite_limit"] == 7
    assert with_suite["moe/pretrain/s1"].hash == parent.hash
    with pytest.raises(ConfigError, match="suite.limit: must be null or a positive integer, got -1"):
        parse_study({**TINY, "suite": {"limit": -1}})


def _export(tmp_path, name="disk", vocab_size=300):
    from moe_lit.checkpoint import export_model
    from moe_lit.config import ModelConfig
    from moe_lit.model import Transformer

    directory = tmp_path / name
    export_model(Transformer(ModelConfig.from_dict({**MOE, "vocab_size": vocab_size, "seq_len": 16})), directory)
    return directory


def test_a_model_on_disk_is_measured_without_pretraining_and_hashed_by_its_files(tmp_path):
    directory = _export(tmp_path)
    spec = {**TINY, "seeds": [0], "models": {"smol": {"path": str(directory)}}}
    points = parse_study(spec).points
    assert [p.name for p in points] == [
        "smol/gate/layer",
        "smol/gate/expert",
        "smol/gate_up/layer",
        "smol/gate_up/expert",
    ]
    assert all(p.start == Start(path=str(directory), mode="init") for p in points)
    assert points[0].model.moe.num_experts == 4  # the accounting reads the model's own config
    before = points[0].hash
    weights = directory / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert parse_study(spec).points[0].hash == before  # touched, same bytes: the same point (resumes)
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert parse_study(spec).points[0].hash != before  # the model's bytes changed: a new point
    assert path_fingerprint(weights)[0][0] == "model.safetensors"


def test_a_start_names_a_parent_or_a_path_and_the_path_must_exist(tmp_path):
    with pytest.raises(ConfigError, match="exactly one of parent"):
        Start()
    with pytest.raises(ConfigError, match="exactly one of parent"):
        Start(parent="a", path="b")
    with pytest.raises(ConfigError, match="start.path: .* does not exist"):
        path_fingerprint(tmp_path / "missing")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"targets": [0.5, 1.0]}, "targets: [1.0] not allowed, each must be in [0, 1)"),
        ({"targets": [0.5, 0.5]}, "targets: must be a non-empty list of distinct values"),
        ({"rules": ["gate", "relu"]}, "rules: unknown ['relu'], allowed values: gate, gate_up"),
        ({"granularities": ["neuron"]}, "granularities: unknown ['neuron'], allowed values: layer, expert"),
        ({"statistics_target": 0.7}, "statistics_target: got 0.7, allowed values: 0.0, 0.5, 0.9"),
        ({"eval_split": "dev"}, "eval_split: got 'dev', allowed values: train, val, test"),
        ({"eval_tokens": 0}, "eval_tokens: must be a positive integer, got 0"),
        ({"clock": "sundial"}, "clock: got 'sundial', allowed values: wall, cpu"),
        ({"models": {"m": {"path": "x", "d_model": 3}}}, "models.m: a model on disk is {path: <dir>} alone"),
        ({"models": {"m": {"path": "no/such/dir"}}}, "models: no/such/dir holds no config.json"),
        ({"models": {}}, "models: must be a non-empty mapping"),
        ({"colour": 1}, "study: unknown key(s) ['colour']"),
    ],
)
def test_spec_errors_name_the_field(change, message):
    with pytest.raises(ConfigError) as info:
        parse_study({**TINY, **change})
    assert message in str(info.value)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sparsity")
    return prepare_corpus(root, paragraphs=30, val_fraction=0.2, test_fraction=0.2)


@pytest.mark.slow
def test_tiny_study_end_to_end(tmp_path, tiny_data):
    from moe_lit.data.tokenizer import model_tokenizer
    from moe_lit.inference.sparsity import mean_loss, token_batches
    from moe_lit.studies.measures import language_tokens
    from moe_lit.studies.report import write_report
    from moe_lit.studies.study import run_study

    spec = {**TINY, "seeds": [0], "rules": ["gate"], "models": {"moe": MOE, "dense": DENSE}}
    records = {r["name"]: r for r in run_study(parse_study(spec, str(tiny_data)), tmp_path / "out", log=lambda _: None)}
    assert all(r["status"] == "ok" for r in records.values()), [r.get("error") for r in records.values()]
    moe = records["moe/gate/layer"]
    assert {r["language"] for r in moe["curve"]} == {"en", "de", "ru"}
    at = {(r["target"], r["language"]): r for r in moe["curve"]}
    for language in ("en", "de", "ru"):
        # target 0: exactly the dense model; the dense loss is the parent's weights evaluated directly
        assert at[(0.0, language)]["loss"] == pytest.approx(at[(0.0, language)]["dense_loss"], abs=1e-5)
        assert at[(0.0, language)]["inactive"] == 0.0
        assert at[(0.9, language)]["inactive"] > at[(0.5, language)]["inactive"] > 0.3
    checkpoint = records["moe/pretrain"]["checkpoint"]
    from moe_lit.checkpoint import load_model

    model = load_model(checkpoint)
    tokens = language_tokens(tiny_data, "val", None, model_tokenizer(checkpoint, data_dir=tiny_data), 64)
    dense_en = mean_loss(model, token_batches(tokens["en"], 17, 8))
    assert at[(0.0, "en")]["dense_loss"] == pytest.approx(dense_en, abs=1e-6)
    assert moe["eval_tokens_per_language"]["en"] == 3 * 16  # 64 tokens: 3 windows of 17 (16 scored each)
    assert {(s["ffn"], s["expert"]) for s in moe["statistics"]} >= {("blocks.0.ffn.experts", 0)}
    assert moe["best_target"] in (None, 0.0, 0.5, 0.9)
    assert (moe["layer_speedup"] is None) == (moe["best_target"] in (None, 0.0))
    assert "dense/gate/expert" not in records and records["dense/gate/layer"]["status"] == "ok"
    written = write_report(tmp_path / "out")
    summary = written["summary"].read_text()
    assert "| moe | gate | expert | 0.9 |" in summary and "90% of the neurons skipped" in summary
    assert (tmp_path / "out" / "plots" / "loss_vs_sparsity.png").is_file()
    assert not math.isnan(moe["dense_loss"])


def test_a_model_on_disk_runs_only_the_measurement_with_its_own_tokenizer(tmp_path, tiny_data):
    import shutil

    from moe_lit.studies.study import run_study

    # another vocabulary than the data's: the model brings its own tokenizer (here a copy of the data's)
    directory = _export(tmp_path, vocab_size=320)
    shutil.copy(tiny_data / "tokenizer.json", directory / "tokenizer.json")
    spec = {
        **TINY,
        "seeds": [0],
        "rules": ["gate"],
        "granularities": ["layer"],
        "models": {"smol": {"path": str(directory)}},
        "statistics_target": 0.0,
        "suite": {"limit": 2, "batch_size": 4},
    }

    def no_training(*args, **kwargs):
        raise AssertionError("a 0-step point from a path must not train")

    (record,) = run_study(parse_study(spec, str(tiny_data)), tmp_path / "out", train_fn=no_training, log=lambda _: None)
    assert record["status"] == "ok", record.get("error")
    assert record["steps"] == 0 and record["checkpoint"] == str(directory)
    zero = [r for r in record["curve"] if r["target"] == 0.0]
    assert all(r["loss"] == pytest.approx(r["dense_loss"], abs=1e-5) for r in zero)
    suite = record["suite"]  # at target 0 the sparse model scores as the dense one
    assert suite["target"] == 0.0 and suite["dense"]["limit"] == 2
    assert suite["sparse"]["tasks"] == pytest.approx(suite["dense"]["tasks"]) and suite["dense"]["tasks"]


def _record(seed, granularity, increase_at_09, layer_speedup=2.0):
    """A measurement record with two languages of equal weight and a hand-chosen curve."""
    curve = []
    for target, increase in ((0.0, 0.0), (0.5, 0.001), (0.9, increase_at_09)):
        for language in ("en", "de"):
            curve.append(
                {
                    "target": target,
                    "rule": "gate",
                    "granularity": granularity,
                    "language": language,
                    "loss": 2.0 * (1 + increase),
                    "dense_loss": 2.0,
                    "increase": increase,
                    "inactive": target,
                }
            )
    best = 0.9 if increase_at_09 <= 0.01 else 0.5
    return {
        "name": f"moe/gate/{granularity}/s{seed}",
        "status": "ok",
        "arm": "sparsity",
        "model_name": "moe",
        "num_experts": 2,
        "total_params": 1000,
        "rule": "gate",
        "granularity": granularity,
        "seed": seed,
        "curve": curve,
        "eval_tokens_per_language": {"en": 100, "de": 100},
        "best_target": best,
        "best_inactive": best,
        "layer_speedup": layer_speedup,
        "decode_speedup": 1.1,
        "statistics_target": 0.9,
        "statistics": [
            {"language": lang, "ffn": "blocks.0.ffn.experts", "expert": e, "assignments": 10, "inactive": 0.8 + e / 10}
            for lang in ("en", "de")
            for e in range(2)
        ],
    }


def test_analysis_tables_and_verdicts_from_hand_made_records(tmp_path):
    from moe_lit.studies.kinds.sparsity import analyse

    records = [_record(s, "layer", 0.005 + s * 0.002) for s in (0, 1)]
    for seed, (dense, sparse) in enumerate(((0.70, 0.65), (0.72, 0.66))):  # sparse - dense: -0.05, -0.06
        records[seed]["suite"] = {"dense": {"mean_acc": dense, "limit": 50}, "sparse": {"mean_acc": sparse}}
    records += [_record(s, "expert", 0.02 + s * 0.01, layer_speedup=3.0) for s in (0, 1)]
    records.append({**_record(2, "layer", 0.0), "status": "failed"})  # failed: left out
    analysis = analyse({"spec": {"max_increase": 0.01}}, records, tmp_path)
    curve = analysis.tables["Val loss vs target sparsity (token-weighted over languages; mean ± std over seeds)"]
    row = next(r for r in curve if (r["granularity"], r["target"]) == ("layer", "0.9"))
    assert row["increase"] == "0.60 ± 0.14 % (n=2)" and row["inactive reached"] == "0.900 ± 0.000 (n=2)"
    (layer, expert) = analysis.tables[
        "Highest target within the loss budget in every language, and the speedup measured there"
    ]
    assert (
        layer["highest target within 1%"] == "0.900 ± 0.000 (n=2)"
        and expert["FFN-layer speedup"] == "3.00 ± 0.00 (n=2)"
    )
    claim_layer, speed_layer, claim_expert, speed_expert, granularity = analysis.claims
    assert claim_layer.claim.study_object.kind == claim_layer.claim.paper_object.kind == "a trained MoE"
    # no loss at 90%: the per-seed relative increase (0.5%, 0.7%) tested for equivalence within the
    # study's 1% margin (TOST, statsmodels), against 0
    assert claim_layer.claim.text == "moe, gate/layer: 90% of the neurons skipped without loss"
    assert claim_layer.claim.bounds == (-0.01, 0.01) and claim_layer.difference.test == "one-sample t-test"
    tost = ttost_paired(np.array([0.005, 0.007]), np.zeros(2), -0.01, 0.01)[0]
    assert claim_layer.equivalence.p == pytest.approx(tost, rel=1e-4) and claim_layer.decides == "equivalence"
    assert claim_expert.difference.estimate == pytest.approx(0.025) and claim_expert.decides == "beyond margin"
    assert speed_layer.reason.startswith("the paper's speedups are GPU kernels on top of vLLM")
    assert "measured: FFN layer 2.00x, decode 1.10x" in speed_layer.reason and "FFN layer 3.00x" in speed_expert.reason
    assert granularity.claim.arms == ("expert", "layer") and granularity.difference.estimate == pytest.approx(0.019)
    (sparsest, *_rest) = analysis.tables["Sparsest and densest routed experts at target 0.9 (layer thresholds)"]
    assert (sparsest["rank"], sparsest["expert"], sparsest["inactive (mean over languages)"]) == (
        "sparsest",
        1,
        "0.900",
    )
    assert [p.name for p in analysis.plots] == ["loss_vs_sparsity.png"] and analysis.plots[0].stat().st_size > 0
    (suite,) = analysis.tables["Local-suite accuracy, dense vs sparse at target 0.9 (mean ± std over seeds)"]
    assert (suite["granularity"], suite["items per task"], suite["dense acc"]) == ("layer", 50, "0.7100 ± 0.0141 (n=2)")
    assert suite["sparse - dense (paired by seed)"].startswith("-0.0550 [")
    dense = [r | {"model_name": "dense", "num_experts": 1} for r in records if r["granularity"] == "layer"]
    on_dense = analyse({"spec": {"max_increase": 0.01}}, dense, tmp_path).claims[0]
    assert on_dense.reason == "the paper tested a trained MoE; this study has a trained dense model"
    assert on_dense.difference.estimate == claim_layer.difference.estimate  # still measured: a finding

"""The lifecycle kind on a tiny imported Llama: the chain of points (partition -> recovery from the
dense teacher -> pruning / MoE->dense / sparsity of one named MoE), bits per byte, errors naming the
field, and the whole chain run end to end with its report (nothing downloads)."""

import math

import pytest
import torch

from moe_lit.config import ConfigError
from moe_lit.studies.study import parse_study
from tests.helpers.corpus import VOCAB, prepare_corpus
from tests.helpers.hf import imported_llama

STAGES = {"dense": 1, "partition": 5, "prune": 3, "to_dense": 2, "sparsity": 2}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the prepared data, the imported tiny Llama, the study mapping)."""
    root = tmp_path_factory.mktemp("lifecycle")
    data, model = prepare_corpus(root, paragraphs=30, val_fraction=0.2, test_fraction=0.2), imported_llama(root, VOCAB)
    study = {
        "name": "life",
        "kind": "lifecycle",
        "run": {
            "data": {"data_dir": str(data), "seq_len": 16, "batch_size": 2, "val_batches": 1},
            "optim": {"warmup_steps": 1},
            "trainer": {"enable_progress_bar": False, "accelerator": "cpu"},
        },
        "model": str(model),
        "shapes": [[4, 2]],
        "prune_source": "E4k2/dot_moe",
        "fractions": [0.25],
        "prune_methods": ["maestro", "frequency", "naee"],
        "to_dense": {"keep": 2, "groups": 2},
        "calibration_tokens": 64,
        "train_tokens": 64,
        "recovery": {"steps": 2, "lr": 1e-4, "warmup": 1},
        "bpb_tokens": 64,
        "limit": 3,
    }
    return data, model, study


def test_the_chain_forks_from_the_model_on_disk_and_from_the_named_moe(tiny):
    _, model, study = tiny
    points = {p.name: p for p in parse_study(study).points}
    assert {s: sum(p.info["stage"] == s for p in points.values()) for s in STAGES} == STAGES
    assert points["dense"].start.path == str(model) and points["dense"].run.steps == 0
    for name in ("E4k2/random", "E4k2/kmeans", "E4k2/coactivation", "E4k2/dot_moe", "E4k2/pruning"):
        point = points[name]
        assert point.start.path == str(model) and point.run.steps == 2 and point.run.optim.lr == 1e-4
        assert point.module.kwargs == {"teacher": str(model)} and point.measure.kwargs["before"] is True
    assert points["to_dense/dense"].start.path == str(model) and points["to_dense/dense"].module is not None
    for name in ("prune/0.25/maestro", "prune/0.25/naee", "to_dense/moe", "sparsity/gate", "sparsity/gate_up"):
        assert points[name].start.parent == "E4k2/dot_moe" and points[name].start.mode == "init"
    budgets = {m: points[f"prune/0.25/{m}"].transform.kwargs["global_budget"] for m in ("maestro", "naee")}
    assert budgets == {"maestro": True, "naee": False}  # naee searches each layer's subset on its own
    assert points["to_dense/moe"].model.d_ff == points["to_dense/dense"].model.d_ff == 2 * 16  # 2 experts of 64 / 4
    assert points["E4k2/pruning"].model.d_ff == 32 and points["E4k2/dot_moe"].model.moe.num_experts == 4
    calibrated = ("prune/0.25/maestro", "to_dense/moe", "to_dense/dense")
    assert all(points[name].transform.kwargs["split"] == "train" for name in calibrated)  # never the suite's text


def test_the_calibration_split_reaches_the_calibrated_transforms_and_only_their_hashes(tiny):
    on_test = {p.name: p for p in parse_study({**tiny[2], "calibration_split": "test"}).points}
    on_train = {p.name: p for p in parse_study(tiny[2]).points}
    calibrated = {name for name, point in on_test.items() if point.transform and "split" in point.transform.kwargs}
    assert all(on_test[name].transform.kwargs["split"] == "test" for name in calibrated)
    assert all(on_train[name].transform.kwargs["split"] == "train" for name in calibrated)
    changed = {name for name, point in on_test.items() if point.hash != on_train[name].hash}
    assert changed == calibrated == {name for name in on_test if name.startswith(("prune/", "to_dense/"))}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"prune_source": "E4k2/pruning"}, "prune_source: got 'E4k2/pruning', allowed values: E4k2/random"),
        ({"shapes": [[4]]}, "shapes: [[4]] not allowed, each must be [E, k]"),
        ({"to_dense": {"keep": 1, "groups": 2}}, "to_dense.keep: must be >= groups=2"),
        ({"prune_methods": ["pagerank"]}, "prune_methods: unknown ['pagerank']"),
        ({"limit": 0}, "limit: must be null or a positive integer, got 0"),
        ({"calibration_split": "val"}, "calibration_split: got 'val', allowed values: train, test"),
    ],
)
def test_spec_errors_name_the_field(tiny, change, message):
    with pytest.raises(ConfigError) as info:
        parse_study({**tiny[2], **change})
    assert message in str(info.value)


def test_bits_per_byte_of_a_uniform_model_are_log2_v_per_scored_token_over_the_decoded_bytes(tiny):
    from moe_lit.checkpoint import load_model
    from moe_lit.data.tokenizer import model_tokenizer
    from moe_lit.inference.sparsity import token_batches
    from moe_lit.studies.measures import SPARSITY_BATCH, bits_per_byte, language_tokens

    data, model_dir, _ = tiny
    model, tokenizer = load_model(model_dir), model_tokenizer(model_dir, data_dir=data)
    with torch.no_grad():
        model.tok_embeddings.weight.zero_()  # tied head: every logit 0, the loss ln V at every token
    bpb = bits_per_byte(model, tokenizer, data, "val", ["en", "ru"], 64)
    for lang, ids in language_tokens(data, "val", ["en", "ru"], tokenizer, 64).items():
        rows = [row[1:].tolist() for b in token_batches(ids, 17, SPARSITY_BATCH) for row in b]
        size = sum(len(tokenizer.decode(row, skip_special_tokens=True).encode()) for row in rows)
        assert len(rows) == 3 and bpb[lang] == pytest.approx(math.log2(VOCAB) * 3 * 16 / size, rel=1e-5)


@pytest.mark.slow
def test_tiny_chain_end_to_end_with_its_claims_and_report(tiny, tmp_path):
    from moe_lit.checkpoint import load_model
    from moe_lit.studies.report import write_report
    from moe_lit.studies.study import run_study

    data, _, study = tiny
    study = {**study, "methods": ["random", "dot_moe", "pruning"], "prune_methods": ["maestro", "naee"]}
    records = {r["name"]: r for r in run_study(parse_study(study), tmp_path / "out", log=lambda _: None)}
    assert all(r["status"] == "ok" for r in records.values()), {n: r.get("error") for n, r in records.items()}
    assert len(records) == 1 + 3 + 2 + 2 + 2
    for name, record in records.items():
        if record["stage"] == "sparsity":
            continue
        assert set(record["bpb"]) == {"en", "de", "ru"} and all(v > 0 for v in record["bpb"].values())
        assert record["task_items"] == 3 * 3 and set(record["suite"]["items"].values()) == {3}  # 3 pairs x 3 langs
        assert ("before" in record) == (record["steps"] == 2), name
    source = load_model(records["E4k2/dot_moe"]["checkpoint"])
    experts = {m: records[f"prune/0.25/{m}"]["params"] for m in ("maestro", "naee")}
    assert len(set(experts.values())) == 1 and experts["naee"] < sum(p.numel() for p in source.parameters())
    pruned = load_model(records["prune/0.25/maestro"]["checkpoint"])
    assert sum(pruned.config.moe_layer_config(b).num_experts for b in pruned.config.moe_layer_ids) == 3 * 4 - 3
    gate = records["sparsity/gate"]
    at_zero = [r for r in gate["curve"] if r["target"] == 0.0]
    assert all(r["loss"] == pytest.approx(r["dense_loss"], abs=1e-5) for r in at_zero) and len(at_zero) == 3
    summary = write_report(tmp_path / "out")["summary"].read_text()
    for claim in ("E4k2: DOT-MoE beats random", "E4k2: DOT-MoE beats pruning", "0.25 pruned: maestro beats naee"):
        assert claim in summary
    assert "DOT-MoE beats kmeans" not in summary and "MoE->dense beats dense->dense" in summary
    assert "gate_up: 90% of the neurons skipped within the margin" in summary and "| E4k2/dot_moe |" in summary


def test_pruning_under_a_global_budget_keeps_the_plan_ranked_across_layers(tiny_moe, prepared_dir):
    from moe_lit.convert.importance import plan_keep
    from moe_lit.convert.recipes import calibration_text, prune_by_importance

    # seeded random scores that rank both removed experts in block 1 (a per-layer budget removes one a layer)
    options = {"method": "random", "fraction": 0.25, "data_dir": prepared_dir, "calibration_tokens": 64, "seed": 0}
    pruned = prune_by_importance(tiny_moe, **options, damping=0.85, global_budget=True)
    keep, _ = plan_keep("random", tiny_moe, calibration_text(tiny_moe, prepared_dir, 64), 0.25, None, True, seed=0)
    kept = {b: pruned.config.moe_layer_config(b).num_experts for b in pruned.config.moe_layer_ids}
    assert kept == {b: len(ids) for b, ids in keep.items()} == {0: 4, 1: 2}


def test_a_slice_runs_only_the_matching_points_and_a_child_waits_for_its_parent(tiny, tmp_path):
    import json

    from moe_lit.studies.study import run_study

    study, out = parse_study(tiny[2]), tmp_path / "out"
    records = run_study(study, out, only=["prune/*"], log=lambda _: None)  # their parent has not run
    assert records == [] and not list((out / "runs").glob("*.json"))
    records = run_study(study, out, only=["dense", "E4k2/rand*"], log=lambda _: None)
    assert sorted(r["name"] for r in records) == ["E4k2/random", "dense"] and all(r["status"] == "ok" for r in records)
    assert len(json.loads((out / "study.json").read_text())["points"]) == sum(STAGES.values())  # the whole plan


def test_conversion_seeds_add_the_partition_stage_only_and_keep_every_hash(tiny):
    before = {p.hash for p in parse_study(tiny[2]).points}
    points = parse_study({**tiny[2], "conversion_seeds": [0, 1, 2]}).points
    assert before <= {p.hash for p in points}  # every planned (and committed) point keeps its hash
    extra = [p for p in points if p.hash not in before]
    assert sorted({p.seed for p in extra}) == [1, 2] and {p.info["stage"] for p in extra} == {"partition"}
    assert len(extra) == 2 * STAGES["partition"]  # the dense model is measured once
    with pytest.raises(ConfigError, match="conversion_seeds"):
        parse_study({**tiny[2], "conversion_seeds": [-1]})


@pytest.mark.slow
def test_a_distillation_stopped_by_sigterm_resumes_to_the_uninterrupted_record(tiny, tmp_path, monkeypatch, caplog):
    # NOTE: the study's costliest points (a DOT-MoE partition, then its distillation from the dense
    # teacher) are the ones a session ends in the middle of; the rerun continues from last.ckpt
    # with the teacher built again and the transformed start kept for the "before" measure.
    import json
    import shlex
    from pathlib import Path

    import yaml

    from moe_lit.console_script import main
    from tests.helpers.signals import interruption, signal_when_checkpointed

    study = {**tiny[2], "methods": ["dot_moe"], "recovery": {"steps": 6, "lr": 1e-4, "warmup": 1}}
    study["run"] = {**study["run"], "train": {"max_steps": 6, "checkpoint_every": 1}}
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(study))
    argv = ["study", "run", "study.yaml", "--only", "E4k2/dot_moe"]
    code, stderr = signal_when_checkpointed([*argv, "--out", "cut"], tmp_path, "cut/runs/*/checkpoints/last.ckpt")
    assert code == 143, stderr
    step, checkpoint, resume = interruption(stderr)
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("INFO"):
        assert main(shlex.split(resume)[1:]) == 0
    restored = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Restoring states from")]
    assert restored == [f"Restoring states from the checkpoint path at {Path(checkpoint).relative_to(tmp_path)}"]
    assert main([*argv, "--out", "full"]) == 0
    (cut_record,) = (tmp_path / "cut" / "runs").glob("*.json")
    cut, full = (json.loads(p.read_text()) for p in (cut_record, tmp_path / "full" / "runs" / cut_record.name))
    assert 1 <= step < 6 and cut["status"] == full["status"] == "ok", cut.get("error")
    for field in ("steps", "curve", "val_loss", "bpb", "suite", "before"):
        assert cut[field] == full[field], field

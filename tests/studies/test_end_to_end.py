"""The real ``train_run`` on a tiny prepared corpus: prepare -> train dense and MoE -> report."""

import csv
import json
import math

import pytest

from moe_lit.studies.report import write_report
from moe_lit.studies.study import parse_study, run_study
from tests.helpers.corpus import write_corpus
from tests.helpers.studies import trained_spec


@pytest.mark.slow
def test_tiny_study_trains_real_models_and_reports(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", files=2, paragraphs=30)
    grid = {"num_experts": ["dense", 4], "top_k": [2], "moe": {"backend": "torch"}}
    spec = parse_study(trained_spec(tmp_path, corpus, steps=6, grid=grid))
    records = run_study(spec, tmp_path / "out", log=lambda _: None)
    assert [(r["name"], r["status"]) for r in records] == [("S/dense", "ok"), ("S/E4k2", "ok")], records[-1].get(
        "error"
    )
    for r in records:
        assert r["steps"] == 6 and r["tokens"] == 16 * 4 * 6
        assert math.log(300) - 1.5 < r["val_loss"] < math.log(300) + 0.5  # 6 steps: still near uniform
        assert set(r["val_loss_per_language"]) == {"en", "de", "ru"}
        assert r["tokens_per_s"] > 0
    assert records[0]["load_imbalance"] == 1.0 and records[1]["load_imbalance"] >= 1.0
    write_report(tmp_path / "out")
    rows = list(csv.DictReader((tmp_path / "out" / "runs.csv").open()))
    assert {"val_loss_en", "val_loss_de", "val_loss_ru"} <= set(rows[0])


def _family(data, *children: tuple[str, str]):
    """A 4-step tiny MoE ``parent`` and ``children`` (name, start mode) from its final checkpoint, 2 steps more."""
    from moe_lit.lit.run_config import RunConfig
    from moe_lit.studies.identity import Point, Start, finalize
    from tests.helpers.models import tiny

    def run(steps):
        return RunConfig(
            data={"data_dir": str(data), "seq_len": 16, "batch_size": 4, "val_batches": 1},
            train={"max_steps": steps, "val_every": steps},
            optim={"warmup_steps": 1},
            trainer={"enable_progress_bar": False, "accelerator": "cpu"},
        )

    model = tiny(vocab_size=300, backend="torch")
    parent = Point("parent", "parent", 0, model, run(4))
    kids = [Point(name, name, 0, model, run(6), start=Start("parent", mode=mode)) for name, mode in children]
    return {p.name: p for p in finalize([parent, *kids])}


def test_a_finished_point_keeps_its_weights_and_drops_the_optimizer_state_no_child_resumes(prepared, tmp_path):
    from moe_lit.checkpoint import has_training_state, load_model
    from moe_lit.studies.identity import fork_checkpoint, record_path
    from moe_lit.studies.schedule import run_points

    points = _family(prepared, ("init_kid", "init"))
    records = run_points(list(points.values()), tmp_path, log=lambda _: None)
    assert [r["status"] for r in records] == ["ok", "ok"], records
    parent = fork_checkpoint(tmp_path, points["parent"], None)
    assert not has_training_state(parent) and load_model(parent).config == points["parent"].model
    # its record deleted, the parent trains again from scratch (a compacted checkpoint does not resume)
    before = record_path(tmp_path, points["parent"]).read_text()
    record_path(tmp_path, points["parent"]).unlink()
    (again,) = [r for r in run_points(list(points.values()), tmp_path, log=lambda _: None) if r["name"] == "parent"]
    assert again["status"] == "ok" and again["curve"] == json.loads(before)["curve"]


def test_a_parent_whose_child_resumes_its_run_keeps_the_optimizer_state(prepared, tmp_path):
    from moe_lit.checkpoint import drop_training_state, has_training_state
    from moe_lit.studies.identity import fork_checkpoint, record_path
    from moe_lit.studies.run import run_point
    from moe_lit.studies.schedule import run_points

    points = _family(prepared, ("resumed_kid", "resume"))
    records = run_points(list(points.values()), tmp_path, log=lambda _: None)
    assert [(r["status"], r["steps"]) for r in records] == [("ok", 4), ("ok", 6)], records
    assert has_training_state(fork_checkpoint(tmp_path, points["parent"], None))
    assert not has_training_state(fork_checkpoint(tmp_path, points["resumed_kid"], None))
    # a resuming child added after its parent was compacted: one line saying how to train the parent again
    drop_training_state(fork_checkpoint(tmp_path, points["parent"], None))
    record_path(tmp_path, points["resumed_kid"]).unlink()
    record = run_point(points["resumed_kid"], tmp_path, points)
    assert record["status"] == "failed" and "keeps its weights only" in record["error"]
    assert f"delete {record_path(tmp_path, points['parent'])} to train the parent again" in record["error"]

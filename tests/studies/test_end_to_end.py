"""The real ``train_run`` on a tiny prepared corpus: prepare -> train dense and MoE -> report."""

import csv
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

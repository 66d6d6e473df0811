import json
import math
import statistics

import pytest

from moe_lit.console_script import main
from moe_lit.errors import MoeLitError
from moe_lit.evaluation.suite import suite_scores
from tests.helpers.corpus import LANGUAGES


def test_suite_scores_equal_the_eval_command_and_chance_is_the_items_own(
    tmp_path, tiny_moe, exported, prepared_dir, monkeypatch
):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    scores = suite_scores(tiny_moe, prepared_dir / "tokenizer.json", prepared_dir, limit=4, batch_size=4)
    args = ["eval", "--checkpoint", str(exported), "--tasks", "moe_lit_next,moe_lit_pairs", "--data", str(prepared_dir)]
    assert main([*args, "--limit", "4", "--bootstrap-iters", "0", "--out", str(tmp_path / "t")]) == 0
    results = json.loads((tmp_path / "t" / "results.json").read_text())["results"]
    expected = {task: m["acc,none"] for task, m in results.items() if "acc,none" in m}
    assert scores["tasks"] == pytest.approx(expected) and len(expected) == 2 * len(LANGUAGES)
    assert set(scores["languages"]) == set(LANGUAGES)
    for task, chance in scores["chance"].items():
        # next-paragraph items have up to 3 distractors; minimal pairs are two-way
        assert chance == 0.5 if "pairs" in task else 0.25 <= chance <= 0.5
    above = [scores["tasks"][t] - scores["chance"][t] for t in scores["tasks"]]
    assert scores["mean_above_chance"] == pytest.approx(sum(above) / len(above))
    assert scores["limit"] == 4 and "outcomes" not in scores
    assert set(scores["items"].values()) == {4} and set(scores["stderr"]) == set(scores["tasks"])
    json.dumps(scores)  # a study record can hold it


def test_suite_outcomes_give_the_accuracy_and_its_item_level_standard_error(tiny_moe, prepared_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tokenizer = prepared_dir / "tokenizer.json"
    options = {"limit": 6, "batch_size": 8, "tasks": ["moe_lit_pairs"], "outcomes": True}
    scores = suite_scores(tiny_moe, tokenizer, prepared_dir, **options)
    assert set(scores["outcomes"]) == set(scores["tasks"]) and len(scores["tasks"]) == len(LANGUAGES)
    for task, acc in scores["tasks"].items():
        outcome = scores["outcomes"][task]
        assert len(outcome) == scores["items"][task] == 6 and set(outcome) <= {0, 1}
        assert statistics.fmean(outcome) == pytest.approx(acc)
        assert scores["stderr"][task] == pytest.approx(statistics.stdev(outcome) / math.sqrt(6))


def test_suite_scores_refuse_a_bad_limit(tiny_moe, prepared_dir):
    with pytest.raises(MoeLitError, match="suite limit"):
        suite_scores(tiny_moe, prepared_dir / "tokenizer.json", prepared_dir, limit=0)

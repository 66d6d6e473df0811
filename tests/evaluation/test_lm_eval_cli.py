"""``moe-lit lm-eval``: lm-eval's own CLI, with the model ``moe_lit`` registered."""

import json

import pytest

from moe_lit.console_script import main
from moe_lit.evaluation.tasks import render_suite


@pytest.mark.slow  # lm-eval's CLI indexes all of its built-in tasks first
def test_lm_eval_cli_runs_the_moe_lit_model_on_a_local_task(tmp_path, exported, prepared_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks_dir = tmp_path / "tasks"
    render_suite(prepared_dir, tasks_dir)
    args = [
        "--model",
        "moe_lit",
        "--model_args",
        f"checkpoint={exported}",
        "--batch_size",
        "4",
        "--tasks",
        "moe_lit_pairs_en",
    ]
    args += ["--include_path", str(tasks_dir), "--limit", "3"]
    assert main(["lm-eval", *args, "--output_path", str(tmp_path / "out")]) == 0
    (written,) = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(written.read_text())
    assert results["n-samples"]["moe_lit_pairs_en"]["effective"] == 3
    assert 0.0 <= results["results"]["moe_lit_pairs_en"]["acc,none"] <= 1.0
    assert results["config"]["model"] == "moe_lit"


def test_lm_eval_cli_passes_lm_evals_own_argument_errors_through(capsys):
    assert main(["lm-eval", "run", "--no-such-flag"]) == 2
    assert "--no-such-flag" in capsys.readouterr().err


def test_an_unreachable_dataset_is_one_line_naming_task_data(capsys, monkeypatch):
    import lm_eval.__main__

    def offline():  # what datasets raises for a hub dataset without a network
        raise ConnectionError("Couldn't reach 'facebook/xnli' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", offline)
    assert main(["lm-eval", "run", "--model", "moe_lit", "--tasks", "xnli_de"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("moe-lit lm-eval run: error: --tasks: a task's dataset is not reachable (Couldn't reach")
    assert line.endswith("moe-lit eval --checkpoint CK --tasks TASK --task-data TASK=FILE")

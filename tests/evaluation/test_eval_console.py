"""``moe-lit eval`` prints one scoring bar per request type, not one bar per task."""

import lm_eval.api.model
import lm_eval.api.task
from tqdm import tqdm

from moe_lit.console_script import main
from moe_lit.evaluation.harness import scoring_bars_only


def test_eval_shows_scoring_bars_only(tmp_path, exported, prepared_dir, monkeypatch, capsys):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    args = ["eval", "--checkpoint", str(exported), "--tasks", "moe_lit_suite", "--data", str(prepared_dir)]
    assert main([*args, "--limit", "3", "--bootstrap-iters", "0", "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "Generating" not in err and "Tokenizing inputs" not in err and "| 3/3 [" not in err, err
    bars = {line.split(":")[0] for line in err.replace("\r", "\n").splitlines() if "%|" in line}
    assert bars == {"moe_lit loglikelihood"}, bars


def test_scoring_bars_only_restores_lm_evals_bars():
    import datasets

    before = datasets.are_progress_bars_disabled()
    with scoring_bars_only():
        assert lm_eval.api.task.tqdm is not tqdm and datasets.are_progress_bars_disabled()
    assert lm_eval.api.task.tqdm is tqdm and lm_eval.api.model.tqdm is tqdm
    assert datasets.are_progress_bars_disabled() == before

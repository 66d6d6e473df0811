import json

import pytest
import torch

from moe_lit.checkpoint import export_model
from moe_lit.console_script import main
from moe_lit.model import Transformer
from tests.helpers.checkpoints import CASES, bad_checkpoint, lightning_checkpoint
from tests.helpers.corpus import LANGUAGES
from tests.helpers.models import tiny


def test_eval_command_writes_results_json_and_markdown(tmp_path, exported, prepared_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = "moe_lit_pairs,moe_lit_ppl_en"
    args = ["eval", "--checkpoint", str(exported), "--tasks", tasks, "--data", str(prepared_dir)]
    assert main([*args, "--limit", "3", "--bootstrap-iters", "0", "--out", str(tmp_path / "t")]) == 0
    results = json.loads((tmp_path / "t" / "results.json").read_text())
    assert set(results["results"]) == {"moe_lit_ppl_en", *(f"moe_lit_pairs_{lang}" for lang in LANGUAGES)}
    assert all(n["effective"] == 3 for task, n in results["n-samples"].items() if "pairs" in task)
    markdown = (tmp_path / "t" / "results.md").read_text()
    assert "| language | bits/byte | byte ppl | next-paragraph acc | minimal-pairs acc |" in markdown
    assert "moe-lit eval --checkpoint" in markdown and "| moe_lit_pairs_de | acc |" in markdown
    assert "| en | " in markdown and "| de | - | - | - | " in markdown
    assert "| chance | - | - | 0.3333 | 0.5 |" in markdown and "Items per language: ppl 2, pairs 3 of 8." in markdown
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # atomic: no leftovers


def test_eval_errors_are_one_line_exit_2(tmp_path, exported, capsys):
    assert main(["eval", "--checkpoint", str(tmp_path / "missing.ckpt")]) == 2
    assert (
        main(["eval", "--checkpoint", str(exported), "--tasks", "no_such_task_xyz", "--out", str(tmp_path / "o")]) == 2
    )
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2
    assert "no such file" in errors[0] and "unknown task 'no_such_task_xyz'" in errors[1]
    assert not list(tmp_path.iterdir())  # nothing written


def test_suite_table_pivots_tasks_by_language_code():
    from moe_lit.commands.eval import suite_by_language

    rows = [
        {"task": "moe_lit_ppl_pt_br", "metric": "bits_per_byte", "value": 1.5},
        {"task": "moe_lit_pairs_pt_br", "metric": "acc", "value": 0.75},
        {"task": "xcopa_it", "metric": "acc", "value": 0.5},
    ]
    languages = {"moe_lit_ppl_pt_br": "pt-br", "moe_lit_pairs_pt_br": "pt-br"}
    assert suite_by_language(rows, languages) == [
        {"language": "pt-br", "bits/byte": 1.5, "byte ppl": "-", "next-paragraph acc": "-", "minimal-pairs acc": 0.75}
    ]


def test_tokenizer_errors_are_one_line_naming_the_file(tmp_path, prepared_dir, capsys):
    small = export_model(Transformer(tiny(vocab_size=8)), tmp_path / "small")
    tokenizer = prepared_dir / "tokenizer.json"
    broken = tmp_path / "broken.json"
    broken.write_text('{"version": ')
    for given, words in (
        (tokenizer, "tokens do not fit the model's vocab_size 8"),
        (broken, "not a readable tokenizer.json"),
    ):
        args = ["eval", "--checkpoint", str(small), "--tokenizer", str(given), "--tasks", "moe_lit_pairs"]
        assert main([*args, "--data", str(prepared_dir), "--out", str(tmp_path / "res")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"tokenizer {given}" in err and words in err, err
    assert not (tmp_path / "res").exists()


@pytest.mark.parametrize("command", ["eval", "analyze"])
@pytest.mark.parametrize("case", CASES)
def test_bad_checkpoint_files_given_to_eval_and_analyze_are_one_line_naming_the_file(
    capsys, tmp_path, prepared_dir, case, command
):
    torch.manual_seed(0)
    model = Transformer(tiny())
    files = {
        "ckpt": lightning_checkpoint(tmp_path / "run.ckpt", model),
        "export": export_model(model, tmp_path / "export"),
    }
    path, words = bad_checkpoint(case, tmp_path, files)
    given = [
        "--checkpoint",
        str(path),
        "--data",
        str(prepared_dir),
        "--tokenizer",
        str(prepared_dir / "tokenizer.json"),
    ]
    argv = ["eval", *given, "--tasks", "moe_lit_pairs"] if command == "eval" else ["analyze", "routing", *given]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and str(path) in err, err
    assert not (tmp_path / "out").exists()

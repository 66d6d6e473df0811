"""``moe-lit convert prune`` end to end on the tiny parallel corpus (fixtures: tests/helpers/fixtures.py)."""

import json

import pytest
import torch

from moe_lit.checkpoint import load_model
from moe_lit.console_script import main
from moe_lit.evaluation.routing_trace import routing_trace


def _prune(exported, prepared_dir, out, *extra):
    return main(
        [
            "convert",
            "prune",
            "--checkpoint",
            str(exported),
            "--data",
            str(prepared_dir),
            "--split",
            "test",
            "--out",
            str(out),
            *extra,
        ]
    )


@pytest.mark.parametrize("method", ["maestro", "frequency", "router_weighted", "reap", "naee", "random"])
def test_every_method_writes_a_loadable_pruned_model_and_reports_memory(
    exported, prepared_dir, tmp_path, capsys, method
):
    assert _prune(exported, prepared_dir, tmp_path / "out", "--method", method, "--fraction", "0.5") == 0
    printed = capsys.readouterr().out
    assert "kept 4 of 8 experts, per layer [2, 2], top-2" in printed
    pruned = load_model(tmp_path / "out")
    assert pruned.config.moe.num_experts == 2 and (tmp_path / "out" / "tokenizer.json").is_file()
    report = json.loads((tmp_path / "out" / "pruning.json").read_text())
    memory = report["memory"]
    assert memory["params_saved"] == memory["params_before"] - memory["params_after"] > 0
    assert memory["bytes_saved"] == 4 * memory["params_saved"]  # float32, no selection bias
    assert report["method"] == method and "test, " in report["calibration"]
    if method == "maestro":
        assert report["details"]["converged"] and "power iterations" in printed
    assert pruned(torch.zeros(1, 4, dtype=torch.long)).logits_BLV.isfinite().all()


def test_global_budget_and_per_language_calibration(exported, prepared_dir, tmp_path, capsys):
    assert (
        _prune(
            exported,
            prepared_dir,
            tmp_path / "g",
            "--method",
            "frequency",
            "--num",
            "3",
            "--global",
            "--calibration",
            "de",
        )
        == 0
    )
    report = json.loads((tmp_path / "g" / "pruning.json").read_text())
    assert sum(len(k) for k in report["keep"].values()) == 5
    assert all(len(k) >= 2 for k in report["keep"].values())
    assert report["calibration"].startswith("de (")


def test_calibration_from_a_saved_trace_file(exported, prepared_dir, tmp_path, tiny_moe):
    with torch.no_grad(), routing_trace(tiny_moe) as recorder:
        tiny_moe(torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0)))
    trace_file = recorder.trace().save(tmp_path / "trace.pt")
    assert _prune(exported, prepared_dir, tmp_path / "t", "--num", "1", "--calibration", str(trace_file)) == 0
    assert load_model(tmp_path / "t").config.moe.num_experts == 3


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--fraction", "1.5"], "fraction: must be in [0, 1)"),
        (["--num", "4"], "removing 4 of the 4 experts of block 0 leaves none"),
        (["--num", "3"], "top_k: block 0 keeps 1 experts, fewer than top_k=2"),
        (["--num", "5", "--global"], "at most 4 can go under the global budget"),
        (["--num", "1", "--method", "naee", "--global"], "global: naee searches each layer's subset"),
        (["--num", "1", "--damping", "0"], "maestro.damping: must be in (0, 1]"),
        (["--num", "1", "--calibration", "xx"], "--data: no parallel text for ['xx']"),
    ],
)
def test_bad_input_is_one_line_exit_2(exported, prepared_dir, tmp_path, capsys, extra, message):
    assert _prune(exported, prepared_dir, tmp_path / "bad", *extra) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (tmp_path / "bad").exists()


def test_clamp_top_k_lowers_top_k_to_the_survivors(exported, prepared_dir, tmp_path):
    assert _prune(exported, prepared_dir, tmp_path / "c", "--num", "3", "--clamp-top-k") == 0
    assert load_model(tmp_path / "c").config.moe.top_k == 1


def test_existing_out_is_refused_unless_forced_and_the_input_never(exported, prepared_dir, tmp_path, capsys):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert _prune(exported, prepared_dir, out, "--num", "1") == 2
    assert "exists and is not empty; pass --force" in capsys.readouterr().err
    assert (out / "keep.txt").is_file()
    assert _prune(exported, prepared_dir, out, "--num", "1", "--force") == 0
    assert load_model(out).config.moe.num_experts == 3
    assert _prune(exported, prepared_dir, exported, "--num", "1", "--force") == 2
    assert "is or contains the input --checkpoint" in capsys.readouterr().err
    assert load_model(exported).config.moe.num_experts == 4


@pytest.mark.parametrize(
    "budget, words",
    [
        (["--num", "9"], "removing 9 of the 4 experts of block 0 leaves none"),
        (["--num", "3"], "block 0 keeps 1 experts, fewer than top_k=2"),
        (["--num", "7", "--global"], "at most 4 can go under the global budget"),
    ],
)
def test_an_impossible_budget_is_refused_before_any_calibration(
    exported, prepared_dir, tmp_path, capsys, monkeypatch, budget, words
):
    from moe_lit.commands import convert

    monkeypatch.setattr(convert, "_calibration", lambda *args, **kwargs: pytest.fail("calibrated first"))
    assert _prune(exported, prepared_dir, tmp_path / "out", "--method", "reap", *budget) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("moe-lit convert prune: error: ") and words in line, line
    assert not (tmp_path / "out").exists()

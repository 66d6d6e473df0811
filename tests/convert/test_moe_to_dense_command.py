"""``moe-lit convert moe-to-dense`` end to end on the tiny parallel corpus (fixtures: tests/helpers/fixtures.py)."""

import json

import pytest
import torch

from moe_lit.accounting import count_model_params
from moe_lit.checkpoint import load_model
from moe_lit.console_script import main


def _convert(exported, prepared_dir, out, *extra):
    return main(
        [
            "convert",
            "moe-to-dense",
            "--checkpoint",
            str(exported),
            "--data",
            str(prepared_dir),
            "--split",
            "test",
            "--max-tokens",
            "128",
            "--out",
            str(out),
            *extra,
        ]
    )


@pytest.mark.parametrize(
    "extra",
    [
        ["--score", "do_acp", "--keep", "2"],
        [
            "--score",
            "router_prob",
            "--keep",
            "3",
            "--groups",
            "2",
            "--grouping",
            "kmeans_output",
            "--scaling",
            "gate_mean",
        ],
    ],
)
def test_writes_a_loadable_dense_model_and_its_plan(exported, prepared_dir, tmp_path, capsys, extra):
    out = tmp_path / "dense"
    assert _convert(exported, prepared_dir, out, *extra) == 0
    dense = load_model(out)
    assert dense.config.moe is None and dense.config.d_ff == 2 * 16
    assert (out / "tokenizer.json").is_file()
    report = json.loads((out / "moe_to_dense.json").read_text())
    assert report["params"]["after"] == count_model_params(dense).total < report["params"]["before"]
    assert [len(p["kept"]) for p in report["layers"].values()] == [int(extra[3])] * 2
    assert "dense d_ff 32" in capsys.readouterr().out
    assert dense(torch.zeros(1, 4, dtype=torch.long)).logits_BLV.isfinite().all()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--keep", "1", "--groups", "2"], "keep: must be >= groups=2"),
        (["--keep", "5"], "keep: block 0 has 4 experts, cannot keep 5"),
        (["--keep", "3", "--groups", "2"], "grouping: single puts one expert in each group"),
        (["--keep", "2", "--score", "nope"], "score: got 'nope', allowed values: frequency, router_prob"),
        (["--keep", "2", "--scaling", "nope"], "scaling: got 'nope'"),
    ],
)
def test_impossible_combinations_are_one_line_errors(exported, prepared_dir, tmp_path, capsys, extra, message):
    assert _convert(exported, prepared_dir, tmp_path / "bad", *extra) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "bad").exists()


def test_refuses_a_busy_out_unless_forced_and_never_the_input(exported, prepared_dir, tmp_path, capsys):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert _convert(exported, prepared_dir, out, "--keep", "2") == 2
    assert "exists and is not empty; pass --force" in capsys.readouterr().err
    assert _convert(exported, prepared_dir, out, "--keep", "2", "--force") == 0
    assert _convert(exported, prepared_dir, exported, "--keep", "2", "--force") == 2
    assert "is or contains the input --checkpoint" in capsys.readouterr().err
    assert load_model(exported).config.is_moe

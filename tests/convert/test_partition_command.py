import json

import pytest
import torch

from moe_lit.checkpoint import export_model, load_model
from moe_lit.console_script import main
from moe_lit.model import Transformer
from tests.helpers.corpus import write_corpus
from tests.helpers.models import tiny


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from moe_lit.data.prepare import PrepareConfig, prepare

    root = tmp_path_factory.mktemp("partition-data")
    write_corpus(root / "corpus", files=2, paragraphs=30)
    prepare(
        PrepareConfig(
            source=str(root / "corpus"),
            out=root / "data",
            vocab_size=300,
            val_fraction=0.1,
            test_fraction=0.1,
            progress=False,
        )
    )
    return root / "data"


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    torch.manual_seed(0)
    dense = Transformer(tiny(dense=True, vocab_size=300)).eval()
    return export_model(dense, tmp_path_factory.mktemp("dense") / "dense"), dense


def _partition(dense_dir, out, *extra):
    return main(["convert", "partition", "--checkpoint", str(dense_dir), "--experts", "4", "--out", str(out), *extra])


def test_kmeans_partition_with_all_experts_equals_dense_and_out_is_protected(dense_dir, tmp_path, capsys):
    path, dense = dense_dir
    assert _partition(path, tmp_path / "moe", "--method", "kmeans", "--top-k", "4") == 0
    moe = load_model(tmp_path / "moe")
    idx = torch.randint(0, 300, (2, 16))
    assert (moe(idx).logits_BLV - dense(idx).logits_BLV).abs().max().item() < 1e-5
    record = json.loads((tmp_path / "moe" / "partition.json").read_text())
    assert (
        record["method"] == "kmeans"
        and record["router"] == "centroid"
        and record["active_params"] == record["total_params"]
    )
    capsys.readouterr()
    assert _partition(path, tmp_path / "moe", "--method", "random", "--top-k", "1") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not empty; pass --force" in err
    assert (
        _partition(path, tmp_path / "moe", "--method", "random", "--top-k", "1", "--router", "random", "--force") == 0
    )
    assert load_model(tmp_path / "moe").config.moe.top_k == 1


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--method", "coactivation"], "--calibration: --method coactivation needs calibration tokens"),
        (["--method", "kmeans", "--router", "trained"], "--calibration: --router trained needs"),
        (["--method", "dot_moe", "--router", "centroid"], "--router: dot_moe has no router to choose"),
        (["--method", "pruning", "--router", "centroid"], "--router: pruning has no router to choose"),
        (["--method", "pruning"], "--calibration: --method pruning needs calibration tokens"),
        (["--method", "kmeans", "--experts", "5"], "num_experts: must divide model.d_ff=64"),
        (["--method", "kmeans", "--router", "nope"], "--router: got 'nope', allowed values: centroid, trained, random"),
    ],
)
def test_bad_arguments_are_one_line_exit_2(dense_dir, tmp_path, capsys, extra, message):
    assert _partition(dense_dir[0], tmp_path / "x", *extra) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_coactivation_with_a_trained_router_reads_the_calibration_tokens(dense_dir, prepared, tmp_path):
    common = ["--calibration", str(prepared), "--batch-size", "2", "--top-k", "2"]
    assert (
        _partition(
            dense_dir[0],
            tmp_path / "co",
            "--method",
            "coactivation",
            "--router",
            "trained",
            "--router-steps",
            "5",
            "--calibration-tokens",
            "64",
            *common,
        )
        == 0
    )
    assert json.loads((tmp_path / "co" / "partition.json").read_text())["calibration_tokens"] == 64


def test_dot_moe_trains_on_the_token_budget_and_exports(dense_dir, prepared, tmp_path):
    path, _ = dense_dir
    common = ["--calibration", str(prepared), "--batch-size", "2", "--top-k", "2"]
    assert _partition(path, tmp_path / "dot", "--method", "dot_moe", "--train-tokens", "64", *common) == 0
    record = json.loads((tmp_path / "dot" / "partition.json").read_text())
    assert record["train_tokens"] == 64 and record["steps"] == 2 and not record["train_dense"]
    moe = load_model(tmp_path / "dot")
    assert moe.config.moe.unit_weights and (tmp_path / "dot" / "tokenizer.json").exists() is False
    assert torch.isfinite(moe(torch.randint(0, 300, (1, 16))).logits_BLV).all()


def test_pruning_is_the_dense_baseline_at_the_active_width(dense_dir, prepared, tmp_path, capsys):
    from moe_lit.convert.calibration import ffn_inputs
    from moe_lit.convert.prune_dense import prune_dense_ffn
    from moe_lit.lit.datamodule import calibration_batches

    path, dense = dense_dir
    args = ["--method", "pruning", "--top-k", "1", "--calibration", str(prepared), "--calibration-tokens", "64"]
    assert _partition(path, tmp_path / "pruned", *args) == 0
    assert "(pruning: dense, d_ff 64 -> 16," in capsys.readouterr().out
    pruned = load_model(tmp_path / "pruned")
    assert not pruned.config.is_moe and pruned.config.d_ff == 64 * 1 // 4
    # the same neurons as prune_dense_ffn on the same calibration stream
    expected = prune_dense_ffn(dense, ffn_inputs(dense, calibration_batches(prepared, dense.config, 8, 0), 64), 16)
    idx = torch.randint(0, 300, (2, 16))
    assert torch.equal(pruned(idx).logits_BLV, expected(idx).logits_BLV)
    record = json.loads((tmp_path / "pruned" / "partition.json").read_text())
    assert record["kept_neurons"] == 16 and record["calibration_tokens"] == 64 and record["router"] is None

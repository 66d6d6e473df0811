import torch

from moe_lit.checkpoint import export_model, load_model
from moe_lit.cli import main
from moe_lit.model import Transformer
from tests.helpers.models import tiny


def test_upcycle_then_expand_round_trip_through_exported_dirs(tmp_path, capsys):
    torch.manual_seed(0)
    dense = Transformer(tiny(dense=True)).eval()
    export_model(dense, tmp_path / "dense")
    argv = ["convert", "upcycle", "--checkpoint", str(tmp_path / "dense"), "--num-experts", "4", "--top-k", "1"]
    assert main([*argv, "--out", str(tmp_path / "moe")]) == 0
    assert (
        main(
            [
                "convert",
                "expand",
                "--checkpoint",
                str(tmp_path / "moe"),
                "--factor",
                "2",
                "--noise",
                "0",
                "--out",
                str(tmp_path / "moe8"),
            ]
        )
        == 0
    )
    assert "8 experts, top-1" in capsys.readouterr().out
    grown = load_model(tmp_path / "moe8")
    assert grown.config.moe.num_experts == 8 and grown.config.moe.balancing == "bias"
    idx = torch.randint(0, 97, (2, 16))
    assert (grown(idx).logits_BLV - dense(idx).logits_BLV).abs().max().item() < 1e-5


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    torch.manual_seed(0)
    export_model(Transformer(tiny()), tmp_path / "moe")
    assert main(["convert", "upcycle", "--checkpoint", str(tmp_path / "moe"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already an MoE" in err
    assert (
        main(
            [
                "convert",
                "expand",
                "--checkpoint",
                str(tmp_path / "moe"),
                "--counts",
                "1,2",
                "--out",
                str(tmp_path / "y"),
            ]
        )
        == 2
    )
    assert "counts: need 4 integers" in capsys.readouterr().err

import torch

from moe_lit.checkpoint import export_model, load_model
from moe_lit.console_script import main
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


def test_expand_refuses_its_own_input_and_a_non_empty_out_unless_force(tmp_path, capsys):
    torch.manual_seed(0)
    source = tmp_path / "moe"
    export_model(Transformer(tiny()).eval(), source)
    before = (source / "model.safetensors").read_bytes()
    expand = ["convert", "expand", "--checkpoint", str(source), "--factor", "2"]
    assert main([*expand, "--out", str(source)]) == 2
    assert main([*expand, "--out", str(source), "--force"]) == 2  # the input is refused even with --force
    assert main([*expand, "--out", str(source / "inside")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert all("is or contains the input --checkpoint" in line for line in err[:2]) and len(err) == 3
    assert "lies inside the input --checkpoint" in err[2]
    assert (source / "model.safetensors").read_bytes() == before and sorted(p.name for p in source.iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert main([*expand, "--out", str(out)]) == 2
    assert "exists and is not empty; pass --force" in capsys.readouterr().err
    assert (out / "keep.txt").is_file()
    assert main([*expand, "--out", str(out), "--force"]) == 0
    assert not (out / "keep.txt").exists() and load_model(out).config.moe.num_experts == 2 * tiny().moe.num_experts

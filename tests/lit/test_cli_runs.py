"""``moe-lit fit`` runs end to end on tiny prepared data: where its files go, and a diverging run."""

import csv
import math

import pytest
import torch

from moe_lit.checkpoint import export_model, load_model, read_lightning_checkpoint
from moe_lit.console_script import main
from moe_lit.data.layout import read_meta
from moe_lit.model import Transformer
from tests.helpers.cli_runs import fit as _fit
from tests.helpers.models import tiny


@pytest.mark.slow
def test_fit_writes_the_run_dir_prints_its_checkpoint_and_resumes_into_it(prepared, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "elsewhere"
    assert _fit(prepared, "--trainer.max_steps", "2", "--trainer.default_root_dir", str(root)) == 0
    last = root / "checkpoints" / "last.ckpt"
    assert f"fit: checkpoint {last}" in capsys.readouterr().out
    assert (root / "logs" / "fit" / "metrics.csv").is_file() and (root / "logs" / "fit" / "config.yaml").is_file()
    assert load_model(last).config.d_model == 32 and not (tmp_path / "runs").exists()
    # a fresh run refuses the non-empty run dir; a resume continues it under a log named by its step
    assert _fit(prepared, "--trainer.max_steps", "3", "--out", str(root)) == 2
    assert "holds a run stopped at step 2 of 3; pass --resume" in capsys.readouterr().err
    assert _fit(prepared, "--trainer.max_steps", "3", "--ckpt_path", str(last)) == 0
    assert sorted(p.name for p in (root / "logs").iterdir()) == ["fit", "fit-step2"]
    assert read_lightning_checkpoint(last)["global_step"] == 3
    # validate without any config: model and seq_len from the checkpoint, its log beside the others
    capsys.readouterr()
    argv = ["validate", "--ckpt_path", str(last), "--data.data_dir", str(prepared), "--trainer.enable_progress_bar"]
    assert main([*argv, "false", "--data.val_batches", "1"]) == 0
    assert "val/loss" in capsys.readouterr().out and (root / "logs" / "validate-step3" / "metrics.csv").is_file()
    # --force replaces the run (without --out a run goes to runs/<config stem>: the next test)
    assert _fit(prepared, "--trainer.max_steps", "1", "--out", str(root), "--force") == 0
    assert sorted(p.name for p in (root / "logs").iterdir()) == ["fit"]


def test_validate_takes_an_exported_dir_and_a_checkpoint_is_no_config(prepared, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = Transformer(tiny(vocab_size=read_meta(prepared)["vocab_size"], seq_len=16)).eval()
    export_model(model, tmp_path / "export")
    argv = ["--data.data_dir", str(prepared), "--trainer.enable_progress_bar", "false", "--data.val_batches", "1"]
    assert main(["validate", "--ckpt_path", str(tmp_path / "export"), *argv]) == 0
    with (tmp_path / "runs" / "validate" / "logs" / "validate" / "metrics.csv").open() as handle:
        (row,) = csv.DictReader(handle)
    assert math.isfinite(float(row["val/loss"]))
    capsys.readouterr()
    (tmp_path / "model.ckpt").write_bytes(b"PK\x03\x04\xff\xfe binary")
    err = _error(capsys, ["fit", "--config", str(tmp_path / "model.ckpt")])
    assert f"{tmp_path / 'model.ckpt'}: not a YAML file; a checkpoint goes to --ckpt_path" in err


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_a_diverging_run_stops_with_one_line_exit_2_and_keeps_the_last_finite_checkpoint(
    prepared, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    code = _fit(
        prepared, "--model.optim.lr", "1e6", "--trainer.max_steps", "30", "--checkpoint.every_n_train_steps", "1"
    )
    err = [line for line in capsys.readouterr().err.splitlines() if "moe-lit fit: error:" in line]
    assert code == 2 and len(err) == 1 and "training diverged at step" in err[0], err
    last = tmp_path / "runs" / "tiny-moe" / "checkpoints" / "last.ckpt"
    assert all(v.isfinite().all() for v in load_model(last).state_dict().values())

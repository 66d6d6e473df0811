"""``moe-lit accounting`` takes every model input form, labels rows apart and states the seq_len."""

from pathlib import Path

import torch

from moe_lit.accounting import forward_flops_per_token
from moe_lit.checkpoint import export_model, load_config
from moe_lit.config import ModelConfig
from moe_lit.console_script import main
from moe_lit.model import Transformer
from tests.helpers.checkpoints import lightning_checkpoint
from tests.helpers.models import tiny

REPO = Path(__file__).resolve().parents[2]
MODEL_YAML = REPO / "configs/model/tiny-moe.yaml"


def _rows(out: str) -> dict[str, list[str]]:
    lines = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| name")]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines)}


def _forms(tmp_path) -> dict[str, Path]:
    torch.manual_seed(0)
    model = Transformer(tiny(seq_len=32))
    (tmp_path / "a").mkdir()
    (tmp_path / "exp").mkdir()
    experiment = tmp_path / "exp" / "experiment.yaml"
    experiment.write_text(f"model: {MODEL_YAML}\ndata:\n  data_dir: nowhere\n  seq_len: 64\n")
    return {
        "model": MODEL_YAML,
        "experiment": experiment,
        "ckpt": lightning_checkpoint(tmp_path / "a" / "last.ckpt", model),
        "export": export_model(model, tmp_path / "b" / "last"),  # the same name as the .ckpt
    }


def test_every_input_form_gives_its_config_and_seq_len(tmp_path, capsys):
    forms = _forms(tmp_path)
    assert load_config(forms["model"]) == ModelConfig.from_yaml(MODEL_YAML)
    assert load_config(forms["experiment"]) == ModelConfig.from_yaml(MODEL_YAML).replace(seq_len=64)
    assert load_config(forms["ckpt"]) == load_config(forms["export"]) == tiny(seq_len=32)
    assert main(["accounting", "--config", *map(str, forms.values())]) == 0
    rows = _rows(capsys.readouterr().out)
    assert list(rows) == ["tiny-moe", "experiment", "a/last", "b/last"]  # same names told apart
    assert [row[0] for row in rows.values()] == ["256", "64", "32", "32"]  # the seq_len each row assumes
    flops = forward_flops_per_token(ModelConfig.from_yaml(MODEL_YAML).replace(seq_len=64))
    assert rows["experiment"][-1] == f"{flops:,}"
    assert main(["accounting", "--config", str(forms["ckpt"]), "--seq-len", "8"]) == 0
    assert _rows(capsys.readouterr().out)["last"][0] == "8"


def test_a_binary_file_where_yaml_is_expected_is_one_line(tmp_path, capsys):
    forms = _forms(tmp_path)
    fake = tmp_path / "model.yaml"
    fake.write_bytes(forms["ckpt"].read_bytes())
    assert main(["accounting", "--config", str(fake)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{fake}: not a YAML file" in err
    assert main(["eval", "--checkpoint", str(MODEL_YAML)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "a config holds no weights; pass a .ckpt or an exported directory" in err

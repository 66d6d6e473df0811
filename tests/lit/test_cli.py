"""``moe-lit fit|validate|test``: config mistakes are one line naming the key, exit status 2."""

import pytest

from moe_lit.console_script import main
from tests.helpers.paths import EXPERIMENT, REPO


def _error_line(capsys, argv) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "extra, key",
    [
        (["--model.model.d_modle", "3"], "model.model.d_modle: unknown key"),
        (["--data.batch_size", "x"], "data.batch_size: expected int"),
        (["--train.max_tokens", "0"], "train.max_tokens: must be a positive integer, got 0"),
        (["--train.max_tokens", "100", "--train.max_steps", "3"], "train.max_tokens: set exactly one"),
    ],
)
def test_command_line_mistakes_are_one_line_naming_the_key(capsys, extra, key):
    err = _error_line(capsys, ["fit", "--config", EXPERIMENT, *extra])
    assert err.startswith("moe-lit fit: error: ") and key in err


def test_tensorboard_logger_without_its_extra_names_the_extra(capsys, monkeypatch, prepared):
    from lightning.fabric.loggers import tensorboard

    monkeypatch.setattr(tensorboard, "_TENSORBOARD_AVAILABLE", False)
    monkeypatch.setattr(tensorboard, "_TENSORBOARDX_AVAILABLE", False)
    logger = ["--trainer.logger", "lightning.pytorch.loggers.TensorBoardLogger"]
    # NOTE: prepared data, so that the data check (which comes first) passes on a fresh clone too.
    assert main(["validate", "--config", EXPERIMENT, "--data.data_dir", str(prepared), *logger]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("moe-lit validate: error: ") and "tensorboard" in last
    assert last.endswith("(TensorBoardLogger: pip install 'moe_lit[tensorboard]')")


@pytest.mark.parametrize(
    "text, key",
    [
        ("model:\n  model:\n    moe:\n      top_kk: 2\n", "model.model.moe.top_kk: unknown key"),
        ("model:\n  model:\n    moe:\n      top_k: 9\n", "moe.top_k: must be <= num_experts=8, got 9"),
    ],
)
def test_config_file_mistakes_are_one_line_naming_the_key(capsys, tmp_path, text, key):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    err = _error_line(capsys, ["validate", "--config", EXPERIMENT, "--config", str(bad)])
    assert key in err


def test_help_shows_the_dataclass_field_docstrings(capsys):
    assert main(["fit", "--help"]) == 0
    out = capsys.readouterr().out
    assert "Residual stream width D." in out  # ModelConfig.d_model
    assert "Peak learning rate, reached at the end of the warmup." in out  # OptimConfig.lr
    assert "data.vocab_size --> model.model.vocab_size" in out


@pytest.mark.parametrize(
    "message, line",
    [
        (
            'Parser key "model.model.moe":\n  Does not validate against any of the Union subtypes\n  Subtypes: '
            "[<class 'moe_lit.config.MoEConfig'>, <class 'NoneType'>]\n  Errors:\n    - Problem with given class_path "
            "'moe_lit.MoEConfig':\n        Parser key \"top_k\":\n          Expected a <class 'int'>. Got value: abc\n"
            "    - Expected a <class 'NoneType'>\n  Given value type: <class 'dict'>\n  Given value: {'top_k': 'abc'}",
            "model.model.moe.top_k: expected int. Got value: abc",
        ),
        ("Subcommand 'fit' does not accept option 'trainr.max_steps'", "trainr.max_steps: unknown key"),
        (
            "usage: moe-lit fit [-h]\nunrecognized arguments: --model.model.d_modle 3",
            "model.model.d_modle: unknown key",
        ),
        (
            "Does not validate against any of the Union subtypes\nErrors:\n"
            "  - moe.top_k: must be <= num_experts=4, got 9"
            "\n  - Expected a <class 'NoneType'>",
            "moe.top_k: must be <= num_experts=4, got 9",
        ),
    ],
)
def test_config_error_line_flattens_nested_jsonargparse_messages(message, line):
    from moe_lit.lit.lightning_cli import config_error_line

    assert config_error_line(message) == line


def test_relative_data_dir_resolves_against_its_config_file_and_the_hint_names_the_path(capsys, tmp_path, monkeypatch):
    config = tmp_path / "configs" / "exp.yaml"
    config.parent.mkdir()
    config.write_text(
        f"model: {REPO / 'configs/model/tiny-moe.yaml'}\ndata:\n  data_dir: ../nodata\ntrain:\n  max_steps: 1\n"
    )
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    assert main(["fit", "--config", str(config)]) == 2
    (err,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]  # after "Seed set to"
    assert f"(no {tmp_path / 'nodata' / 'meta.json'})" in err and f"data prepare --out {tmp_path / 'nodata'}" in err
    # on the command line, a relative path is the working directory's
    assert main(["fit", "--config", str(config), "--data.data_dir", "here"]) == 2
    (err,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert f"(no {tmp_path / 'cwd' / 'here' / 'meta.json'})" in err


def test_the_packaged_experiments_read_moe_lit_data_never_a_dir_beside_the_config(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_LIT_DATA", str(tmp_path / "mine"))
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", EXPERIMENT]) == 2
    (err,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert f"(no {tmp_path / 'mine' / 'meta.json'})" in err


def test_predict_is_not_a_command(capsys):
    assert main(["predict"]) == 2
    assert "unknown command 'predict'" in capsys.readouterr().err


@pytest.mark.parametrize("given", ["{path}", "--config={path}"], ids=["config-value", "config-equals"])
def test_a_broken_yaml_names_its_file_and_line(capsys, tmp_path, given):
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  model:\n    d_model: [1, 2\n")
    args = ["--config", str(path)] if given == "{path}" else [given.format(path=path)]
    assert main(["fit", *args]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert (
        line
        == f"moe-lit fit: error: {path}: not valid YAML (line 4, column 1: expected ',' or ']', but got '<stream end>')"
    )


def test_a_broken_study_or_run_yaml_names_its_line(tmp_path):
    from moe_lit.config import ConfigError
    from moe_lit.lit.run_config import read_yaml

    (tmp_path / "s.yaml").write_text("name: x\nkind: [\n")
    with pytest.raises(ConfigError, match=r"study: .*s.yaml is not valid YAML \(line 3, column 1: expected the node"):
        read_yaml(tmp_path / "s.yaml", "study")

"""``moe-lit demo``: each model's run is the run YAML with the settings over it, under the model's optimizer."""

import pytest

import moe_lit.commands.demo as demo
from moe_lit.console_script import main
from moe_lit.lit.optim import OptimConfig


class Trained(Exception):
    """Stands in for training: the first model's run is what the test reads."""


@pytest.fixture
def first_run(tmp_path, monkeypatch):
    """The RunConfig demo trains its first model with, for the given arguments (nothing trains)."""
    runs = []

    def train_model(name, path, model_cfg, run_cfg, args, preemption):
        runs.append(run_cfg)
        raise Trained

    monkeypatch.setattr(demo, "prepare_default_data", lambda data_dir: tmp_path / "data")
    monkeypatch.setattr(demo, "train_model", train_model)

    def run(*argv):
        out = ["--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"), "--force"]
        with pytest.raises(Trained):
            main(["demo", *out, *argv])
        return runs[-1]

    return run


def test_the_shipped_run_is_the_demo_of_docs_demo_md(first_run, tmp_path):
    run = first_run()
    assert (run.data.seq_len, run.data.batch_size, run.data.val_batches) == (128, 16, 4)
    assert (run.steps, run.eval_every, run.train.seed) == (488, 81, 0)  # 1M tokens, 6 validations
    assert run.optim == OptimConfig(lr=2e-3, warmup_steps=30, schedule="cosine")  # tiny-dense.yaml's optim
    assert run.data.data_dir == str(tmp_path / "data")


def test_settings_go_over_the_yaml_and_the_model_optimizer(first_run, tmp_path):
    (tmp_path / "run.yaml").write_text("data: {batch_size: 4}\noptim: {warmup_steps: 0}\ntrain: {max_steps: 5}\n")
    run = first_run("--config", str(tmp_path / "run.yaml"), "--train.max_tokens", "2048", "--optim.lr=1e-3")
    assert (run.data.batch_size, run.train.max_steps, run.train.max_tokens, run.steps) == (4, None, 2048, 2)
    assert run.optim == OptimConfig(lr=1e-3, warmup_steps=0, schedule="cosine")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--train.max_step", "5"], "train: unknown key(s) ['max_step'], allowed keys: ['max_tokens'"),
        (["--data.seq_len", "0"], "data.seq_len: must be a positive integer, got 0"),
        (["--config", "nowhere.yaml"], "--config: no such file nowhere.yaml"),
    ],
)
def test_bad_settings_are_one_line_exit_2(argv, message, tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()

"""The one Trainer builder (``moe_lit.lit.trainer``): ``moe-lit fit`` and ``train_run`` reach it with
equal RunConfigs; what each interface adds (callbacks, checkpoint arguments) goes through it."""

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar

from moe_lit.callbacks import DivergenceGuard, RoutingMonitor
from moe_lit.callbacks.preemption import Preemption
from moe_lit.config import ConfigError
from moe_lit.console_script import main
from moe_lit.lit import lightning_cli, run
from moe_lit.lit.run import train_run
from moe_lit.lit.run_config import RunConfig
from moe_lit.lit.trainer import experiment_run
from moe_lit.resources import CONFIGS_DIR
from tests.helpers.paths import CONFIGS, EXPERIMENT

EXPERIMENTS = sorted((CONFIGS_DIR / "experiments").glob("*.yaml"))


class Reached(Exception):
    """Raised where the patched code is reached: nothing trains."""

    def __init__(self, value) -> None:
        self.value = value


def _reach(monkeypatch, module, train) -> RunConfig:
    """The RunConfig that ``train()`` gives the builder (as imported by ``module``)."""

    def builder(run_config, *args, **kwargs):
        raise Reached(run_config)

    monkeypatch.setattr(module, "trainer_arguments", builder)
    with pytest.raises(Reached) as caught:
        train()
    return caught.value.value


def _built(monkeypatch, train) -> pl.Trainer:
    """The Trainer that ``moe-lit <train>`` (a list of arguments) or ``train()`` builds (its fit
    patched to stop there)."""

    def fit(self, *args, **kwargs):
        raise Reached(self)

    monkeypatch.setattr(pl.Trainer, "fit", fit)
    with pytest.raises(Reached) as caught:
        main(train) if isinstance(train, list) else train()
    return caught.value.value


@pytest.mark.parametrize("experiment", EXPERIMENTS, ids=lambda p: p.stem)
def test_fit_and_train_run_reach_the_builder_with_equal_run_configs(experiment, prepared, tmp_path, monkeypatch):
    model, run_config = RunConfig.from_experiment(experiment)
    run_config = run_config.replace(data={"data_dir": str(prepared)})
    from_run = _reach(monkeypatch, run, lambda: train_run(model, run_config, tmp_path / "run"))
    argv = ["fit", "--config", str(experiment), "--data.data_dir", str(prepared), "--out", str(tmp_path / "fit")]
    from_fit = _reach(monkeypatch, lightning_cli, lambda: main(argv))
    assert from_fit == from_run == run_config


def test_fit_settings_reach_the_builder_as_run_config_fields(prepared, tmp_path, monkeypatch):
    argv = ["fit", "--config", EXPERIMENT, "--data.data_dir", str(prepared), "--out", str(tmp_path / "fit")]
    settings = ["--train.max_tokens", "4096", "--train.val_every", "3", "--train.seed", "7", "--model.optim.lr", "0.5"]
    got = _reach(monkeypatch, lightning_cli, lambda: main([*argv, *settings, "--trainer.accumulate_grad_batches", "2"]))
    # NOTE: the experiment's trainer says max_steps 500 and val_check_interval 100; train's fields win.
    assert (got.steps, got.eval_every, got.train.seed, got.optim.lr) == (4096 // (128 * 16), 3, 7, 0.5)
    assert got.trainer["accumulate_grad_batches"] == 2 and "max_steps" not in got.trainer


def test_the_cli_trainer_has_the_builders_callbacks_with_its_own_settings(prepared, tmp_path, monkeypatch):
    argv = ["fit", "--config", EXPERIMENT, "--data.data_dir", str(prepared), "--out", str(tmp_path / "fit")]
    settings = ["--train.checkpoint_every", "3", "--checkpoint.save_top_k", "-1", "--divergence.policy", "skip"]
    trainer = _built(monkeypatch, [*argv, *settings, "--train.precision", "32-true"])
    kinds = [type(c).__name__ for c in trainer.callbacks]
    for kind in (ModelCheckpoint, DivergenceGuard, Preemption, RoutingMonitor, ProgressBar):
        assert sum(isinstance(c, kind) for c in trainer.callbacks) == 1, kinds
    (checkpoint,) = [c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)]
    (guard,) = [c for c in trainer.callbacks if isinstance(c, DivergenceGuard)]
    (preemption,) = [c for c in trainer.callbacks if isinstance(c, Preemption)]
    assert (checkpoint._every_n_train_steps, checkpoint.save_top_k, checkpoint.save_last) == (3, -1, True)
    assert checkpoint.dirpath == str(tmp_path / "fit" / "checkpoints")
    assert guard.policy == "skip" and preemption.label == "moe-lit fit"
    assert (trainer.max_steps, trainer.val_check_interval, trainer.log_every_n_steps) == (500, 100, 10)
    assert "MoEModelSummary" in kinds and "SaveConfigCallback" in kinds


def test_a_fit_without_a_budget_is_one_line_naming_it(capsys, tmp_path):
    assert main(["fit", "--model", str(CONFIGS / "model/tiny-moe.yaml"), "--out", str(tmp_path / "fit")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("moe-lit fit: error: train.max_tokens: set exactly one of max_tokens and max_steps")


def test_experiment_run_reads_the_trainer_budget_cadence_and_seed_where_train_leaves_them_unset():
    sections = {
        "seed_everything": 5,
        "data": {"seq_len": 16, "batch_size": 2, "seed": 9},
        "model": {"optim": {"lr": 0.01}},
        "trainer": {"max_steps": 40, "val_check_interval": 10, "devices": "auto", "gradient_clip_val": 1.0},
        "checkpoint": {"every_n_train_steps": 20},
    }
    got = experiment_run(sections)
    assert (got.steps, got.eval_every, got.train.checkpoint_every, got.train.seed) == (40, 10, 20, 5)
    # NOTE: devices "auto" is Lightning's default: no setting; data.seed is the data module's own.
    assert got.trainer == {"val_check_interval": 10, "gradient_clip_val": 1.0} and got.optim.lr == 0.01
    train = {"max_tokens": 320, "val_every": 2, "checkpoint_every": 4, "seed": 1}
    got = experiment_run({**sections, "train": train})
    assert (got.steps, got.eval_every, got.train.checkpoint_every, got.train.seed) == (10, 2, 4, 1)
    with pytest.raises(ConfigError, match=r"^train\.val_every: must be a positive integer, got 0$"):
        experiment_run({**sections, "train": {"val_every": 0}})


def test_train_deterministic_reaches_the_trainer_of_both_interfaces(prepared, tmp_path, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # NOTE: Lightning sets it for deterministic runs
    argv = ["fit", "--config", EXPERIMENT, "--data.data_dir", str(prepared), "--train.precision", "32-true"]
    try:
        _built(monkeypatch, [*argv, "--out", str(tmp_path / "fit"), "--train.deterministic", "true"])
        assert torch.are_deterministic_algorithms_enabled()
        _built(monkeypatch, [*argv, "--out", str(tmp_path / "plain")])
        assert not torch.are_deterministic_algorithms_enabled()
        model, run_config = RunConfig.from_experiment(EXPERIMENT)
        run_config = run_config.replace(data={"data_dir": str(prepared)}, train={"deterministic": True})
        _built(monkeypatch, lambda: train_run(model, run_config, tmp_path / "run"))
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)

"""One experiment YAML, two ways to train it: ``moe-lit fit --config`` and ``train_run`` of
``RunConfig.from_experiment`` build Trainers with equal arguments."""

import lightning.pytorch as pl
import pytest

from moe_lit.console_script import main
from moe_lit.lit.run import train_run
from moe_lit.lit.run_config import RunConfig
from moe_lit.resources import CONFIGS_DIR

EXPERIMENTS = sorted((CONFIGS_DIR / "experiments").glob("*.yaml"))
INTERFACE_CALLBACKS = {"MoEModelSummary", "SaveConfigCallback", "ValidationCurve"}
"""Callbacks of one interface only: the CLI's summary and saved config, train_run's record curve."""


class Built(Exception):
    """Raised by a patched ``Trainer.fit``: the Trainer is built, nothing trains."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer


def _arguments(trainer: pl.Trainer) -> dict:
    callbacks = {type(c).__name__: c for c in trainer.callbacks}
    checkpoint, routing = callbacks["ModelCheckpoint"], callbacks["RoutingMonitor"]
    return {
        "max_steps": trainer.max_steps,
        "val_check_interval": trainer.val_check_interval,
        "check_val_every_n_epoch": trainer.check_val_every_n_epoch,
        "num_sanity_val_steps": trainer.num_sanity_val_steps,
        "log_every_n_steps": trainer.log_every_n_steps,
        "precision": trainer.precision,
        "gradient_clip_val": trainer.gradient_clip_val,
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "limit_val_batches": trainer.limit_val_batches,
        "strategy": type(trainer.strategy).__name__,
        "devices": trainer.num_devices,
        "logger": type(trainer.logger).__name__,
        "callbacks": sorted(set(callbacks) - INTERFACE_CALLBACKS),
        "checkpoint": (checkpoint.save_last, checkpoint.save_top_k, checkpoint._every_n_train_steps),
        "routing_every": routing.every_n_steps,
    }


def _built(monkeypatch, train) -> dict:
    def fit(self, *args, **kwargs):
        raise Built(self)

    monkeypatch.setattr(pl.Trainer, "fit", fit)
    with pytest.raises(Built) as caught:
        train()
    return _arguments(caught.value.trainer)


@pytest.mark.parametrize("experiment", EXPERIMENTS, ids=lambda p: p.stem)
def test_fit_and_train_run_build_the_same_trainer_from_one_experiment(experiment, prepared, tmp_path, monkeypatch):
    model, run = RunConfig.from_experiment(experiment)
    run = run.replace(data={"data_dir": str(prepared)}, train={"precision": "32-true"})
    from_run = _built(monkeypatch, lambda: train_run(model, run, tmp_path / "run"))
    argv = ["fit", "--config", str(experiment), "--data.data_dir", str(prepared), "--out", str(tmp_path / "fit")]
    from_fit = _built(monkeypatch, lambda: main([*argv, "--train.precision", "32-true"]))
    assert from_fit == from_run

"""What ``moe-lit fit|validate`` print: no Lightning notices, our FLOPs, step/max_steps, one table."""

import json
import logging
import warnings
from types import SimpleNamespace

import pytest
import torch

from moe_lit.accounting import forward_flops_per_token
from moe_lit.checkpoint import load_model
from moe_lit.lit.console import (
    LIGHTNING_LOGGERS,
    LIGHTNING_NOTICES,
    LIGHTNING_WARNINGS,
    MoEProgressBar,
    evaluation_table,
    quiet_lightning,
    step_metrics,
)
from moe_lit.model.router import RoutingStats
from tests.helpers.cli_runs import TINY
from tests.helpers.cli_runs import fit as _fit
from tests.helpers.paths import EXPERIMENT

LAST = "runs/tiny-moe/checkpoints/last.ckpt"  # the run directory of configs/experiments/tiny-moe.yaml


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def lightning_info():
    """Every info line that reaches the handlers of the Lightning loggers quiet_lightning filters."""
    handler = _Records()
    loggers = [logging.getLogger(name) for name in LIGHTNING_LOGGERS]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler.messages
    for logger in loggers:
        logger.removeHandler(handler)


def test_fit_prints_our_flops_and_no_lightning_notices(prepared, tmp_path, monkeypatch, capsys, lightning_info):
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _fit(prepared, "--trainer.max_steps", "2", "--trainer.enable_model_summary", "true") == 0
    out = capsys.readouterr().out
    forward = forward_flops_per_token(load_model(tmp_path / LAST).config)
    assert f"training {3 * forward:,} = 3 x forward {forward:,}" in out and "Total FLOPs: 0" not in out
    assert not [m for m in lightning_info if m.startswith(LIGHTNING_NOTICES)], lightning_info
    noise = [str(w.message) for w in caught if any(p.strip("\\`") in str(w.message) for p in ("LeafSpec", "__len__"))]
    assert not noise, noise


def test_quiet_lightning_drops_only_the_listed_notices(lightning_info):
    logger = logging.getLogger(LIGHTNING_LOGGERS[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_lightning():
            logger.info(LIGHTNING_NOTICES[0] + " try litlogger")
            logger.info("GPU available: False")
            warnings.warn("Your `IterableDataset` has `__len__` defined. ...", UserWarning, stacklevel=1)
            warnings.warn("something else", UserWarning, stacklevel=1)
    assert lightning_info == ["GPU available: False"] and [str(w.message) for w in caught] == ["something else"]
    logger.info(LIGHTNING_NOTICES[0])  # outside the block: shown again
    assert lightning_info[-1] == LIGHTNING_NOTICES[0] and len(LIGHTNING_WARNINGS) == 2


def test_validate_prints_one_table_with_a_row_per_language(prepared, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert _fit(prepared, "--trainer.max_steps", "1") == 0
    capsys.readouterr()
    from moe_lit.cli import main

    argv = ["validate", "--config", EXPERIMENT, "--data.data_dir", str(prepared), *TINY, "--ckpt_path", LAST]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "DataLoader" not in out
    lines = [line for line in out.splitlines() if line.startswith("|")]
    languages = json.loads((prepared / "meta.json").read_text())["languages"]
    assert lines[0] == "| language | val/loss | val/ppl |"
    assert [line.split(" | ")[0].removeprefix("| ") for line in lines[2:-1]] == languages
    assert lines[-1].startswith("| overall | ")


def test_evaluation_table_rows_follow_the_languages_and_end_with_overall():
    metrics = {"val/loss_de": torch.tensor(2.0), "val/loss_en": 1.0, "val/loss": 1.5, "val/ppl": 4.48}
    rows = evaluation_table(metrics, "val", ["en", "de", "fr"])
    assert [row["language"] for row in rows] == ["en", "de", "overall"]  # fr was not evaluated
    assert rows[1]["val/ppl"] == pytest.approx(torch.tensor(2.0).exp().item())


def test_progress_bar_counts_optimizer_steps_of_the_whole_run():
    bar = MoEProgressBar()
    bar._trainer = SimpleNamespace(max_steps=10, global_step=30, num_training_batches=4, max_epochs=-1)
    assert bar.total_train_batches == 10 and bar._get_train_description(2).strip() == "Step"
    bar._trainer = SimpleNamespace(max_steps=-1, global_step=0, num_training_batches=4, max_epochs=3)
    assert bar.total_train_batches == 4 and bar._get_train_description(1).strip() == "Epoch 1/2"


def test_step_metrics_show_losses_lr_throughput_and_load_imbalance():
    counts = torch.tensor([6.0, 2.0, 0.0, 0.0])  # max/mean = 6 / 2
    stats = RoutingStats(tokens_per_expert_E=counts, dropped=0.0, mean_entropy=1.0, num_tokens=4)
    trainer = SimpleNamespace(
        callback_metrics={
            "train/loss": torch.tensor(2.5),
            "train/ce": torch.tensor(2.4),
            "train/load_balancing": torch.tensor(0.1),
            "train/lr": torch.tensor(3e-4),
        },
        logged_metrics={"train/device/items_per_sec": torch.tensor(6172.5)},
        world_size=2,
    )
    module = SimpleNamespace(model=SimpleNamespace(routing_stats=lambda: {1: stats}))
    assert step_metrics(trainer, module) == {
        "loss": "2.500",
        "ce": "2.400",
        "load_balancing": "0.1000",
        "lr": "3.00e-04",
        "tok/s": "12.3k",
        "imbalance": "3.00",
    }


def test_train_run_prints_no_lightning_notices(prepared, tmp_path, lightning_info):
    from moe_lit.lit.run_config import RunConfig
    from moe_lit.lit.runner import train_run
    from tests.helpers.models import tiny

    run = RunConfig.from_dict(
        {
            "data": {"data_dir": str(prepared), "seq_len": 16, "batch_size": 2, "val_batches": 1},
            "train": {"max_steps": 0},
            "trainer": {"enable_progress_bar": False, "accelerator": "cpu"},
        }
    )
    train_run(tiny(vocab_size=300, seq_len=16), run, tmp_path / "run")
    assert not [m for m in lightning_info if m.startswith(LIGHTNING_NOTICES)], lightning_info

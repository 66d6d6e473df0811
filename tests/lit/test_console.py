"""What ``moe-lit fit|validate`` print: no Lightning notices, our FLOPs, step/max_steps, one table."""

import io
import json
import logging
import subprocess
import sys
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
    StepLines,
    evaluation_table,
    fitting_metrics,
    progress_bar,
    quiet_lightning,
    step_line,
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
            logger.info("GPU available: False, used: False")
            logger.info("TPU available: False, using: 0 TPU cores")
            logger.info("Restoring states from the checkpoint path at last.ckpt")
            warnings.warn("Your `IterableDataset` has `__len__` defined. ...", UserWarning, stacklevel=1)
            warnings.warn("something else", UserWarning, stacklevel=1)
    assert lightning_info == ["Restoring states from the checkpoint path at last.ckpt"]
    assert [str(w.message) for w in caught] == ["something else"]
    logger.info(LIGHTNING_NOTICES[0])  # outside the block: shown again
    assert lightning_info[-1] == LIGHTNING_NOTICES[0] and len(LIGHTNING_WARNINGS) == 3


def test_a_warning_inside_quiet_lightning_is_one_line_without_its_source_line():
    script = (
        "import warnings\n"
        "from moe_lit.lit.console import quiet_lightning\n"
        "with quiet_lightning():\n"
        "    warnings.warn(\n"
        "        'a warning',\n"
        "    )\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert proc.stderr.strip().splitlines() == ["<string>:4: UserWarning: a warning"]


def test_validate_prints_one_table_with_a_row_per_language(prepared, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert _fit(prepared, "--trainer.max_steps", "1") == 0
    capsys.readouterr()
    from moe_lit.console_script import main

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
    from moe_lit.lit.run import train_run
    from moe_lit.lit.run_config import RunConfig
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


SHOWN = {
    "loss": "8.040",
    "ce": "8.030",
    "load_balancing": "0.0100",
    "z_loss": "0.0001",
    "val/loss": "7.912",
    "lr": "3.00e-04",
    "tok/s": "12.3k",
    "imbalance": "1.42",
}


def test_the_progress_bar_is_one_line_at_80_columns_with_the_most_telling_fields():
    from rich.console import Console
    from rich.progress import Progress, TextColumn

    bar = MoEProgressBar()
    bar._trainer = SimpleNamespace(max_steps=2000, global_step=37, num_training_batches=4, max_epochs=-1)
    shown = fitting_metrics(SHOWN, bar.metrics_width(80))
    assert list(shown) == ["loss", "lr", "tok/s"]  # the rest does not fit beside bar, count and ETA
    metrics = " ".join(f"{name}: {value}" for name, value in shown.items())
    progress = Progress(*bar.configure_columns(bar._trainer), TextColumn(metrics), auto_refresh=False)
    progress.add_task("Step", total=2000, completed=2000)
    progress.add_task(bar.validation_description, total=12, completed=3)
    out = io.StringIO()
    Console(file=out, width=80, color_system=None).print(progress.make_tasks_table(progress.tasks))
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("Step") and "2000/2000" in lines[0], lines  # nothing wraps
    assert lines[0].rstrip().endswith("loss: 8.040 lr: 3.00e-04 tok/s: 12.3k"), lines
    assert list(fitting_metrics(SHOWN, 200)) == [
        "loss",
        "lr",
        "tok/s",
        "imbalance",
        "val/loss",
        "ce",
        *list(SHOWN)[2:4],
    ]


def test_step_lines_are_plain_and_come_every_n_steps_and_after_a_pause(capsys, monkeypatch):
    lines = StepLines(every_n_steps=5, max_interval_s=20)
    trainer = SimpleNamespace(
        max_steps=100, global_step=0, log_every_n_steps=50, is_global_zero=True, callback_metrics={}, logged_metrics={}
    )
    module = SimpleNamespace(model=None)
    clock = iter([0.0, 1.0, 2.0, 3.0, 30.0])
    monkeypatch.setattr("moe_lit.lit.console.time.monotonic", lambda: next(clock))
    lines.on_train_start(trainer, module)
    for step, loss in ((1, 8.0), (2, 7.5), (5, 7.0), (6, 6.5)):  # at 0, 1, 2 and 30 s
        trainer.global_step, trainer.callback_metrics = step, {"train/loss": torch.tensor(loss)}
        lines.on_train_batch_end(trainer, module, None, None, step - 1)
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "step 1/100  loss 8.000  eta 0:01:39",  # the first step: the run has started
        "step 5/100  loss 7.000  eta 0:00:57",  # every 5 steps: 3 s for 5 steps, 95 to go
        "step 6/100  loss 6.500  eta 0:07:50",  # 27 s since the last line
    ]
    assert "\x1b" not in out
    assert step_line(trainer, {"loss": "1.000", "lr": "1.00e-03", "tok/s": "5.0k"}, None) == (
        "step 6/100  loss 1.000  lr 1.00e-03  tok/s 5.0k  eta -:--:--"
    )


def test_progress_bar_is_the_rich_bar_on_a_terminal_and_step_lines_in_a_log():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert isinstance(progress_bar(Terminal()), MoEProgressBar)
    assert isinstance(progress_bar(io.StringIO()), StepLines)


def test_fit_into_a_log_prints_step_lines_and_no_escape_codes(prepared, tmp_path):
    argv = ["fit", "--config", EXPERIMENT, "--data.data_dir", str(prepared), *TINY, "--trainer.max_steps", "3"]
    argv = [arg for arg in argv if arg not in ("--trainer.enable_progress_bar", "false")]
    proc = subprocess.run(
        [sys.executable, "-m", "moe_lit.console_script", *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split("  ")[0] for line in steps] == ["step 1/3", "step 2/3", "step 3/3"], proc.stdout
    assert all(" loss " in f" {line} " and "eta " in line for line in steps)
    assert "\x1b" not in proc.stdout + proc.stderr
    assert "GPU available" not in proc.stdout + proc.stderr and "rank_zero_warn(" not in proc.stderr


def test_data_prepare_into_a_log_writes_no_escape_codes_and_no_blank_lines(tmp_path):
    from tests.helpers.corpus import write_corpus

    corpus = write_corpus(tmp_path / "corpus", files=2, paragraphs=20)
    argv = ["data", "prepare", "--source", str(corpus), "--out", str(tmp_path / "data"), "--vocab-size", "300"]
    proc = subprocess.run(
        [sys.executable, "-m", "moe_lit.console_script", *argv], capture_output=True, text=True, check=True
    )
    assert "\x1b" not in proc.stdout + proc.stderr and "\r" not in proc.stdout + proc.stderr
    assert "" not in proc.stdout.splitlines()[:3], proc.stdout  # the tokenizer's bars printed blank lines

"""Resuming a run: one ``last.ckpt``, always the newest, and a resumed run equal to an uninterrupted one."""

import json

import pytest
import torch

from moe_lit.callbacks.preemption import Interrupted
from moe_lit.checkpoint import read_lightning_checkpoint
from moe_lit.lit.optim import OptimConfig
from moe_lit.lit.run import read_metrics, train_run
from moe_lit.lit.run_config import DataConfig, RunConfig, TrainConfig
from tests.helpers.cli_runs import fit
from tests.helpers.models import tiny
from tests.lit.fakes import SignalAt

STEPS = 8


def _interrupt_at(step: int) -> list[str]:
    """``--trainer.callbacks`` of a Ctrl-C (SIGINT) at the start of step ``step + 1``."""
    callback = {"class_path": "tests.lit.fakes.SignalAt", "init_args": {"step": step}}
    return ["--trainer.callbacks+", json.dumps(callback)]


def _losses(run) -> dict[int, float]:
    return {
        int(row["step"]): row["train/loss"]
        for path in sorted((run / "logs").glob("*/metrics.csv"))
        for row in read_metrics(path)
        if "train/loss" in row
    }


def test_interrupt_resume_interrupt_resume_equals_an_uninterrupted_fit_with_one_last_ckpt(
    prepared, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    budget = ["--trainer.max_steps", str(STEPS), "--train.val_every", "4"]
    assert fit(prepared, *budget, "--out", "full") == 0
    assert fit(prepared, *budget, "--out", "cut", *_interrupt_at(2)) == 130
    assert fit(prepared, *budget, "--out", "cut", "--resume", *_interrupt_at(5)) == 130
    last = tmp_path / "cut" / "checkpoints" / "last.ckpt"
    assert read_lightning_checkpoint(last)["global_step"] == 6  # the newest, not the first interruption's
    assert fit(prepared, *budget, "--out", "cut", "--resume") == 0
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()) == ["last.ckpt"]
    assert sorted(p.name for p in (tmp_path / "cut" / "logs").iterdir()) == ["fit", "fit-step3", "fit-step6"]
    full, cut = (read_lightning_checkpoint(tmp_path / run / "checkpoints" / "last.ckpt") for run in ("full", "cut"))
    assert cut["global_step"] == full["global_step"] == STEPS
    assert all(torch.equal(cut["state_dict"][k], v) for k, v in full["state_dict"].items())  # bit-exact
    losses = _losses(tmp_path / "cut")
    assert sorted(losses) == list(range(STEPS)) and losses == _losses(tmp_path / "full")


def _weights(path) -> dict[str, torch.Tensor]:
    return read_lightning_checkpoint(path)["state_dict"]


def test_train_run_interrupted_twice_and_resumed_equals_an_uninterrupted_run_with_one_last_ckpt(prepared, tmp_path):
    # the study worker's and the demo's path: train_run(resume_from=<run>/checkpoints/last.ckpt)
    run = RunConfig(
        data=DataConfig(data_dir=str(prepared), seq_len=16, batch_size=4, val_batches=1),
        optim=OptimConfig(warmup_steps=2),
        train=TrainConfig(max_steps=STEPS, val_every=4, seed=0),
        trainer={"log_every_n_steps": 1, "enable_progress_bar": False},
    )
    full = train_run(tiny(), run, tmp_path / "full")
    last = tmp_path / "cut" / "checkpoints" / "last.ckpt"
    with pytest.raises(Interrupted):
        train_run(tiny(), run, tmp_path / "cut", callbacks=[SignalAt(2)])
    with pytest.raises(Interrupted):
        train_run(tiny(), run, tmp_path / "cut", callbacks=[SignalAt(5)], resume_from=last)
    assert read_lightning_checkpoint(last)["global_step"] == 6
    cut = train_run(tiny(), run, tmp_path / "cut", resume_from=last)
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"] and cut.checkpoint == str(last)
    assert read_lightning_checkpoint(last)["global_step"] == cut.steps == STEPS
    assert all(torch.equal(_weights(last)[k], v) for k, v in _weights(full.checkpoint).items())  # bit-exact
    assert (cut.val_loss, cut.curve) == (full.val_loss, full.curve)
    losses = {int(r["step"]): r["train/loss"] for r in read_metrics(cut.metrics_csv) if "train/loss" in r}
    assert losses == {int(r["step"]): r["train/loss"] for r in read_metrics(full.metrics_csv) if "train/loss" in r}
    assert sorted(losses) == list(range(STEPS))

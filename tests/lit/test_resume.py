"""Resuming a run: one ``last.ckpt``, always the newest, and a resumed run equal to an uninterrupted one."""

import dataclasses
import json
import shutil

import pytest
import torch

from moe_lit.callbacks.preemption import Interrupted
from moe_lit.checkpoint import read_lightning_checkpoint
from moe_lit.console_script import main
from moe_lit.lit.optim import OptimConfig
from moe_lit.lit.resume import NEW_RUN_HINT, WEIGHTS_HINT
from moe_lit.lit.run import read_metrics, train_run
from moe_lit.lit.run_config import DataConfig, RunConfig, TrainConfig
from tests.helpers.cli_runs import fit
from tests.helpers.models import tiny
from tests.lit.fakes import SignalAt

STEPS = 8


@pytest.fixture(scope="module")
def one_step(prepared, tmp_path_factory):
    """A finished 1-step ``moe-lit fit`` run directory of the tiny experiment (read only)."""
    root = tmp_path_factory.mktemp("one_step")
    assert fit(prepared, "--trainer.max_steps", "1", "--out", str(root / "run")) == 0
    return root / "run"


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


@pytest.mark.slow
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


@pytest.mark.slow
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


def _other_data(prepared, root, vocab_size: int):
    """The corpus of ``prepared`` prepared again with a tokenizer of ``vocab_size`` tokens."""
    from moe_lit.data.prepare import PrepareConfig, prepare
    from tests.helpers.corpus import write_corpus

    corpus = write_corpus(root / "corpus", files=2, paragraphs=40)
    config = PrepareConfig(source=str(corpus), out=root / "data", vocab_size=vocab_size, val_fraction=0.1)
    prepare(dataclasses.replace(config, test_fraction=0.1, progress=False))
    return root / "data"


@pytest.mark.slow
def test_a_resume_onto_other_data_is_one_line_and_exit_2_and_init_from_starts_a_new_run(
    prepared, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    assert fit(prepared, "--trainer.max_steps", "2", "--out", "run") == 0
    resume = ["--trainer.max_steps", "4", "--out", "run", "--resume"]
    smaller = _other_data(prepared, tmp_path / "smaller", 280)
    capsys.readouterr()
    assert fit(smaller, *resume) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(
        f"moe-lit fit: error: --ckpt_path: vocab_size is 300 in the checkpoint but 280 in the data {smaller}"
    )
    # the same vocabulary size, another tokenizer (its file differs)
    other = tmp_path / "other"
    shutil.copytree(prepared, other)
    tokenizer = other / "tokenizer.json"
    tokenizer.write_text(json.dumps(json.loads(tokenizer.read_text()), indent=1))
    assert fit(other, *resume) == 2
    assert "--ckpt_path: the tokenizer's sha256 is " in capsys.readouterr().err
    # weights only, on other data: an explicit new run
    init = ["--init_from", str(tmp_path / "run/checkpoints/last.ckpt"), "--trainer.max_steps", "2"]
    assert fit(other, *init, "--out", "tuned") == 0
    assert read_lightning_checkpoint(tmp_path / "tuned/checkpoints/last.ckpt")["global_step"] == 2
    assert fit(other, *init, "--model.model.d_model", "64", "--out", "wider") == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(f"--init_from: model.d_model is 32 in the checkpoint but 64 given; {WEIGHTS_HINT}")
    )
    assert fit(other, *init, "--resume", "--out", "run") == 2
    assert "--init_from starts a new run from weights, --resume/--ckpt_path continue one" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("given", "refusal"),
    [
        (["--model.model.d_model", "64"], "model.d_model is 32 in the checkpoint but 64 given"),
        (["--model.model.moe.num_experts", "8"], "model.moe.num_experts is 4 in the checkpoint but 8 given"),
        (["--model.optim.lr", "0.5"], "optim.lr is 0.002 in the checkpoint but 0.5 given"),
        (["--data.seq_len", "32"], "data.seq_len is 16 in the checkpoint but 32 given"),
    ],
    ids=["model", "moe", "optim", "seq_len"],
)
def test_settings_given_on_resume_with_another_value_are_refused(prepared, one_step, capsys, given, refusal):
    assert fit(prepared, "--trainer.max_steps", "2", "--out", str(one_step), "--resume", *given) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == f"moe-lit fit: error: --ckpt_path: {refusal}; {NEW_RUN_HINT}"


def test_only_the_settings_given_are_compared_on_a_resume_without_a_config(prepared, one_step, capsys):
    bare = ["fit", "--ckpt_path", str(one_step / "checkpoints/last.ckpt"), "--data.data_dir", str(prepared)]
    assert main([*bare, "--model.optim.lr", "0.5"]) == 2  # the model is not given: the checkpoint's
    assert f"--ckpt_path: optim.lr is 0.002 in the checkpoint but 0.5 given; {NEW_RUN_HINT}" in capsys.readouterr().err


def test_a_dense_config_resuming_an_moe_checkpoint_is_refused(prepared, one_step, capsys):
    from tests.helpers.paths import CONFIGS

    dense = ["fit", "--config", str(CONFIGS / "experiments/tiny-dense.yaml"), "--data.data_dir", str(prepared)]
    last = str(one_step / "checkpoints/last.ckpt")
    assert main([*dense, "--ckpt_path", last, "--train.precision", "null"]) == 2
    assert "--ckpt_path: model.d_model is 32 in the checkpoint but " in capsys.readouterr().err


def _lrs(path) -> dict[int, float]:
    return {int(row["step"]): row["train/lr"] for row in read_metrics(path) if "train/lr" in row}


@pytest.mark.slow
def test_extending_a_finished_run_keeps_its_schedule_or_replans_it_when_asked_and_says_which(
    prepared, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    short = ["--model.optim.warmup_steps", "1", "--trainer.max_steps", "4"]
    assert fit(prepared, *short, "--out", "kept") == 0
    shutil.copytree(tmp_path / "kept", tmp_path / "replanned")
    capsys.readouterr()
    longer = ["--model.optim.warmup_steps", "1", "--trainer.max_steps", "8", "--resume"]
    assert fit(prepared, *longer, "--out", "kept") == 0
    kept_line = "schedule: the run's, over 4 steps (past step 4 the lr stays at its end value); "
    assert kept_line + "--train.extend_schedule replan re-plans it over 8" in capsys.readouterr().out
    end = _lrs(tmp_path / "kept/logs/fit/metrics.csv")[3]
    assert end == pytest.approx(2e-3 * 0.1)  # tiny-moe: cosine to min_lr_ratio 0.1 of lr 2e-3
    assert _lrs(tmp_path / "kept/logs/fit-step4/metrics.csv") == {step: end for step in range(4, 8)}
    assert fit(prepared, *longer, "--train.extend_schedule", "replan", "--out", "replanned") == 0
    assert "schedule: re-planned over 8 steps (the run's was 4" in capsys.readouterr().out
    replanned = _lrs(tmp_path / "replanned/logs/fit-step4/metrics.csv")
    assert replanned[4] > end and replanned[7] == pytest.approx(end)  # rises again, ends at the floor at step 8

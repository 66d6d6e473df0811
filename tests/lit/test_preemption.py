"""Signals stop a run at a step boundary with a resumable checkpoint, one line and exit 128 + signal;
rerunning into a run directory offers --resume beside --force."""

import json
import os
import shlex
import signal
import sys

import lightning.pytorch as pl
import pytest
import torch
import yaml

from moe_lit.callbacks.preemption import Interrupted, Preemption, command_line
from moe_lit.checkpoint import read_lightning_checkpoint
from moe_lit.console_script import main
from moe_lit.lit.module import MoELitModule
from moe_lit.lit.optim import OptimConfig
from moe_lit.lit.resume import existing_run_message, fit_resume_command
from moe_lit.lit.run import read_metrics
from moe_lit.resources import CONFIGS_DIR
from tests.helpers.cli_runs import TINY
from tests.helpers.cli_runs import fit as _fit
from tests.helpers.models import tiny
from tests.helpers.paths import EXPERIMENT
from tests.helpers.signals import interruption, signal_when_checkpointed
from tests.lit.fakes import RandomTokenDataModule

STEPS = 10


class SignalAt(pl.Callback):
    """Sends ``signums`` to this process at the start of optimizer step ``step + 1``."""

    def __init__(self, step: int, *signums: int) -> None:
        self.step, self.signums = step, signums

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and self.signums:
            for signum in self.signums:
                os.kill(os.getpid(), signum)
            self.signums = ()


def _trainer(tmp_path, *callbacks, **kwargs) -> pl.Trainer:
    defaults = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    defaults.update(num_sanity_val_steps=0, limit_val_batches=0, max_steps=6, default_root_dir=tmp_path)
    return pl.Trainer(**{**defaults, **kwargs}, callbacks=[*callbacks, Preemption(resume="the resume command")])


def _fit_interrupted(trainer) -> Interrupted:
    torch.manual_seed(0)
    module = MoELitModule(tiny(vocab_size=64), OptimConfig(warmup_steps=1))
    with pytest.raises(Interrupted) as caught:
        trainer.fit(module, datamodule=RandomTokenDataModule())
    return caught.value


def test_a_signal_saves_at_the_end_of_the_step_prints_one_line_and_exits_128_plus_it(tmp_path, capsys):
    # NOTE: the handlers as the test found them: a shell starts a background job with SIGINT ignored.
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGUSR1, signal.SIGINT)}
    interrupted = _fit_interrupted(_trainer(tmp_path, SignalAt(2, signal.SIGUSR1)))
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert (interrupted.code, interrupted.checkpoint) == (128 + signal.SIGUSR1, last)
    assert read_lightning_checkpoint(last)["global_step"] == 3  # the step in flight finished
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == f"moe-lit: SIGUSR1 at step 3 of 6: checkpoint {last}; resume: the resume command (exit 138)"
    # Lightning's teardown restored the handlers
    assert {signum: signal.getsignal(signum) for signum in before} == before


class CountsValidations(pl.Callback):
    """Counts the validations of a fit in its checkpointed state."""

    def __init__(self) -> None:
        self.validations = 0

    def on_validation_end(self, trainer, pl_module) -> None:
        self.validations += not trainer.sanity_checking

    def state_dict(self) -> dict[str, int]:
        return {"validations": self.validations}


def test_a_step_validated_after_its_save_is_saved_again_with_the_validation(tmp_path):
    # the resumed run does not validate the checkpoint's step again: its results must be in it
    counter = CountsValidations()
    trainer = _trainer(tmp_path, counter, SignalAt(2, signal.SIGTERM), limit_val_batches=1, val_check_interval=1)
    checkpoint = read_lightning_checkpoint(_fit_interrupted(trainer).checkpoint)
    assert checkpoint["global_step"] == 3 and counter.validations == 3
    assert checkpoint["callbacks"]["CountsValidations"] == {"validations": 3}


def test_with_gradient_accumulation_the_checkpoint_waits_for_the_optimizer_step(tmp_path):
    # the signal comes at the first of the two micro-batches of step 2: the checkpoint is after step 2
    interrupted = _fit_interrupted(_trainer(tmp_path, SignalAt(1, signal.SIGTERM), accumulate_grad_batches=2))
    checkpoint = read_lightning_checkpoint(interrupted.checkpoint)
    assert interrupted.code == 143 and checkpoint["global_step"] == 2


def test_a_second_sigint_stops_at_once_without_a_checkpoint(tmp_path, capsys):
    interrupted = _fit_interrupted(_trainer(tmp_path, SignalAt(1, signal.SIGINT, signal.SIGINT)))
    assert (interrupted.code, interrupted.checkpoint) == (130, None)
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()
    assert "second SIGINT: stopped at once, no checkpoint saved" in capsys.readouterr().err


def _rows(path) -> dict[int, float]:
    return {int(row["step"]): row["train/loss"] for row in read_metrics(path) if "train/loss" in row}


@pytest.mark.slow
def test_sigterm_stops_a_fit_subprocess_with_exit_143_and_its_resume_repeats_the_losses(
    prepared, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    assert _fit(prepared, "--trainer.max_steps", str(STEPS), "--out", "full") == 0
    args = ["--data.data_dir", str(prepared), *TINY, "--trainer.max_steps", str(STEPS)]
    argv = ["fit", "--config", EXPERIMENT, *args, "--checkpoint.every_n_train_steps", "1", "--out", "cut"]
    code, stderr = signal_when_checkpointed(argv, tmp_path, "cut/checkpoints/last.ckpt")
    assert code == 143, stderr
    step, checkpoint, resume = interruption(stderr)
    assert 1 <= step < STEPS and read_lightning_checkpoint(checkpoint)["global_step"] == step
    assert resume.startswith("moe-lit fit --config") and resume.endswith("--out cut --resume")
    assert main(shlex.split(resume)[1:]) == 0  # the printed command, as printed
    full = _rows(tmp_path / "full" / "logs" / "fit" / "metrics.csv")
    before = _rows(tmp_path / "cut" / "logs" / "fit" / "metrics.csv")
    after = _rows(tmp_path / "cut" / "logs" / f"fit-step{step}" / "metrics.csv")
    assert sorted(before) == list(range(step)) and sorted(after) == list(range(step, STEPS))
    assert {**before, **after} == full  # bit-exact


@pytest.mark.slow
def test_sigterm_stops_a_study_worker_and_the_rerun_continues_its_point(prepared, tmp_path, monkeypatch):
    spec = {
        "name": "signals",
        "kind": "dense_vs_sparse",
        "base": {"vocab_size": 300, "d_model": 32, "n_layers": 1, "n_heads": 4, "d_ff": 64},
        "budgets": [{"name": "S"}],
        "grid": {"num_experts": [4], "top_k": [2], "moe": {"backend": "torch"}},
        "run": {
            "data": {"data_dir": str(prepared), "seq_len": 16, "batch_size": 4, "val_batches": 1},
            "optim": {"warmup_steps": 1},
            "train": {"max_steps": STEPS, "checkpoint_every": 1},
            "trainer": {"enable_progress_bar": False},
        },
    }
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(spec))
    code, stderr = signal_when_checkpointed(
        ["study", "run", "study.yaml", "--out", "cut"], tmp_path, "cut/runs/*/checkpoints/last.ckpt"
    )
    assert code == 143, stderr
    step, checkpoint, resume = interruption(stderr)
    assert "study point S/E4k2: SIGTERM" in stderr and resume == "moe-lit study run study.yaml --out cut"
    assert not list((tmp_path / "cut" / "runs").glob("*.json"))  # no record: the point is not finished
    monkeypatch.chdir(tmp_path)
    assert main(shlex.split(resume)[1:]) == 0  # the printed command: the point continues from its checkpoint
    assert main(["study", "run", "study.yaml", "--out", "full"]) == 0  # the same point, uninterrupted
    (cut_record,) = (tmp_path / "cut" / "runs").glob("*.json")
    full_record = tmp_path / "full" / "runs" / cut_record.name
    assert 1 <= step < STEPS and checkpoint.startswith(str(cut_record.with_suffix("")))
    cut_losses, full_losses = (_rows(p.with_suffix("") / "metrics.csv") for p in (cut_record, full_record))
    assert cut_losses == full_losses and sorted(full_losses) == list(range(STEPS))  # bit-exact, the whole run
    cut, full = (json.loads(p.read_text()) for p in (cut_record, full_record))
    assert (cut["status"], cut["steps"], cut["curve"]) == ("ok", STEPS, full["curve"])
    assert cut["val_loss"] == full["val_loss"] and cut["val_loss_per_language"] == full["val_loss_per_language"]


def test_rerunning_fit_into_its_run_directory_says_which_flag_fits(prepared, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert _fit(prepared, "--trainer.max_steps", "2") == 0
    capsys.readouterr()
    assert _fit(prepared, "--trainer.max_steps", "2") == 2  # finished: --force or another --out
    assert "holds a finished run (step 2 of 2); pass --force" in capsys.readouterr().err
    assert _fit(prepared, "--trainer.max_steps", "3") == 2  # stopped before its last step: --resume
    err = capsys.readouterr().err
    assert "holds a run stopped at step 2 of 3; pass --resume to continue it" in err and len(err.splitlines()) == 1
    assert _fit(prepared, "--trainer.max_steps", "3", "--resume") == 0
    assert read_lightning_checkpoint(tmp_path / "runs/tiny-moe/checkpoints/last.ckpt")["global_step"] == 3
    assert _fit(prepared, "--trainer.max_steps", "3", "--resume", "--force") == 2
    assert "--resume continues the run, --force replaces it" in capsys.readouterr().err
    assert _fit(prepared, "--trainer.max_steps", "3", "--resume", "--out", "elsewhere") == 2
    assert "--resume: elsewhere/checkpoints/last.ckpt does not exist" in capsys.readouterr().err
    # a requeued SLURM job runs its command again as it was: it continues the run, even with --force
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert _fit(prepared, "--trainer.max_steps", "4", "--force") == 0
    assert read_lightning_checkpoint(tmp_path / "runs/tiny-moe/checkpoints/last.ckpt")["global_step"] == 4
    assert (tmp_path / "runs/tiny-moe/logs/fit-step3").is_dir()


def test_the_resume_command_keeps_the_arguments_but_force_and_ckpt_path(tmp_path):
    argv = ["fit", "--config", f"{CONFIGS_DIR}/experiments/tiny-moe.yaml", "--force", "--ckpt_path", "x.ckpt"]
    command = fit_resume_command([*argv, "--trainer.max_steps=5", "--ckpt_path=y.ckpt"], tmp_path / "run")
    expected = "moe-lit fit --config configs/experiments/tiny-moe.yaml --trainer.max_steps=5"
    assert command == f"{expected} --out {tmp_path / 'run'} --resume"
    assert fit_resume_command(["fit", "--out", "r", "--resume"], tmp_path) == "moe-lit fit --out r --resume"
    assert command_line(["/venv/bin/moe-lit", "study", "run", "a b.yaml"]) == "moe-lit study run 'a b.yaml'"
    message = existing_run_message(tmp_path, tmp_path / "none.ckpt", 5)
    assert message.endswith("is not empty and holds no checkpoint to resume; pass --force to replace it, or --out DIR")


def test_a_handler_already_on_sigusr1_stays_and_the_slurm_study_config_sends_it(tmp_path):
    from types import SimpleNamespace

    from lightning.fabric.plugins.environments import SLURMEnvironment
    from submitit.slurm.slurm import _make_sbatch_string

    from moe_lit.studies.study import load_study
    from tests.helpers.paths import STUDIES

    def requeue(signum, frame):  # stands for Lightning's SLURM requeue handler
        pass

    previous = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    signal.signal(signal.SIGUSR1, requeue)
    try:
        Preemption().on_train_start(SimpleNamespace(), None)
        assert (
            signal.getsignal(signal.SIGUSR1) is requeue
            and signal.getsignal(signal.SIGTERM) is not previous[signal.SIGTERM]
        )
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    executor = load_study(STUDIES / "dense_vs_sparse_gpu.yaml", None).header.executor
    sbatch = _make_sbatch_string(command="x", folder=str(tmp_path), **{"additional_parameters": executor.additional})
    assert SLURMEnvironment().requeue_signal == signal.SIGUSR1 and "#SBATCH --signal=USR1@120" in sbatch.splitlines()


def test_demo_resume_needs_an_earlier_demo_with_the_same_settings(tmp_path, monkeypatch):
    from argparse import Namespace

    from moe_lit.commands.demo import check_work_dir, resume_command
    from moe_lit.errors import MoeLitError

    args, inputs = Namespace(work_dir=tmp_path / "work", resume=True, force=False), {"data.data_dir": None}
    with pytest.raises(MoeLitError, match="work holds no demo to continue; run without --resume"):
        check_work_dir(args, {"train.max_tokens": 100}, inputs)
    args.resume = False
    check_work_dir(args, {"train.max_tokens": 100}, inputs)  # a fresh demo notes its settings
    with pytest.raises(MoeLitError, match="holds an earlier demo; pass --resume to continue it"):
        check_work_dir(args, {"train.max_tokens": 100}, inputs)
    args.resume = True
    check_work_dir(args, {"train.max_tokens": 100}, inputs)
    with pytest.raises(MoeLitError, match=r"ran with other settings \(train.max_tokens\)"):
        check_work_dir(args, {"train.max_tokens": 200}, inputs)
    monkeypatch.setattr(sys, "argv", ["/checkout/moe_lit/console_script.py", "demo", "--force"])  # make demo
    assert resume_command() == "moe-lit demo --force --resume"


def test_a_ctrl_c_outside_training_is_one_line_and_exit_130(monkeypatch, capsys):
    import moe_lit.commands.demo as demo

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "run", interrupted)
    assert main(["demo"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["moe-lit demo: interrupted"]

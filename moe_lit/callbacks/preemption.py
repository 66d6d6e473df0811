"""Preemption: SIGTERM, SIGINT or SIGUSR1 during training -> a resumable checkpoint at the next step
boundary, one line naming it and the command that resumes, exit status 128 + signal.

What a scheduler sends before it kills a job (SIGTERM; SLURM also a chosen signal some time before
the time limit), a Ctrl-C (SIGINT) and a user's ``kill -USR1`` all stop a run the same way:

1. the handler only notes the signal: the optimizer step in flight finishes (a second SIGINT stops
   at once, without a checkpoint);
2. at the end of that step (``on_train_batch_end`` of a batch that stepped; or the end of a
   validation inside fit, again when the step's validation follows its save; or the end of
   training), the ranks agree that one of them was signalled and all save one full checkpoint
   (weights, optimizer, schedule, data position, step counter, callback states) to the run's
   ``last.ckpt``, written beside it and renamed into place;
3. rank 0 prints one line on stderr: the signal, the step, the checkpoint and the command that
   resumes;
4. at the next batch start (after Lightning has logged the step's metrics), or at the end of
   training, the run raises :class:`Interrupted`: a ``SystemExit`` with status 128 + signal (143
   for SIGTERM, 130 for SIGINT, 138 for SIGUSR1), which ends ``moe-lit fit``, the demo and a study
   worker with that status.

NOTE: Lightning installs its own SIGTERM handler right before training (it stops at the next batch
with no checkpoint and a ``SystemExit`` without a status) and restores the previous handlers at
its teardown. This callback takes SIGTERM, SIGINT and SIGUSR1 over from ``on_train_start``, after
Lightning's registration, so Lightning's teardown restores them too. A signal that already has a
handler then is left to it, except SIGTERM and SIGINT: on SLURM with auto-requeue (Lightning's
``SLURMEnvironment`` default) Lightning's requeue handler keeps the requeue signal (SIGUSR1 unless
configured otherwise; ``sbatch --signal=SIGUSR1@90``): it saves ``hpc_ckpt_<n>.ckpt`` and requeues
the job, whose SIGTERM then stops the run as above; the requeued job resumes from the HPC
checkpoint (Lightning loads it when no ``ckpt_path`` is given).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

INTERRUPT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""The signals that stop a run with a checkpoint."""
TAKEN_OVER = (signal.SIGTERM, signal.SIGINT)
"""Signals handled here even when another handler is installed (Lightning's SIGTERM one, Python's
KeyboardInterrupt); SIGUSR1 stays with a handler that is already there (Lightning's SLURM requeue)."""
LAST_CHECKPOINT = "last.ckpt"


def exit_status(signum: int) -> int:
    """The shell's status of a process ended by ``signum``: 128 + signal (143 for SIGTERM)."""
    return 128 + int(signum)


class Interrupted(SystemExit):
    """A run stopped by ``signum``; its status is 128 + signum. ``checkpoint``: where it was saved
    (None when a second SIGINT stopped it at once)."""

    def __init__(self, signum: int, checkpoint: Path | None) -> None:
        super().__init__(exit_status(signum))
        self.signum = int(signum)
        self.checkpoint = checkpoint


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that started this process, as a shell line (``moe-lit ...`` for the console
    script and ``python -m moe_lit.console_script``, which spawned study workers inherit)."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return ""
    program = Path(argv[0])
    if program.name == "moe-lit" or program.parts[-2:] == ("moe_lit", "console_script.py"):
        return shlex.join(["moe-lit", *argv[1:]])
    return shlex.join([Path(sys.executable).name, *argv])


def last_checkpoint_path(trainer: pl.Trainer) -> Path:
    """The run's ``last.ckpt``: in the ModelCheckpoint's folder, else ``<default_root_dir>/checkpoints``."""
    callback = trainer.checkpoint_callback
    if isinstance(callback, ModelCheckpoint) and callback.dirpath:
        return Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
    return Path(trainer.default_root_dir) / "checkpoints" / LAST_CHECKPOINT


class Preemption(pl.Callback):
    """On SIGTERM / SIGINT / SIGUSR1: a checkpoint at the next step boundary, one line, exit 128 + signal."""

    def __init__(self, resume: str | None = None, label: str = "moe-lit", checkpoint: str | Path | None = None) -> None:
        """
        Args:
            resume: The command that continues the run from its checkpoint, printed in the line
                (None: the line names the checkpoint only).
            label: The line's prefix (the command that runs, e.g. ``moe-lit fit``).
            checkpoint: Where to save (None: the run's ``last.ckpt``, :func:`last_checkpoint_path`).
        """
        super().__init__()
        self.resume, self.label = resume, label
        self.checkpoint = None if checkpoint is None else Path(checkpoint)
        self._signum = 0
        self._saved: Path | None = None
        self._step_at_start = -1

    # ------------------------------------------------------------------ signals
    def _note(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self._signum == signal.SIGINT:
            print(f"{self.label}: second SIGINT: stopped at once, no checkpoint saved", file=sys.stderr, flush=True)
            raise Interrupted(signum, None)
        self._signum = self._signum or signum

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._signum, self._saved = 0, None
        if threading.current_thread() is not threading.main_thread():
            return  # NOTE: Python delivers signals to the main thread only; a run in another thread keeps the defaults.
        for signum in INTERRUPT_SIGNALS:
            if signum in TAKEN_OVER or signal.getsignal(signum) in (signal.SIG_DFL, None):
                signal.signal(signum, self._note)

    def _agreed_signal(self, trainer: pl.Trainer) -> int:
        """The signal noted on any rank (the highest number when several were), 0 when none."""
        if trainer.world_size == 1:
            return self._signum
        noted = torch.tensor(float(self._signum), device=trainer.strategy.root_device)
        return int(trainer.strategy.reduce(noted, reduce_op="max").item())

    # ------------------------------------------------------------------ step boundaries
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._saved is not None:
            raise Interrupted(self._signum, self._saved)
        self._step_at_start = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # NOTE: a batch that did not step (gradient accumulation) is no step boundary: the data
        # position and the optimizer state would disagree.
        if trainer.global_step != self._step_at_start:
            self._save_if_signalled(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn != "fit" or trainer.sanity_checking:
            return
        if self._saved is not None:
            # NOTE: saved at this step's batch end, before its validation: the resumed run does not
            # validate that step again, so the checkpoint is written again with the results in it.
            self._saved = self._save(trainer)
        self._save_if_signalled(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._save_if_signalled(trainer)
        if self._saved is not None:
            raise Interrupted(self._signum, self._saved)

    def _save_if_signalled(self, trainer: pl.Trainer) -> None:
        if self._saved is not None:
            return
        signum = self._agreed_signal(trainer)
        if not signum:
            return
        self._signum, self._saved = signum, self._save(trainer)
        if trainer.is_global_zero:
            print(self._line(trainer), file=sys.stderr, flush=True)

    def _save(self, trainer: pl.Trainer) -> Path:
        """A full checkpoint written beside its target and renamed into place (a kill while it is
        written leaves the previous one intact)."""
        path = self.checkpoint or last_checkpoint_path(trainer)
        tmp = path.with_name(f".{path.name}.tmp")
        path.parent.mkdir(parents=True, exist_ok=True)
        trainer.save_checkpoint(tmp)
        if trainer.is_global_zero:
            if tmp.is_dir() and path.is_dir():  # a distributed checkpoint is a folder
                shutil.rmtree(path)
            os.replace(tmp, path)
        trainer.strategy.barrier("Preemption._save")
        return path

    def _line(self, trainer: pl.Trainer) -> str:
        name = signal.Signals(self._signum).name
        total = f" of {trainer.max_steps}" if trainer.max_steps and trainer.max_steps > 0 else ""
        resume = f"; resume: {self.resume}" if self.resume else ""
        return (
            f"{self.label}: {name} at step {trainer.global_step}{total}: checkpoint {self._saved}{resume} "
            f"(exit {exit_status(self._signum)})"
        )


__all__ = ["INTERRUPT_SIGNALS", "Interrupted", "Preemption", "command_line", "exit_status", "last_checkpoint_path"]

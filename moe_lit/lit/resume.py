"""Rerunning into a run directory: continue it (``--resume``) or replace it (``--force``).

``moe-lit fit`` writes one run directory (``moe_lit.lit.lightning_cli``); a second run of the same command
finds it. :func:`existing_run_message` is the refusal that says which of the two flags the user
probably wants, read from the run's ``checkpoints/last.ckpt``: a run that stopped before its last
step (an interrupt, a crash) is continued with ``--resume``; a finished one, or one without a
checkpoint, is replaced with ``--force`` (or kept, with another ``--out``); a requeued SLURM job
continues its run without either (:func:`requeued_run`).
:func:`fit_resume_command` is the command an interrupted fit prints: the same arguments with
``--resume``.

A run has one ``last.ckpt``, always its newest state: its ModelCheckpoint overwrites it
(:data:`ONE_LAST_CHECKPOINT`; Lightning's default writes ``last-v1.ckpt`` beside a ``last.ckpt``
it did not write itself, e.g. one saved at an interrupt), and every checkpoint is written
beside its target and renamed into place with the umask's mode (:class:`AtomicCheckpointIO`).

A resume continues a run as it was: :func:`check_resumed_model` refuses a model or optimizer
setting given with another value than the checkpoint's, :func:`check_resumed_data` data of
another vocabulary or tokenizer (one line naming the field, both values, exit 2). Starting a new
run from a checkpoint's weights, on other data or with other settings, is ``--init_from``.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from typing_extensions import override

from moe_lit.config import ModelConfig
from moe_lit.configbase import to_data
from moe_lit.errors import MoeLitError
from moe_lit.io import atomic_file
from moe_lit.lit.datamodule import TOKENIZER_KEY, MoEDataModule
from moe_lit.lit.module import RUN_STATE
from moe_lit.lit.optim import OptimConfig

RESUME_FLAG, FORCE_FLAG = "--resume", "--force"
_BOOLEAN_WORDS = ("true", "false", "yes", "no")
_VALUE_OPTIONS = ("--ckpt_path",)
ONE_LAST_CHECKPOINT: dict[str, Any] = {"save_last": True, "enable_version_counter": False}
"""ModelCheckpoint arguments of every run: ``last.ckpt`` written at each save, overwritten (never
a ``last-vN.ckpt`` beside it: a resumed run would then leave its newest state where no resume looks)."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, writing beside the target and renaming into place (a kill
    mid-write leaves the previous checkpoint), with the umask's file mode."""

    # NOTE: Lightning's own writer goes through a temporary file of the system's temp dir, which is
    # private (0o600) and, on another file system, copied into place rather than renamed.
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        with atomic_file(path) as tmp:
            torch.save(checkpoint, tmp)


def checkpoint_step(path: Path) -> int | None:
    """The optimizer step a Lightning checkpoint was saved at (None when it is not readable)."""
    from moe_lit.checkpoint import read_lightning_checkpoint

    try:
        return int(read_lightning_checkpoint(path).get("global_step", 0))
    except MoeLitError:
        return None


def existing_run_message(run_dir: Path, last: Path, max_steps: int | None) -> str:
    """One line refusing a fresh run into the non-empty ``run_dir`` (checkpoint ``last``), with the
    flag that probably fits."""
    step = checkpoint_step(last) if last.is_file() else None
    where = f"the run directory {run_dir}"
    if step is None:
        return f"{where} is not empty and holds no checkpoint to resume; pass {FORCE_FLAG} to replace it, or --out DIR"
    total = max_steps if max_steps is not None and max_steps > 0 else None
    if total is not None and step >= total:
        return (
            f"{where} holds a finished run (step {step} of {total}); pass {FORCE_FLAG} to train it again from "
            "scratch, or --out DIR to keep it"
        )
    of_total = f" of {total}" if total is not None else ""
    return (
        f"{where} holds a run stopped at step {step}{of_total}; pass {RESUME_FLAG} to continue it from {last} "
        f"(probably what you want), or {FORCE_FLAG} to replace it"
    )


def resume_checkpoint(last: Path, ckpt_path: object, force: bool) -> Path:
    """``--resume``: the run's ``last`` checkpoint, which must exist; neither ``--ckpt_path`` nor
    ``--force`` goes with it."""
    if ckpt_path:
        raise MoeLitError(f"{RESUME_FLAG}: continues the run from {last}; give it or --ckpt_path, not both")
    if force:
        raise MoeLitError(f"{RESUME_FLAG} continues the run, {FORCE_FLAG} replaces it: give one of them")
    if not last.is_file():
        raise MoeLitError(f"{RESUME_FLAG}: {last} does not exist (nothing to resume); run without {RESUME_FLAG}")
    return last


FROM_DATA = ("vocab_size", "seq_len")
"""Model fields a run takes from its data, not from its model settings (checked against the data)."""
NEW_RUN_HINT = "a resume continues the run as it was; --init_from starts a new run from its weights"
WEIGHTS_HINT = "its weights fix the model: leave the model settings out, or train a new model from scratch"


def first_difference(
    saved: Mapping[str, Any], given: Mapping[str, Any], prefix: str = ""
) -> tuple[str, Any, Any] | None:
    """The first field (dotted, ``prefix`` first) whose value differs between two nested dicts, with
    both values; None when they are equal."""
    for key in [*given, *(k for k in saved if k not in given)]:
        old, new = saved.get(key), given.get(key)
        if isinstance(old, Mapping) and isinstance(new, Mapping):
            found = first_difference(old, new, f"{prefix}{key}.")
            if found is not None:
                return found
        elif old != new:
            return f"{prefix}{key}", old, new
    return None


def _refusal(
    flag: str, field: str, saved: Any, given: Any, where: str = "given", hint: str = NEW_RUN_HINT
) -> MoeLitError:
    return MoeLitError(f"{flag}: {field} is {saved!r} in the checkpoint but {given!r} {where}; {hint}")


def check_resumed_model(
    checkpoint: Mapping[str, Any],
    model: ModelConfig | None,
    optim: OptimConfig | None,
    flag: str,
    hint: str = NEW_RUN_HINT,
) -> None:
    """Refuse to resume ``checkpoint`` with a ``model`` (compared with the one the run started as,
    :data:`FROM_DATA` aside) or an ``optim`` other than its own (None: not given, not compared);
    ``hint`` ends the line."""
    hparams = checkpoint.get("hyper_parameters") or {}
    started = (checkpoint.get(RUN_STATE) or {}).get("model") or hparams.get("model")
    found = None
    if model is not None and started is not None:
        saved = ModelConfig.from_dict(_plain(started)).to_dict()
        found = first_difference(
            {k: v for k, v in saved.items() if k not in FROM_DATA},
            {k: v for k, v in model.to_dict().items() if k not in FROM_DATA},
            "model.",
        )
    if found is None and optim is not None and hparams.get("optim") is not None:
        # NOTE: as plain data: a checkpoint may hold the tuples of a config (betas) as lists.
        found = first_difference(to_data(_plain(hparams["optim"])), optim.to_dict(), "optim.")
    if found is not None:
        raise _refusal(flag, *found, hint=hint)


def check_resumed_data(checkpoint: Mapping[str, Any], data: MoEDataModule, flag: str) -> None:
    """Refuse to resume ``checkpoint`` on ``data`` of another vocabulary size or tokenizer."""
    model = (checkpoint.get("hyper_parameters") or {}).get("model")
    vocab_size = _plain(model).get("vocab_size") if model is not None else None
    where = f"in the data {data.data_dir}"
    if vocab_size is not None and vocab_size != data.vocab_size:
        raise _refusal(flag, "vocab_size", vocab_size, data.vocab_size, where)
    saved = (checkpoint.get(type(data).__qualname__) or {}).get(TOKENIZER_KEY)
    if saved is not None and saved != data.tokenizer_sha256:
        raise _refusal(flag, "the tokenizer's sha256", saved, data.tokenizer_sha256, f"{where} (another tokenizer)")


def resumed_precision(checkpoint: Mapping[str, Any] | None) -> str | None:
    """The Trainer precision a checkpoint's run trained with (None: no checkpoint, or one written
    before it was recorded)."""
    return ((checkpoint or {}).get(RUN_STATE) or {}).get("precision")


def _plain(value: Any) -> dict[str, Any]:
    """A config as a plain dict (checkpoints before plain hyper-parameters hold the dataclass)."""
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else dict(value)


def requeued_run(last: Path) -> bool:
    """Whether this is a SLURM job run again after a requeue (``SLURM_RESTART_COUNT`` > 0) whose
    run has a ``last`` checkpoint: the same command then continues it, as Lightning's HPC resume
    would (a requeued job cannot add ``--resume``; its ``--force`` would throw the run away)."""
    restarts = os.environ.get("SLURM_RESTART_COUNT", "")
    return restarts.isdigit() and int(restarts) > 0 and last.is_file()


def _without(argv: Sequence[str], flags: Sequence[str], value_options: Sequence[str]) -> list[str]:
    """``argv`` without the boolean ``flags`` (``--f``, ``--f=x``, ``--no_f``, ``--f true``) and the
    ``value_options`` with their values."""
    negated = [f"--no_{flag.removeprefix('--')}" for flag in flags]
    kept: list[str] = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in value_options:
            skip = "=" not in arg
            continue
        if name in flags or arg in negated:
            nxt = argv[i + 1].lower() if i + 1 < len(argv) else ""
            skip = "=" not in arg and arg not in negated and nxt in _BOOLEAN_WORDS
            continue
        kept.append(arg)
    return kept


def _as_typed(arg: str) -> str:
    """A packaged config's path as the ``configs/...`` it was typed as (``moe-lit`` maps it again)."""
    from moe_lit.resources import CONFIGS_DIR, CONFIGS_PREFIX

    option, sep, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    packaged = f"{CONFIGS_DIR}/"
    return f"{option}{sep}{CONFIGS_PREFIX}{value.removeprefix(packaged)}" if value.startswith(packaged) else arg


def fit_resume_command(argv: Sequence[str], run_dir: Path) -> str:
    """``moe-lit fit`` with ``argv``'s arguments (subcommand first) that continues ``run_dir``:
    ``--force`` and ``--ckpt_path`` dropped; ``--out run_dir`` (unless given) and ``--resume`` added."""
    args = [_as_typed(arg) for arg in _without(argv, (FORCE_FLAG, RESUME_FLAG), _VALUE_OPTIONS)]
    if not any(arg.split("=", 1)[0] == "--out" for arg in args):
        args += ["--out", str(run_dir)]
    return shlex.join(["moe-lit", *args, RESUME_FLAG])


__all__ = [
    "ONE_LAST_CHECKPOINT",
    "AtomicCheckpointIO",
    "check_resumed_data",
    "check_resumed_model",
    "checkpoint_step",
    "existing_run_message",
    "fit_resume_command",
    "requeued_run",
    "resumed_precision",
    "resume_checkpoint",
]

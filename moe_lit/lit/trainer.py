"""The one Trainer builder: :func:`trainer_arguments`, the Lightning ``Trainer`` arguments of a
:class:`~moe_lit.lit.run_config.RunConfig`, callbacks included.

Both ways to train call it: :func:`moe_lit.lit.run.train_run` and ``moe-lit fit|validate|test``
(``MoELightningCLI.instantiate_trainer``, which first turns its parsed sections into a RunConfig
with :func:`experiment_run`). A ``train.X`` option is one TrainConfig field and its use here.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ProgressBar, ThroughputMonitor
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.utilities import rank_zero_only

from moe_lit.callbacks import DivergenceGuard, RoutingMonitor
from moe_lit.callbacks.compile import CompileBlocks
from moe_lit.callbacks.preemption import Preemption
from moe_lit.callbacks.threads import ThreadShare
from moe_lit.lit.console import progress_bar
from moe_lit.lit.precision import choose_precision
from moe_lit.lit.resume import ONE_LAST_CHECKPOINT, AtomicCheckpointIO
from moe_lit.lit.run_config import RunConfig
from moe_lit.model.transformer import Transformer

CHECKPOINT_DIR = "checkpoints"
"""The run directory's folder of ``last.ckpt``."""
CHECKPOINT_ARGUMENTS = {"save_top_k": 0, **ONE_LAST_CHECKPOINT}
"""The run's ModelCheckpoint: ``last.ckpt`` at every validation, or every ``train.checkpoint_every`` steps."""
NOT_RUN_SETTINGS = ("callbacks", "logger", "default_root_dir", "max_steps")
"""Trainer arguments that are no ``RunConfig.trainer`` setting: the builder's own parameters, and
the budget (``train.max_steps``)."""


def tokens_in_batch(batch_BL1) -> int:
    """Predicted tokens of a (B, L+1) batch: the ThroughputMonitor's ``length_fn``."""
    return batch_BL1[:, 1:].numel()


def samples_in_batch(batch_BL1) -> int:
    return batch_BL1.shape[0]


def throughput_monitor() -> ThroughputMonitor:
    """Logs ``train/items_per_sec`` (tokens/s), ``train/flops_per_sec`` and, on a device whose peak
    Lightning knows (CUDA; none on CPU), ``train/device/mfu``."""
    return ThroughputMonitor(batch_size_fn=samples_in_batch, length_fn=tokens_in_batch, window_size=10)


def trainer_arguments(
    run: RunConfig,
    out_dir: str | Path,
    model: Transformer,
    callbacks: Iterable[Callback] = (),
    logger: Logger | bool | None = None,
    checkpoint: Mapping[str, Any] | None = None,
    resumed_precision: str | None = None,
) -> dict[str, Any]:
    """``pl.Trainer(**trainer_arguments(...))`` trains ``model`` (the module's Transformer) as ``run``
    says, writing into ``out_dir``.

    The run's callbacks: a ModelCheckpoint (``out_dir/checkpoints/last.ckpt``; ``checkpoint``:
    ModelCheckpoint arguments over the run's), a ThroughputMonitor, a RoutingMonitor (every
    ``log_every_n_steps``), a ThreadShare, then ``callbacks``, a DivergenceGuard, CompileBlocks
    (``train.compile``), a Preemption and a progress bar (unless ``trainer.enable_progress_bar`` is
    false). A given callback of the class of one of them, other than the ModelCheckpoint, replaces
    it (e.g. ``DivergenceGuard(policy="skip")``). ``logger``: None is a CSVLogger writing
    ``out_dir/metrics.csv``; False none. ``run.trainer`` replaces every other argument. The
    precision is ``train.precision``'s choice (:func:`~moe_lit.lit.precision.choose_precision`;
    ``resumed_precision``: the resumed checkpoint's), its line printed."""
    out_dir = Path(out_dir)
    given = list(callbacks)
    eval_every = run.eval_every
    log_every = run.trainer.get("log_every_n_steps") or max(1, min(50, eval_every // 4))
    # NOTE: every_n_train_steps None: last.ckpt at every validation.
    run_checkpoint = {"dirpath": out_dir / CHECKPOINT_DIR, "every_n_train_steps": run.train.checkpoint_every}
    last = ModelCheckpoint(**{**CHECKPOINT_ARGUMENTS, **run_checkpoint, **(checkpoint or {})})
    run_callbacks = [last, *_unless_given(given, throughput_monitor(), RoutingMonitor(log_every), ThreadShare())]
    run_callbacks += [*given, *_unless_given(given, DivergenceGuard())]
    if run.train.compile:
        # NOTE: after the given callbacks: a model swap at a batch start is compiled in that batch.
        run_callbacks.append(CompileBlocks())
    run_callbacks += _unless_given(given, Preemption())
    if run.trainer.get("enable_progress_bar", True) is not False:
        run_callbacks += _unless_given(given, progress_bar())
    kwargs = {
        "max_steps": run.steps,
        "val_check_interval": eval_every,
        "check_val_every_n_epoch": None,
        "num_sanity_val_steps": 0,
        "deterministic": run.train.deterministic,
        "log_every_n_steps": log_every,
        "logger": CSVLogger(out_dir, name="", version="") if logger is None else logger,
        "enable_model_summary": False,
        "default_root_dir": out_dir,
        "plugins": [AtomicCheckpointIO()],
        **run.trainer,
        "callbacks": run_callbacks,
    }
    choice = choose_precision(
        run.train.precision, kwargs, model, run.data.batch_size, run.data.seq_len, resumed_precision
    )
    if choice is not None:
        kwargs["precision"] = choice.precision
        if rank_zero_only.rank == 0:
            print(choice.line(), flush=True)
    return kwargs


def _unless_given(given: list[Callback], *defaults: Callback) -> list[Callback]:
    """The ``defaults`` of a class (a progress bar: of any ProgressBar) no ``given`` callback has."""
    kinds = [ProgressBar if isinstance(d, ProgressBar) else type(d) for d in defaults]
    return [d for d, kind in zip(defaults, kinds, strict=True) if not any(isinstance(c, kind) for c in given)]


def experiment_run(sections: Mapping[str, Any]) -> RunConfig:
    """The RunConfig of a LightningCLI experiment's sections (``moe-lit fit --config``): ``data``,
    ``model.optim``, ``train`` and ``trainer``, ``seed_everything`` as train.seed, the trainer's
    max_steps and integer val_check_interval and ``checkpoint.every_n_train_steps`` as train's fields
    where train leaves them unset. Trainer arguments equal to Lightning's defaults, and those the
    builder takes apart (callbacks, logger, default_root_dir), are left out."""
    trainer = {k: v for k, v in (sections.get("trainer") or {}).items() if not _lightning_default(k, v)}
    train = {k: v for k, v in (sections.get("train") or {}).items() if v is not None}
    seed = sections.get("seed_everything")
    if isinstance(seed, int) and not isinstance(seed, bool):
        train.setdefault("seed", seed)
    if "max_steps" in trainer and "max_tokens" not in train:
        train.setdefault("max_steps", trainer["max_steps"])
    if isinstance(trainer.get("val_check_interval"), int):  # NOTE: a float is a fraction of an epoch
        train.setdefault("val_every", trainer["val_check_interval"])
    every = (sections.get("checkpoint") or {}).get("every_n_train_steps")
    if every is not None:
        train.setdefault("checkpoint_every", every)
    data = {k: v for k, v in (sections.get("data") or {}).items() if k != "seed"}
    optim = (sections.get("model") or {}).get("optim") or {}
    trainer = {k: v for k, v in trainer.items() if k not in NOT_RUN_SETTINGS}
    return RunConfig(data=data, optim=optim, train=train, trainer=trainer)


def _lightning_default(name: str, value: Any) -> bool:
    parameter = inspect.signature(pl.Trainer).parameters.get(name)
    return parameter is not None and parameter.default is not inspect.Parameter.empty and value == parameter.default


__all__ = ["CHECKPOINT_ARGUMENTS", "CHECKPOINT_DIR", "experiment_run", "throughput_monitor", "trainer_arguments"]

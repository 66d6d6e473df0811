"""``train_run``: one training run built in code (no CLI), as ``make demo`` and the studies use it.

It trains a model as a :class:`~moe_lit.lit.run_config.RunConfig` says (data, optim, budget,
validation cadence, seed, Trainer arguments), validates every ``run.eval_every`` steps and at the
end, and returns a :class:`RunResult`. Everything it writes lies under ``out_dir``:
``metrics.csv`` (CSVLogger, one row per logged step) and ``checkpoints/last.ckpt`` (rewritten every
``train.checkpoint_every`` steps and at the end; continue with ``resume_from``). A SIGTERM, SIGINT
or SIGUSR1 saves that checkpoint at the next step boundary and ends the run with
:class:`~moe_lit.callbacks.preemption.Interrupted` (exit status 128 + signal; a
:class:`~moe_lit.callbacks.preemption.Preemption` among the callbacks sets the line it prints); a
run resumed into its own ``out_dir`` keeps the earlier rows of its ``metrics.csv``.
"""

from __future__ import annotations

import csv
import io
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from moe_lit.accounting import count_config_params, forward_flops_per_token
from moe_lit.callbacks.study import ValidationCurve
from moe_lit.checkpoint import read_lightning_checkpoint
from moe_lit.config import ModelConfig
from moe_lit.errors import MoeLitError
from moe_lit.io import atomic_write_text
from moe_lit.lit.console import quiet_lightning
from moe_lit.lit.module import MoELitModule
from moe_lit.lit.optim import OptimConfig
from moe_lit.lit.resume import check_resumed_data, check_resumed_model, resumed_precision
from moe_lit.lit.run_config import RunConfig
from moe_lit.lit.trainer import CHECKPOINT_DIR, trainer_arguments

ModuleFactory = Callable[[ModelConfig, OptimConfig], MoELitModule]

METRICS_FILE = "metrics.csv"
LAST_CHECKPOINT = "last.ckpt"
ROUTING_MEAN = "routing/mean/{}"


@dataclass
class RunResult:
    """What one training run measured."""

    total_params: int
    """Parameters of the model (analytic, equal to the built model's)."""
    active_params: int
    """Parameters touched by one token."""
    flops_per_token: int
    """Forward FLOPs per token (``moe_lit.accounting.forward_flops_per_token``; training is ~3x)."""
    tokens: int
    """Training tokens seen (steps x batch_size x seq_len)."""
    steps: int
    """Optimizer steps."""
    val_loss: float
    """Final validation cross-entropy (nats/token), over all validation tokens of all languages."""
    val_loss_per_language: dict[str, float]
    """Final validation cross-entropy per language."""
    tokens_per_s: float
    """Training throughput (tokens / training time, validation excluded; ThroughputMonitor)."""
    load_imbalance: float
    """max/mean tokens per expert, mean over MoE layers and over the logged steps of the second half
    of training (1.0 for a dense model: its FFN is one always-used expert)."""
    dropped_fraction: float
    """Assignments dropped by the capacity limit over routed assignments, averaged as
    ``load_imbalance`` is (0.0 when dropless and for a dense model)."""
    wall_s: float
    """Seconds of the whole run (training + validation)."""
    checkpoint: str
    """Path of the checkpoint of the final weights."""
    metrics_csv: str
    """Path of the CSV log."""
    curve: list[dict[str, float]]
    """``{step, val_loss}`` at every validation of the run (step: of the validated weights)."""
    precision: str = "32-true"
    """The Trainer precision the run trained with (``train.precision: auto`` decides it at the run's
    first start; a resume keeps it)."""


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """Rows of a CSVLogger file with the empty cells dropped and the values as floats."""
    with open(path, newline="") as handle:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(handle)]


def last_value(rows: Sequence[dict[str, float]], key: str) -> float:
    values = [row[key] for row in rows if key in row]
    return values[-1] if values else math.nan


def train_run(
    model_cfg: ModelConfig,
    run: RunConfig,
    out_dir: str | Path,
    callbacks: Iterable[Callback] = (),
    resume_from: str | Path | None = None,
    init_from: str | Path | None = None,
    module_factory: ModuleFactory = MoELitModule,
) -> RunResult:
    """Train ``model_cfg`` (vocab size from the data, seq_len from ``run.data``) as ``run`` says.

    The Trainer is :func:`~moe_lit.lit.trainer.trainer_arguments`'s, as ``moe-lit fit``'s is.
    ``resume_from`` continues a run from its Lightning checkpoint (weights, optimizer, schedule,
    data position, step counter), with the same model, optim and data (vocabulary, tokenizer),
    else a one-line MoeLitError;
    ``init_from`` starts a new run (fresh optimizer and schedule) from the weights of a checkpoint
    or exported model directory, whose model replaces ``model_cfg`` when it differs. With
    ``train.max_steps: 0`` nothing trains: the initial weights are validated and checkpointed.
    ``module_factory(model_cfg, optim)`` builds the LightningModule (a MoELitModule subclass, e.g.
    a distillation module holding its teacher).
    """
    from moe_lit.lit.datamodule import MoEDataModule

    if resume_from is not None and init_from is not None:
        raise MoeLitError("train_run: give resume_from (continue a run) or init_from (start from weights), not both")
    if resume_from is not None and run.steps == 0:
        raise MoeLitError("train_run: a 0-step run only validates; give init_from, not resume_from")
    out_dir = Path(out_dir)
    start = time.perf_counter()
    seed = run.train.seed
    pl.seed_everything(seed, verbose=False)
    data = run.data
    datamodule = MoEDataModule.from_config(data, seed)
    checkpoint = read_lightning_checkpoint(resume_from) if resume_from is not None else None
    if checkpoint is not None:
        check_resumed_data(checkpoint, datamodule, "resume_from")
        check_resumed_model(checkpoint, model_cfg, run.optim, "resume_from")
    module = _initial_module(model_cfg, run, datamodule.vocab_size, init_from, module_factory)
    module.extend_schedule = run.train.extend_schedule
    curve = ValidationCurve()
    # NOTE: a 0-step run (train.max_steps: 0) only validates its initial weights; fit would build
    # an optimizer and a schedule over zero steps. Validating first attaches the model to the
    # trainer, so its checkpoint below is saved like a trained run's.
    earlier = _earlier_metrics(out_dir, resume_from)
    trainer_kwargs = trainer_arguments(
        run, out_dir, module.model, callbacks=[curve, *callbacks], resumed_precision=resumed_precision(checkpoint)
    )
    with quiet_lightning():  # the Trainer too: its constructor prints the litlogger notice
        trainer = pl.Trainer(**trainer_kwargs)
        # NOTE: the earlier rows go back in only after the trainer's last log: CSVLogger rewrites the
        # file whenever a log brings new columns, with its own columns only.
        try:
            _fit_and_validate(trainer, module, datamodule, run.steps, resume_from, out_dir, curve)
        finally:
            _keep_earlier_metrics(out_dir / METRICS_FILE, earlier)
    wall_s = time.perf_counter() - start
    return _result(module, trainer, datamodule.languages, data.tokens_per_step, out_dir, wall_s, curve.curve)


def _fit_and_validate(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    datamodule: pl.LightningDataModule,
    steps: int,
    resume_from: str | Path | None,
    out_dir: Path,
    curve: ValidationCurve,
) -> None:
    """Train (or only validate, for 0 steps), save the final weights, validate them unless the
    last validation fell on the last step."""
    if steps > 0:
        trainer.fit(module, datamodule=datamodule, ckpt_path=resume_from)
    else:
        trainer.validate(module, datamodule=datamodule, verbose=False)
    # NOTE: ModelCheckpoint writes last.ckpt every checkpoint_every steps only; the run's result
    # is the final weights, so they are saved there too.
    trainer.save_checkpoint(out_dir / CHECKPOINT_DIR / LAST_CHECKPOINT)  # full: weights, optimizer, loops
    # NOTE: the result is the validation of the final weights. Lightning counts the validation
    # interval one batch off after a mid-epoch resume (Lightning issue #19367), so whether the
    # last validation fell on the last step is read from the curve, not computed from the interval.
    if not curve.curve or curve.curve[-1]["step"] != trainer.global_step:
        trainer.validate(module, datamodule=datamodule, verbose=False)
    elif "val/loss" not in trainer.callback_metrics:
        # NOTE: resumed from its final checkpoint: the curve (restored) and metrics.csv hold the
        # last validation already, but this process has no losses to return, so it validates
        # the same weights again without logging them twice.
        trainer.loggers = []
        trainer.validate(module, datamodule=datamodule, verbose=False)


def _earlier_metrics(out_dir: Path, resume_from: str | Path | None) -> list[dict[str, str]]:
    """The rows of ``out_dir``'s metrics.csv when the run resumes into its own directory (an
    interrupted run continued): Lightning's CSVLogger starts the file afresh."""
    metrics = out_dir / METRICS_FILE
    if resume_from is None or not metrics.is_file() or out_dir.resolve() not in Path(resume_from).resolve().parents:
        return []
    return _csv_rows(metrics)


def _keep_earlier_metrics(path: Path, earlier: list[dict[str, str]]) -> None:
    """Put the ``earlier`` rows the resumed run did not log again (same step, same columns) back in
    front of ``path``'s rows, so that metrics.csv holds the whole run."""
    if not earlier:
        return
    rows = _csv_rows(path) if path.is_file() else []
    logged = {(row.get("step"), frozenset(row)) for row in rows}
    merged = [row for row in earlier if (row.get("step"), frozenset(row)) not in logged] + rows
    merged.sort(key=lambda row: float(row.get("step", 0)))  # stable: earlier rows first within a step
    columns = sorted({key for row in merged for key in row})
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns)
    writer.writeheader()
    writer.writerows(merged)
    atomic_write_text(path, text.getvalue())


def _csv_rows(path: Path) -> list[dict[str, str]]:
    """Rows of a CSV file as text, empty cells dropped."""
    with open(path, newline="") as handle:
        return [{k: v for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(handle)]


def _initial_module(
    model_cfg: ModelConfig,
    run: RunConfig,
    vocab_size: int,
    init_from: str | Path | None,
    module_factory: ModuleFactory,
) -> MoELitModule:
    cfg = model_cfg.replace(vocab_size=vocab_size, seq_len=run.data.seq_len)
    if init_from is None:
        return module_factory(cfg, run.optim)
    from moe_lit.convert.model_input import load_any_model

    model = load_any_model(init_from)
    if model.config.vocab_size != vocab_size:
        raise MoeLitError(
            f"init_from: {init_from} has vocab_size {model.config.vocab_size} but the data has {vocab_size}"
        )
    module = module_factory(model.config.replace(seq_len=run.data.seq_len), run.optim)
    module.model.load_state_dict(model.state_dict())
    return module


def _late_routing_mean(
    module: MoELitModule, rows: Sequence[dict[str, float]], steps: int, name: str, dense: float
) -> float:
    """Mean logged ``routing/mean/<name>`` (a ``RouterStats`` property) of the second half of
    training; the last step's routing statistics when nothing was logged there; ``dense`` for a
    dense model."""
    layers = module.model.moe_layers()
    if not layers:
        return dense
    key = ROUTING_MEAN.format(name)
    late = [row[key] for row in rows if key in row and row.get("step", 0) >= steps / 2]
    late = late or [sum(getattr(stats, name) for stats in module.model.routing_stats().values()) / len(layers)]
    return sum(late) / len(late)


def _result(
    module: MoELitModule,
    trainer: pl.Trainer,
    languages: list[str],
    tokens_per_step: int,
    out_dir: Path,
    wall_s: float,
    curve: list[dict[str, float]],
) -> RunResult:
    cfg = module.config
    counts = count_config_params(cfg)
    metrics_csv = out_dir / METRICS_FILE
    rows = read_metrics(metrics_csv)
    final = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/loss")}
    steps = trainer.global_step
    return RunResult(
        total_params=counts.total,
        active_params=counts.active,
        flops_per_token=forward_flops_per_token(cfg),
        tokens=steps * tokens_per_step,
        steps=steps,
        val_loss=final.get("val/loss", math.nan),
        val_loss_per_language={lang: final.get(f"val/loss_{lang}", math.nan) for lang in languages},
        tokens_per_s=last_value(rows, "train/lengths") / last_value(rows, "train/time"),
        load_imbalance=_late_routing_mean(module, rows, steps, "load_imbalance", dense=1.0),
        dropped_fraction=_late_routing_mean(module, rows, steps, "dropped_fraction", dense=0.0),
        wall_s=round(wall_s, 3),
        checkpoint=str(out_dir / CHECKPOINT_DIR / LAST_CHECKPOINT),
        metrics_csv=str(metrics_csv),
        curve=curve,
        precision=str(trainer.precision),
    )


__all__ = ["CHECKPOINT_DIR", "LAST_CHECKPOINT", "RunResult", "read_metrics", "train_run"]
